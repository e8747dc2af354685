"""LLM servers of a scenario (``[[llm]]``) on the simulated node, the daemon's view of them, results.

:func:`llm_servers` builds a scenario's :class:`~gpushare.sim.llm.LlmServer` s; the runner
registers each with the daemon as an online service with TTFT and TPOT SLOs (:func:`register`)
and, every control period, hands the daemon its token timings through the daemon's token
windows (:func:`report_tokens`), the trackers ``client.report_ttft`` and ``report_tpot``
datagrams land in on a host. The controller then protects both SLOs with the worst of its
observed/SLO ratios, as it does for a real server. :func:`results` scores a run: each request
attains when its TTFT and its TPOT (the request's mean, vLLM's benchmark's) are inside the SLOs.

The SLOs travel in the runner's ``slo_ms`` map under ``NAME/ttft`` and ``NAME/tpot``
(:func:`slo_keys`), beside the request SLOs of ``[[online]]`` services.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpushare.daemon.registry import Registry
from gpushare.latency.p99 import TokenTrackers
from gpushare.sim.gpu import Gpu
from gpushare.sim.llm import LlmServer, LlmServerConfig, load_trace, trace_requests
from gpushare.sim.llm_pairs import capacity_rps
from gpushare.sim.scenario import LlmSpec, Scenario
from gpushare.stats import percentile


def slo_keys(name: str) -> tuple[str, str]:
    """The keys of an LLM server's TTFT and TPOT SLOs (ms) in the runner's ``slo_ms`` map."""
    return f"{name}/ttft", f"{name}/tpot"


def server_config(spec: LlmSpec) -> LlmServerConfig:
    """The server's scheduler limits and KV cache from its ``[[llm]]`` table."""
    return LlmServerConfig(
        kv_cache_bytes=spec.kv_cache_bytes,
        max_batched_tokens=int(spec.max_batched_tokens),
        max_seqs=int(spec.max_seqs),
        s_sat=spec.s_sat,
    )


def llm_servers(
    scenario: Scenario, gpus: Sequence[Gpu], next_pid: Callable[[], int]
) -> list[LlmServer]:
    """The scenario's LLM servers, not started, their SLOs the scenario's own (or none yet)."""
    out: list[LlmServer] = []
    if not scenario.llm:
        return out  # no trace to read
    trace = load_trace()
    span = trace[-1].arrival_s - trace[0].arrival_s
    for spec in scenario.llm:
        cfg = server_config(spec)
        scale = min(1.0, spec.load * capacity_rps(cfg) / (len(trace) / span))
        reqs = trace_requests(
            trace, rate_scale=scale, start_s=spec.trace_start_s, end_s=scenario.duration_s
        )
        srv = LlmServer(spec.name, gpus[spec.gpu], reqs, cfg, sm_pct=spec.sm_pct)
        srv.pid = next_pid()
        srv.tpot_per_token = spec.tpot_report != "request"
        srv.tpot_running = spec.tpot_report == "running"
        srv.slo_ttft_p99_ms = _ms(spec.slo_ttft_p99_s)
        srv.slo_tpot_p99_ms = _ms(spec.slo_tpot_p99_s)
        out.append(srv)
    return out


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def apply_slos(servers: Iterable[LlmServer], slo_ms: Mapping[str, float] | None) -> None:
    """Give each server the SLOs of ``slo_ms`` (:func:`slo_keys`) where it has them."""
    for srv in servers:
        ttft, tpot = slo_keys(srv.cid)
        if slo_ms and ttft in slo_ms:
            srv.slo_ttft_p99_ms = slo_ms[ttft]
        if slo_ms and tpot in slo_ms:
            srv.slo_tpot_p99_ms = slo_ms[tpot]


def register(registry: Registry, srv: LlmServer) -> None:
    """Record the server's token SLOs, as ``submit --slo-ttft-p99/--slo-tpot-p99`` does.

    From now on the server keeps its token timings for :func:`report_tokens`.
    """
    registry.update(
        srv.cid, slo_ttft_p99_ms=srv.slo_ttft_p99_ms, slo_tpot_p99_ms=srv.slo_tpot_p99_ms
    )
    srv.reports_tokens = True


def report_tokens(tokens: TokenTrackers, servers: Iterable[LlmServer]) -> None:
    """Hand each server's new token timings to the daemon's token windows.

    The trackers ``report_ttft`` / ``report_tpot`` datagrams are credited to on a host
    (:meth:`gpushare.latency.receiver.LatencyReceiver`'s ``_credit_tokens``), stamped with the
    virtual time each token was emitted.
    """
    for srv in servers:
        ttft, tpot = srv.take_token_reports()
        if ttft:
            tokens.ttft.add_many(srv.cid, ttft)
        if tpot:
            tokens.tpot.add_many(srv.cid, tpot)


@dataclass(frozen=True, slots=True)
class LlmResult:
    """What one LLM server saw after the warm-up."""

    name: str
    requests: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    slo_ttft_p99_ms: float | None
    slo_tpot_p99_ms: float | None
    #: Requests inside both SLOs (a one-token output: its TTFT alone); None without SLOs.
    slo_attainment: float | None
    preemptions: int
    rejected: int


def results(servers: Iterable[LlmServer], warmup_s: float) -> list[LlmResult]:
    """Each server's p99s and attainment over the requests that arrived after ``warmup_s``."""
    out = []
    for srv in servers:
        fin = [f for f in srv.stats.finished if f.arrival_s >= warmup_s]
        ttft = [f.ttft_s * 1e3 for f in fin]
        tpot = [f.tpot_s * 1e3 for f in fin if f.tpot_s is not None]
        s_ttft, s_tpot = srv.slo_ttft_p99_ms, srv.slo_tpot_p99_ms
        att: float | None = None
        if fin and (s_ttft is not None or s_tpot is not None):
            lim_ttft = s_ttft if s_ttft is not None else math.inf
            lim_tpot = s_tpot if s_tpot is not None else math.inf
            ok = sum(
                1
                for f in fin
                if f.ttft_s * 1e3 <= lim_ttft and (f.tpot_s is None or f.tpot_s * 1e3 <= lim_tpot)
            )
            att = ok / len(fin)
        out.append(
            LlmResult(
                srv.cid, len(fin), percentile(ttft, 99.0), percentile(tpot, 99.0), s_ttft, s_tpot,
                att, srv.stats.preemptions, srv.stats.rejected,
            )
        )  # fmt: skip
    return out


def slos_from_alone(scenario: Scenario, alone: Sequence[LlmResult]) -> dict[str, float]:
    """Each server's SLOs (ms): the scenario's, else ``slo_factor`` x its p99s alone."""
    out: dict[str, float] = {}
    for spec, res in zip(scenario.llm, alone, strict=True):
        ttft, tpot = slo_keys(spec.name)
        out[ttft] = _ms(spec.slo_ttft_p99_s) or spec.slo_factor * res.ttft_p99_ms
        out[tpot] = _ms(spec.slo_tpot_p99_s) or spec.slo_factor * res.tpot_p99_ms
    return out
