"""The sharing baselines on the Tally-shaped pairs against the hardware ranges (issue 33 item 4).

A pair is an inference server at load 0.5 next to one training job (``gpushare/scenarios/pairs``,
and their GPU-bound variants in ``gpushare/scenarios/gpubound``: 5 us of CPU per kernel instead of
eager PyTorch's 56.2 us). For each pair and baseline, :func:`pair_ratios` runs the pair alone and
under the baseline and returns the p99 over the p99 alone on two metrics:

* **latency**: completion - arrival, queueing included (the simulator's metric and gpushare's
  SLO); a server that falls behind shows it here, growing with the run;
* **service**: completion - the moment the server took the request off its queue, queueing
  excluded, the latency the published benchmark records (``tally-bench``'s ``ServerInferMonitor``;
  docs/simulator.md section 4, "What Tally measures").

:func:`checks` takes the medians over a set of pairs and sets them against :data:`RANGES`, the
ranges quoted in issue 13 for the published A100 comparison (12 pairs, servers at load 0.5 next to
training). They are the independent check, never a calibration target: nothing in the model is
fitted to them (docs/simulator.md, "Baselines for GPU-bound servers").
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpushare.control import registry
from gpushare.sim import runner
from gpushare.sim.scenario import Scenario

Metric = Literal["latency", "service"]
METRICS: tuple[Metric, ...] = ("latency", "service")
BASELINES = ("mps", "mps-priority", "time-slicing")

#: Median p99 over p99 alone per baseline that hardware measured for such pairs (issue 13's
#: table, from the published A100 comparison; measured on service time, queueing excluded).
RANGES: dict[str, tuple[float, float]] = {
    "mps": (1.3, 12.0),
    "mps-priority": (1.3, 6.0),
    "time-slicing": (1.8, 2.7),
}


@dataclass(frozen=True, slots=True)
class PairRatio:
    """One pair under one baseline: p99 over the p99 alone, on each metric."""

    pair: str
    baseline: str
    latency_ratio: float
    service_ratio: float

    def ratio(self, metric: Metric) -> float:
        """The ratio on ``metric``."""
        return self.latency_ratio if metric == "latency" else self.service_ratio


@dataclass(frozen=True, slots=True)
class Check:
    """The median of one baseline's ratios on one metric over a set of pairs, against its range."""

    baseline: str
    metric: Metric
    pairs: int
    median_ratio: float
    worst_ratio: float
    low_ratio: float
    high_ratio: float

    @property
    def inside(self) -> bool:
        """Whether the median lies in the published range (its ends included)."""
        return self.low_ratio <= self.median_ratio <= self.high_ratio

    @property
    def off_by(self) -> float:
        """How far the median is outside the range, as a factor.

        1.0 inside; over 1 above the high end (median / high), under 1 below the low end.
        """
        if self.median_ratio > self.high_ratio:
            return self.median_ratio / self.high_ratio
        if self.median_ratio < self.low_ratio:
            return self.median_ratio / self.low_ratio
        return 1.0


def pair_ratios(
    sc: Scenario,
    baselines: Sequence[str] = BASELINES,
    *,
    duration_s: float | None = None,
    slice_s: float | None = None,
    switch_s: float | None = None,
    host_per_kernel_s: float | None = None,
) -> list[PairRatio]:
    """Run ``sc`` alone and under each baseline: the ratios of each.

    The keywords override the scenario's run length and ``[gpu]`` constants (for sensitivities).
    """
    g = sc.gpu
    sc = dataclasses.replace(
        sc,
        duration_s=sc.duration_s if duration_s is None else duration_s,
        gpu=dataclasses.replace(
            g,
            slice_s=g.slice_s if slice_s is None else slice_s,
            switch_s=g.switch_s if switch_s is None else switch_s,
            host_per_kernel_s=g.host_per_kernel_s
            if host_per_kernel_s is None
            else host_per_kernel_s,
        ),
    )
    alone, slo = runner.standalone(sc)
    if alone is None:
        raise ValueError(f"{sc.name}: no online service to compare")
    ref = alone.online[0]
    out = []
    for name in baselines:
        policy = registry.make_policy(name, sc.config.control)
        res = runner.run_policy(sc, policy, name=name, slo_ms=slo).online[0]
        out.append(
            PairRatio(
                sc.name,
                name,
                res.p99_ms / ref.p99_ms,
                res.service_p99_ms / ref.service_p99_ms,
            )
        )
    return out


def checks(ratios: Iterable[PairRatio]) -> list[Check]:
    """Per baseline with a published range and per metric: the median and worst over the pairs."""
    by: dict[str, list[PairRatio]] = {}
    for r in ratios:
        by.setdefault(r.baseline, []).append(r)
    out = []
    for baseline, rows in by.items():
        if baseline not in RANGES:
            continue
        low, high = RANGES[baseline]
        for metric in METRICS:
            vals = [r.ratio(metric) for r in rows]
            out.append(
                Check(baseline, metric, len(vals), statistics.median(vals), max(vals), low, high)
            )
    return out
