"""An LLM server paired with a training job on one simulated GPU, under each way of sharing it.

:func:`run_pair` runs :class:`gpushare.sim.llm.LlmServer` (Llama-2-7B on a V100-32GB, the GPU of
the shipped training profiles) at a load that is a fraction of its capacity alone
(:func:`capacity_rps`), next to one shipped training profile, under one *setup*:

* ``exclusive``: the server alone (the reference for the SLOs);
* ``mps``: plain MPS, both clients at the same priority, no caps;
* ``mps-priority``: MPS with the server at priority 0 and the trainer at 1;
* ``time-slicing``: the default compute mode (one context at a time, 1,024 us slices);
* ``cap-N``: MPS priority with the trainer capped at N % of the SMs
  (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``);
* ``duty-D``: MPS priority with the trainer frozen for ``1 - D`` of every 100 ms (the duty
  cycle gpushare's controller sets, with the freezer's latencies of ``workloads.FREEZE_S``);
* ``mpsduty-D``: the same duty cycle under plain MPS (the trainer at the server's priority),
  the trainer's queue shallow (:data:`SHALLOW_BOUND` kernels in flight, ``GPUSHARE_MAX_INFLIGHT``)
  so that a freeze stops it within a few kernels instead of after its queued iteration;
* ``srvcap-N``: plain MPS with the *server* capped at N % of the SMs (decode is bound by memory
  bandwidth, so fewer SMs may cost it little) and the trainer uncapped;
* ``psrvcap-N``: MPS priority (the server at 0, the trainer at 1) with the *server* capped at
  N % of the SMs and the trainer uncapped: the trainer always has the other ``100 - N`` % and
  takes the server's gaps as under ``mps-priority`` (``submit --online --sm N``).

The SLOs are the p99 TTFT and p99 TPOT of the server alone at the same load, times a factor; a
request attains when both its TTFT and its TPOT are within them. Offline throughput is the
trainer's iterations per second over its rate alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from gpushare.sim import data
from gpushare.sim.gpu import EventLoop, Gpu, GpuMode
from gpushare.sim.llm import LlmRequest, LlmServer, LlmServerConfig, load_trace, trace_requests
from gpushare.sim.workloads import OfflineTrainer

#: The shipped training jobs (Orion V100 profiles) the pairs use.
TRAINERS = (
    "orion-v100-kernels/resnet50_32_fb1.csv",
    "orion-v100-kernels/bert_8_fb1.csv",
    "orion-v100-kernels/transformer_xl_8_fb1.csv",
)
SETUPS = ("exclusive", "mps", "mps-priority", "time-slicing", "cap-25", "cap-50", "duty-50")
#: The duty cycle's period (s).
DUTY_PERIOD_S = 0.1
#: Where in the trace the pairs start (s): past its first minutes.
TRACE_START_S = 600.0
V100_SMS = 80
#: The in-flight bound of ``mpsduty-D``'s trainer.
SHALLOW_BOUND = 2
DEFAULT_CONFIG = LlmServerConfig()
V100_MEM = 32 << 30


#: Setups that cap the server, not the trainer.
_SERVER_CAPPED = ("srvcap-", "psrvcap-")
#: Setups with a number after the prefix (module docstring).
_PREFIXES = ("cap-", "duty-", "mpsduty-", "srvcap-", "psrvcap-")


@dataclass(frozen=True, slots=True)
class PairResult:
    """One run: the server's per-request timings and the trainer's iterations."""

    setup: str
    trainer: str
    load: float
    #: Per request after the warm-up: (TTFT s, TPOT s or None for a one-token output).
    timings: tuple[tuple[float, float | None], ...]
    offline_it_per_s: float
    preemptions: int
    #: Fraction of the measured window the server had an iteration on the GPU.
    server_busy_frac: float = 0.0
    #: The inter-token gaps (s) emitted after the warm-up, what vLLM's inter-token histogram
    #: observes: kept for ``exclusive`` runs only (the reference of a gap-based TPOT SLO).
    itl_s: tuple[float, ...] = ()
    #: The MPS priority the trainer ran at, as last launched (daemon-driven runs; ``None``: not
    #: recorded).
    trainer_priority: int | None = None

    @property
    def ttft_s(self) -> tuple[float, ...]:
        """Every request's TTFT."""
        return tuple(t for t, _ in self.timings)

    @property
    def tpot_s(self) -> tuple[float, ...]:
        """Every TPOT (requests of more than one output token)."""
        return tuple(p for _, p in self.timings if p is not None)


def p99(values: tuple[float, ...]) -> float:
    """The 99th percentile (nearest rank); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@functools.lru_cache(maxsize=8)
def capacity_rps(config: LlmServerConfig = DEFAULT_CONFIG, n: int = 400) -> float:
    """Requests per second the server completes alone with a full queue (the trace's mix).

    ``n`` requests from :data:`TRACE_START_S` all arrive at 0; the rate is taken between the
    completion of the first quarter and of the last quarter (the steady state of a full batch).
    """
    trace = load_trace()
    reqs = [r for r in trace if r.arrival_s >= TRACE_START_S][:n]
    queued = iter(
        [
            LlmRequest(0.0, r.prompt, r.output)
            for r in trace_requests(tuple(reqs), rate_scale=1.0, start_s=TRACE_START_S)
        ]
    )
    loop = EventLoop()
    gpu = Gpu(loop, uuid="cap", index=0, sm_count=V100_SMS, mem_total_bytes=V100_MEM)
    srv = LlmServer("llm", gpu, queued, config)
    srv.start(loop)
    loop.run_until(1e5)
    ends = sorted(f.e2e_s for f in srv.stats.finished)
    lo, hi = ends[len(ends) // 4], ends[3 * len(ends) // 4]
    return (3 * len(ends) // 4 - len(ends) // 4) / (hi - lo)


def _trainer_alone_it_s(profile: str, duration_s: float) -> float:
    loop = EventLoop()
    gpu = Gpu(loop, uuid="solo", index=0, sm_count=V100_SMS, mem_total_bytes=V100_MEM)
    prof = data.load_profile(profile, data.DEFAULT_MERGE_OFFLINE_US, V100_SMS)
    tr = OfflineTrainer("train", gpu, prof, sm_pct=100.0, mem_bytes=0)
    tr.start(0.0)
    loop.run_until(duration_s)
    return len(tr.iterations) / duration_s


def run_pair(
    setup: str,
    trainer: str | None,
    load: float,
    *,
    duration_s: float = 120.0,
    config: LlmServerConfig | None = None,
) -> PairResult:
    """One server (at ``load`` of its capacity) with ``trainer`` (None: alone) under ``setup``.

    Raises:
        ValueError: an unknown setup, a setup's number not a percentage in (0, 100], or a load
            outside (0, 1].
    """
    if not 0.0 < load <= 1.0:
        raise ValueError(f"load {load!r}: expected a fraction of capacity in (0, 1]")
    if setup not in SETUPS and not setup.startswith(_PREFIXES):
        raise ValueError(f"unknown setup {setup!r}: expected one of {', '.join(SETUPS)}")
    if setup not in SETUPS:
        _percentage(setup)
    cfg = config or LlmServerConfig()
    trace = load_trace()
    span = trace[-1].arrival_s - trace[0].arrival_s
    scale = min(1.0, load * capacity_rps(cfg) / (len(trace) / span))
    loop = EventLoop()
    mode: GpuMode = "time_slice" if setup == "time-slicing" else "mps"
    gpu = Gpu(loop, uuid="g", index=0, sm_count=V100_SMS, mem_total_bytes=V100_MEM, mode=mode)
    reqs = trace_requests(trace, rate_scale=scale, start_s=TRACE_START_S, end_s=duration_s)
    srv_pct = _percentage(setup) if setup.startswith(_SERVER_CAPPED) else 100.0
    srv = LlmServer("llm", gpu, reqs, cfg, sm_pct=srv_pct)
    srv.reports_tokens = setup == "exclusive"
    srv.start(loop)
    tr: OfflineTrainer | None = None
    if trainer is not None and setup != "exclusive":
        prof = data.load_profile(trainer, data.DEFAULT_MERGE_OFFLINE_US, V100_SMS)
        pct = float(setup[4:]) if setup.startswith("cap-") else 100.0
        tr = OfflineTrainer("train", gpu, prof, sm_pct=pct, mem_bytes=0)
        tr.stream.priority = 0 if setup == "mps" or setup.startswith(("mpsduty-", "srvcap-")) else 1
        tr.start(0.0)
        if setup.startswith("mpsduty-"):
            tr.set_inflight(SHALLOW_BOUND)
        if setup.startswith(("duty-", "mpsduty-")):
            _duty_cycle(loop, tr, float(setup.split("-", 1)[1]) / 100.0, duration_s)
    loop.run_until(duration_s)
    fin = [f for f in srv.stats.finished if f.arrival_s >= 0.1 * duration_s]
    it_s = 0.0
    if tr is not None:
        warm = [t for t in tr.iterations if t >= 0.1 * duration_s]
        it_s = len(warm) / (0.9 * duration_s)
    return PairResult(
        setup,
        trainer or "",
        load,
        tuple((f.ttft_s, f.tpot_s) for f in fin),
        it_s,
        srv.stats.preemptions,
        srv.stats.busy_s / duration_s,
        tuple(g for at, g in srv.tpot_reports if at >= 0.1 * duration_s),
    )


def _percentage(setup: str) -> float:
    """The number after a setup's prefix (``psrvcap-85``: 85), a percentage in (0, 100]."""
    text = setup.split("-", 1)[1]
    try:
        pct = float(text)
    except ValueError:
        pct = math.nan
    if not 0.0 < pct <= 100.0:
        raise ValueError(f"setup {setup!r}: expected a percentage in (0, 100] after the prefix")
    return pct


def _duty_cycle(loop: EventLoop, tr: OfflineTrainer, duty: float, end_s: float) -> None:
    """Freeze ``tr`` for ``1 - duty`` of every :data:`DUTY_PERIOD_S`."""
    t = 0.0
    while t < end_s:
        loop.at(t + duty * DUTY_PERIOD_S, lambda _: tr.set_frozen(True, loop.now), None)
        loop.at(t + DUTY_PERIOD_S, lambda _: tr.set_frozen(False, loop.now), None)
        t += DUTY_PERIOD_S


@functools.lru_cache(maxsize=16)
def trainer_alone_it_s(profile: str, duration_s: float = 30.0) -> float:
    """The training job's iterations per second alone on the GPU."""
    return _trainer_alone_it_s(profile, duration_s)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A run scored against the server's SLOs alone."""

    result: PairResult
    slo_factor: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    attainment: float
    offline_norm: float


def score(result: PairResult, alone: PairResult, factor: float) -> Outcome:
    """Attainment of both SLOs (``factor`` x the p99s alone) and normalised offline throughput."""
    slo_ttft = factor * p99(alone.ttft_s)
    slo_tpot = factor * p99(alone.tpot_s)
    # A one-token request has no TPOT: it attains on its TTFT alone.
    n = len(result.timings)
    ok = sum(1 for t, p in result.timings if t <= slo_ttft and (p is None or p <= slo_tpot))
    attained = ok / n if n else math.nan
    solo = trainer_alone_it_s(result.trainer) if result.trainer else 0.0
    return Outcome(
        result,
        factor,
        p99(result.ttft_s) * 1e3,
        p99(result.tpot_s) * 1e3,
        attained,
        result.offline_it_per_s / solo if solo else 0.0,
    )
