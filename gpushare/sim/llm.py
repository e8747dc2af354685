"""A continuous-batching LLM inference server as a simulated online client.

:class:`LlmServer` runs the loop of vLLM-style servers (vLLM, SGLang, TensorRT-LLM's in-flight
batching): iteration after iteration, each one forward pass over every running sequence.

* **The batch.** Each iteration schedules, within a token budget (``max_batched_tokens``), one
  token for every sequence in decode, then the next chunk of prompts being prefilled (chunked
  prefill), then new requests from the FIFO queue while the budget, ``max_seqs`` and the KV cache
  allow. A sequence leaves when it has generated its output tokens.
* **The KV cache** holds ``kv_blocks`` blocks of ``block_tokens`` tokens. A request is admitted
  only when the blocks of its whole prompt are free (so the queue waits while the cache is full);
  a decode step that needs a block when none is free preempts the most recently admitted sequence,
  which frees its blocks and goes back to the head of the queue to be prefilled again over its
  prompt and the tokens it had generated (vLLM's recompute preemption).
* **The kernels.** An iteration is the kernel sequence :mod:`gpushare.sim.llm_cost` gives for its
  batch (a roofline per kernel), issued at once: the server is GPU-bound (CUDA graphs, an
  asynchronous scheduler), so its CPU adds ``iter_host_s`` between iterations and nothing between
  kernels. Its tokens are emitted when the iteration's last kernel ends.
* **Metrics.** Per request: time to first token (TTFT, arrival to the end of the iteration that
  finished its prompt) and time per output token (TPOT, ``(last token - first token) / (output -
  1)``), as vLLM's benchmark reports them. Under a daemon the server also reports its token
  timings as the client library's ``report_ttft`` and ``report_tpot`` do (``reports_tokens``).

Requests come from the Azure LLM conversation trace shipped in ``gpushare/data/azure-llm-2023``
(arrival times, prompt and output tokens; :func:`load_trace`, :func:`trace_requests`).
"""

from __future__ import annotations

import csv
import functools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpushare.model import ClientClass, ClientState
from gpushare.sim import data
from gpushare.sim.gpu import EventLoop, Gpu
from gpushare.sim.llm_cost import (
    DEFAULT_EFFICIENCY,
    LLAMA2_7B,
    V100_32G,
    Batch,
    Chunk,
    Efficiency,
    GpuRoof,
    LlmModel,
    iteration_rows,
    merge,
)
from gpushare.sim.llm_smshare import FITTED_S_SAT
from gpushare.sim.workloads import SimClient

#: The shipped Azure conversation trace with token counts (gpushare/data/azure-llm-2023/README.md).
CONV_TRACE = "azure-llm-2023/conv_tokens.csv"


@dataclass(frozen=True, slots=True)
class LlmRequest:
    """One request: when it arrives, its prompt and how many tokens it generates."""

    arrival_s: float
    prompt: int
    output: int


@functools.lru_cache(maxsize=4)
def load_trace(relative: str = CONV_TRACE) -> tuple[LlmRequest, ...]:
    """The requests of a trace (``arrival_s,context_tokens,generated_tokens``), by arrival.

    Raises:
        data.DataError: the file is missing or a row is malformed.
    """
    path = data.resolve(relative)
    out: list[LlmRequest] = []
    try:
        with data.open_text(path) as fh:
            for lineno, row in enumerate(csv.DictReader(fh), start=2):
                try:
                    req = LlmRequest(
                        float(row["arrival_s"]),
                        int(row["context_tokens"]),
                        int(row["generated_tokens"]),
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    raise data.DataError(f"{path}:{lineno}: bad row {row!r}") from exc
                if not (math.isfinite(req.arrival_s) and req.prompt >= 1 and req.output >= 1):
                    raise data.DataError(f"{path}:{lineno}: bad row {row!r}")
                out.append(req)
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise data.DataError(f"cannot read LLM trace {path}: {exc}") from exc
    if not out:
        raise data.DataError(f"LLM trace {path} has no rows")
    out.sort(key=lambda r: r.arrival_s)
    return tuple(out)


def trace_requests(
    trace: tuple[LlmRequest, ...],
    *,
    rate_scale: float,
    start_s: float = 0.0,
    end_s: float = math.inf,
    max_len: int = 4096,
) -> Iterator[LlmRequest]:
    """Replay ``trace`` from ``start_s``, thinned deterministically to ``rate_scale`` (<= 1).

    Arrivals are shifted to start at 0. A request longer than ``max_len`` (the model's context)
    keeps its output and has its prompt cut to fit, as a client truncating its history would.
    """
    acc = 0.0
    for req in trace:
        if req.arrival_s < start_s:
            continue
        t = req.arrival_s - start_s
        if t >= end_s:
            return
        acc += rate_scale
        if acc >= 1.0:
            acc -= 1.0
            output = min(req.output, max_len - 1)
            yield LlmRequest(t, max(1, min(req.prompt, max_len - output)), output)


@dataclass(frozen=True, slots=True)
class LlmServerConfig:
    """A server's model, GPU roof and scheduler limits (vLLM's names in parentheses)."""

    model: LlmModel = LLAMA2_7B
    roof: GpuRoof = V100_32G
    eff: Efficiency = DEFAULT_EFFICIENCY
    #: Tokens one iteration may process (``max_num_batched_tokens``).
    max_batched_tokens: int = 2048
    #: Sequences in one batch (``max_num_seqs``).
    max_seqs: int = 256
    #: KV-cache bytes (what ``gpu_memory_utilization`` leaves after the weights).
    kv_cache_bytes: int = 6 << 30
    #: Tokens per KV block (``block_size``).
    block_tokens: int = 16
    #: CPU time between two iterations (0: a GPU-bound server overlaps its scheduling).
    iter_host_s: float = 0.0
    #: The saturating fraction of its memory-bound kernels on fewer SMs (docs/simulator.md L3b):
    #: by default the one fitted on MuxServe's measured A100 decode steps, which validates at
    #: 7.9 % median error where G7 is off by 43 %; 0: G7, kept as a sensitivity.
    s_sat: float = FITTED_S_SAT

    @property
    def kv_blocks(self) -> int:
        """Blocks the KV cache holds."""
        return self.kv_cache_bytes // (self.model.kv_bytes_per_token * self.block_tokens)

    @property
    def mem_bytes(self) -> int:
        """GPU memory the server holds: its weights and its KV cache."""
        return self.model.weight_bytes + self.kv_cache_bytes


@dataclass(slots=True)
class _Seq:
    req: LlmRequest
    #: Tokens to prefill (the prompt, plus generated tokens after a preemption).
    target: int
    prefilled: int = 0
    generated: int = 0
    #: Tokens in the KV cache.
    kv: int = 0
    blocks: int = 0
    first_s: float | None = None
    last_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    """A completed request's timings (seconds)."""

    arrival_s: float
    prompt: int
    output: int
    ttft_s: float
    #: Mean time per output token after the first; None for a one-token output.
    tpot_s: float | None
    e2e_s: float


@dataclass(slots=True)
class LlmStats:
    """Counters of one server's run."""

    iterations: int = 0
    preemptions: int = 0
    #: Requests refused at arrival: prompt and output together need more blocks than the cache.
    rejected: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    finished: list[Finished] = field(default_factory=list)


class LlmServer(SimClient):
    """An LLM server with continuous batching (module docstring)."""

    def __init__(
        self,
        cid: str,
        gpu: Gpu,
        requests: Iterator[LlmRequest],
        config: LlmServerConfig | None = None,
        *,
        sm_pct: float = 100.0,
    ) -> None:
        cfg = config or LlmServerConfig()
        super().__init__(
            cid=cid, cls=ClientClass.ONLINE, gpu=gpu, sm_pct=sm_pct, mem_bytes=cfg.mem_bytes,
            pinned_mem_bytes=None,
        )  # fmt: skip
        self.cfg = cfg
        self.stream.sat = cfg.s_sat
        self._requests = requests
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.free_blocks = cfg.kv_blocks
        self.stats = LlmStats()
        self._chunks: tuple[Chunk, ...] = ()
        self._pos = 0
        self._batch: list[tuple[_Seq, int]] = []
        self._iter_t0 = 0.0
        self._in_iter = False
        #: The service's TTFT and TPOT p99 SLOs (ms; None: not set), as ``submit`` records them.
        self.slo_ttft_p99_ms: float | None = None
        self.slo_tpot_p99_ms: float | None = None
        #: Token timings as ``client.report_ttft`` / ``report_tpot`` would send them, kept only
        #: while ``reports_tokens`` is set (the daemon harness drains them every control period):
        #: ``(at_s, seconds)``, a TTFT when a request's first token is emitted and a TPOT per
        #: further token (the gap since the sequence's previous token, vLLM's inter-token latency)
        #: or, with ``tpot_per_token`` off, one per request (its mean) when it completes.
        self.reports_tokens = False
        self.tpot_per_token = True
        #: Report, at each further token, the sequence's mean TPOT so far instead of the gap.
        self.tpot_running = False
        self.ttft_reports: list[tuple[float, float]] = []
        self.tpot_reports: list[tuple[float, float]] = []

    # --- arrivals --------------------------------------------------------------------------

    def start(self, loop: EventLoop) -> None:
        """Begin accepting requests (schedules the first arrival) and attach to the GPU."""
        self.state = ClientState.RUNNING
        self.started_at_s = loop.now
        self._loop = loop
        self.gpu.attach(self)
        self._next_arrival()

    def _next_arrival(self) -> None:
        req = next(self._requests, None)
        if req is not None:
            self._loop.at(req.arrival_s, self._arrive, req)

    def _arrive(self, arg: object) -> None:
        assert isinstance(arg, LlmRequest)
        self._next_arrival()
        if self._blocks_for(arg.prompt + arg.output) > self.cfg.kv_blocks:
            # It could never be served (vLLM refuses such a prompt): it would block the queue.
            self.stats.rejected += 1
            return
        self.waiting.append(_Seq(arg, arg.prompt))
        if not self._in_iter:
            self._begin_iteration(self._loop.now)

    # --- the scheduler ---------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_tokens)

    def _preempt_last(self) -> bool:
        """Recompute-preempt the most recently admitted running sequence; False if none."""
        if not self.running:
            return False
        seq = self.running.pop()
        self.free_blocks += seq.blocks
        seq.blocks = seq.kv = seq.prefilled = 0
        seq.target = seq.req.prompt + seq.generated
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        return True

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """This iteration's sequences and the tokens each processes (module docstring)."""
        cfg = self.cfg
        budget = cfg.max_batched_tokens
        batch: list[tuple[_Seq, int]] = []
        scheduled: set[int] = set()
        # Decodes first: each needs one token and a block when it crosses a block boundary.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.prefilled < seq.target:
                i += 1
                continue
            need = self._blocks_for(seq.kv + 1) - seq.blocks
            while need > self.free_blocks and self.running[-1] is not seq:
                self._preempt_last()
            if need > self.free_blocks:  # it is the last one: preempt itself
                self._preempt_last()
                break
            self.free_blocks -= need
            seq.blocks += need
            batch.append((seq, 1))
            scheduled.add(id(seq))
            budget -= 1
            i += 1
        # Prompts being prefilled, in admission order.
        for seq in self.running:
            if budget <= 0:
                break
            if id(seq) not in scheduled and seq.prefilled < seq.target:
                n = min(budget, seq.target - seq.prefilled)
                batch.append((seq, n))
                budget -= n
        # New requests while the budget, the batch size and the cache allow.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_seqs:
            seq = self.waiting[0]
            need = self._blocks_for(seq.target)
            if need > self.free_blocks:
                break  # queueing: the KV cache is full
            self.waiting.popleft()
            self.free_blocks -= need
            seq.blocks = need
            self.running.append(seq)
            n = min(budget, seq.target)
            batch.append((seq, n))
            budget -= n
        return batch

    def _begin_iteration(self, now: float) -> None:
        if self.state is not ClientState.RUNNING:
            return
        batch = self._schedule()
        if not batch:
            self._in_iter = False
            return
        decode = decode_ctx = emit = 0
        prefill: list[tuple[int, int]] = []
        for seq, n in batch:
            if seq.prefilled >= seq.target:
                decode += 1
                decode_ctx += seq.kv + 1
                emit += 1
            else:
                prefill.append((n, seq.prefilled))
                if seq.prefilled + n >= seq.target:
                    emit += 1
        cfg = self.cfg
        rows = iteration_rows(
            Batch(decode, decode_ctx, tuple(prefill), emit), cfg.model, cfg.roof, cfg.eff
        )
        self._chunks = merge(rows)
        self._batch = batch
        self._pos = 0
        self._in_iter = True
        self._iter_t0 = now
        self.counts.issued += len(self._chunks)
        st = self.stream
        st.nxt = self._chunks[0]
        st.eligible_since = now
        self.gpu.wake()

    def on_kernel_done(self, now: float) -> None:
        """Advance the iteration; at its end emit its tokens and start the next one."""
        self.counts.done += 1
        p = self._pos + 1
        self._pos = p
        st = self.stream
        if p < len(self._chunks):
            st.nxt = self._chunks[p]
            st.eligible_since = now
            return
        st.nxt = None
        self._end_iteration(now)
        if self.cfg.iter_host_s > 0.0:
            self._loop.at(now + self.cfg.iter_host_s, self._after_host, None)
        else:
            self._begin_iteration(now)

    def _after_host(self, _: object) -> None:
        self._begin_iteration(self._loop.now)

    def _end_iteration(self, now: float) -> None:
        stats = self.stats
        stats.iterations += 1
        stats.busy_s += now - self._iter_t0
        done: list[_Seq] = []
        for seq, n in self._batch:
            seq.kv += n
            if seq.prefilled < seq.target:
                seq.prefilled += n
                if seq.prefilled < seq.target:
                    continue  # more prompt chunks to go: no token yet
            seq.generated += 1
            stats.tokens += 1
            if seq.first_s is None:
                seq.first_s = now
                if self.reports_tokens:
                    self.ttft_reports.append((now, now - seq.req.arrival_s))
            elif self.reports_tokens and self.tpot_running:
                # The sequence's mean TPOT so far: the per-request TPOT, known at every token.
                self.tpot_reports.append((now, (now - seq.first_s) / (seq.generated - 1)))
            elif self.reports_tokens and self.tpot_per_token:
                self.tpot_reports.append((now, now - seq.last_s))
            seq.last_s = now
            if seq.generated >= seq.req.output:
                done.append(seq)
        for seq in done:
            self.running.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
            req = seq.req
            first = seq.first_s if seq.first_s is not None else now
            tpot = (seq.last_s - first) / (req.output - 1) if req.output > 1 else None
            stats.finished.append(
                Finished(req.arrival_s, req.prompt, req.output, first - req.arrival_s, tpot,
                         now - req.arrival_s)
            )  # fmt: skip
            if tpot is not None and self.reports_tokens and not self.tpot_per_token:
                self.tpot_reports.append((now, tpot))

    def take_token_reports(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """The TTFT and TPOT reports since the last call (``(at_s, seconds)``), handed over."""
        out = self.ttft_reports, self.tpot_reports
        self.ttft_reports, self.tpot_reports = [], []
        return out

    def stop(self) -> None:
        """Stop serving: drop the queue and the iteration in flight."""
        self.counts.discarded += self.gpu.detach(self)
        self.stream.nxt = None
        self.waiting.clear()
        self.running.clear()
        self.state = ClientState.EXITED
        self._in_iter = False
