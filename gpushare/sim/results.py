"""What one run of the simulator measured: per online service, per offline job, per GPU.

:func:`collect` turns a finished run (the simulated clients' completed requests and iterations,
the GPU busy integrals, the duty series) into a :class:`RunResult`; :mod:`gpushare.sim.report`
renders them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpushare.control.policy import Policy
from gpushare.sim import llm_node
from gpushare.sim.node import SimNode
from gpushare.sim.scenario import Scenario
from gpushare.stats import percentile

#: Width of the bins of the time series (offline throughput, online p99).
SERIES_BIN_S = 1.0


@dataclass
class OnlineResult:
    """What one online service saw in the measured window."""

    name: str
    requests: int
    p50_ms: float
    p99_ms: float
    slo_p99_ms: float | None
    slo_attainment: float | None
    latencies_ms: list[float] = field(repr=False, default_factory=list)
    #: p99 of the service time (from the moment the server took the request off its queue to its
    #: completion: queueing excluded), the latency tally-bench records (docs/simulator.md, section 4)
    service_p99_ms: float = math.nan


@dataclass
class OfflineResult:
    """What one offline job achieved in the measured window."""

    name: str
    iterations: int
    iter_per_s: float
    standalone_iter_per_s: float
    final_state: str
    failure: str | None


@dataclass
class RunResult:
    """One policy on one scenario."""

    scenario: str
    policy: str
    virtual_s: float
    wall_s: float
    online: list[OnlineResult]
    offline: list[OfflineResult]
    busy_fraction: float
    sm_active_fraction: float
    mem_peak_bytes: int
    mem_total_bytes: int
    actions: dict[str, int]
    kernels: dict[str, int]
    series: dict[str, Any] = field(repr=False, default_factory=dict)
    #: LLM servers (``[[llm]]``): TTFT and TPOT p99s and attainment of both SLOs.
    llm: list[llm_node.LlmResult] = field(default_factory=list)

    @property
    def speed_factor(self) -> float:
        """Virtual seconds simulated per wall-clock second."""
        return self.virtual_s / self.wall_s if self.wall_s > 0 else math.inf


@dataclass
class ScenarioResult:
    """Every policy on one scenario, with the standalone reference."""

    scenario: Scenario
    alone: RunResult | None
    slo_ms: dict[str, float]
    runs: list[RunResult]


def collect(
    node: SimNode,
    scenario: Scenario,
    policy: Policy[Any] | None,
    name: str | None,
    wall: float,
    duty_series: dict[str, list[tuple[float, float]]],
    busy_total: dict[str, float],
    sm_total: dict[str, float],
    actions: dict[str, int],
    ended: dict[str, tuple[str, str | None]],
) -> RunResult:
    """The run's results, from the simulated clients and the daemon's registry.

    ``ended`` has each offline job's final state and reason as the registry recorded them; a job
    that was never submitted is ``queued``.
    """
    warmup, end = scenario.warmup_s, scenario.duration_s
    window = end - warmup
    nbins = max(1, math.ceil(window / SERIES_BIN_S))
    series: dict[str, Any] = {"bin_s": SERIES_BIN_S, "t0_s": warmup, "duty": {}, "offline_ips": {}}
    online, series["online_p99_ms"] = _online_results(node, warmup, nbins)
    offline, series["offline_ips"] = _offline_results(node, warmup, window, nbins, ended)
    series["duty"] = {u: [(t, d) for t, d in s if t >= warmup] for u, s in duty_series.items()}
    n_gpus = len(node.gpus)
    kernels = {
        "issued": sum(c.counts.issued for c in node.clients),
        "done": sum(c.counts.done for c in node.clients),
        "discarded": sum(c.counts.discarded for c in node.clients),
    }
    return RunResult(
        scenario=scenario.name,
        policy=name or (policy.name if policy is not None else "none"),
        virtual_s=end,
        wall_s=wall,
        online=online,
        offline=offline,
        busy_fraction=sum(busy_total.values()) / (window * n_gpus),
        sm_active_fraction=sum(sm_total[g.uuid] / (window * g.sm_count) for g in node.gpus)
        / n_gpus,
        mem_peak_bytes=max(node.mem_peak_bytes.values()),
        mem_total_bytes=node.gpus[0].mem_total_bytes,
        actions=actions,
        kernels=kernels,
        series=series,
        llm=llm_node.results(node.llm, warmup),
    )


def _online_results(
    node: SimNode, warmup: float, nbins: int
) -> tuple[list[OnlineResult], dict[str, list[float | None]]]:
    """Each online service's results after the warm-up, and its p99 per series bin."""
    online: list[OnlineResult] = []
    p99_series: dict[str, list[float | None]] = {}
    for c in node.online:
        lats = [lat * 1e3 for arr, lat in c.completed if arr >= warmup]
        slo = c.slo_p99_ms
        att = (sum(1 for x in lats if x <= slo) / len(lats)) if (slo and lats) else None
        online.append(
            OnlineResult(
                name=c.cid,
                requests=len(lats),
                p50_ms=percentile(lats, 50.0),
                p99_ms=percentile(lats, 99.0),
                slo_p99_ms=slo,
                slo_attainment=att,
                latencies_ms=lats,
                service_p99_ms=percentile(
                    [svc * 1e3 for arr, svc in c.served if arr >= warmup], 99.0
                ),
            )
        )
        bins: list[list[float]] = [[] for _ in range(nbins)]
        for arr, lat in c.completed:
            if arr >= warmup:
                bins[min(nbins - 1, int((arr - warmup) / SERIES_BIN_S))].append(lat * 1e3)
        p99_series[c.cid] = [percentile(b, 99.0) if b else None for b in bins]
    return online, p99_series


def _offline_results(
    node: SimNode,
    warmup: float,
    window: float,
    nbins: int,
    ended: dict[str, tuple[str, str | None]],
) -> tuple[list[OfflineResult], dict[str, list[float]]]:
    """Each offline job's results after the warm-up, and its speed per series bin (of alone)."""
    offline: list[OfflineResult] = []
    ips_series: dict[str, list[float]] = {}
    for job in node.offline:
        its = [t for t in job.iterations if t >= warmup]
        standalone = 1.0 / job.profile.total_s
        offline.append(
            OfflineResult(
                name=job.cid,
                iterations=len(its),
                iter_per_s=len(its) / window,
                standalone_iter_per_s=standalone,
                final_state=ended.get(job.cid, ("queued", None))[0],
                failure=job.fail_reason or ended.get(job.cid, ("queued", None))[1],
            )
        )
        counts = [0] * nbins
        for t in its:
            counts[min(nbins - 1, int((t - warmup) / SERIES_BIN_S))] += 1
        ips_series[job.cid] = [n / SERIES_BIN_S / standalone for n in counts]
    return offline, ips_series
