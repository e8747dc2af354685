"""The baselines against the hardware ranges (gpushare/sim/baseline_check.py, issue 33 item 4).

The checks bench/sim_pairs.py prints (and docs/simulator.md quotes) are computed from runs of the
model: a check is the median of the runs' ratios, and a ratio moves with the rule that makes it.
"""

from __future__ import annotations

import statistics

import pytest

from gpushare.sim import baseline_check, scenario
from gpushare.sim.baseline_check import Check, PairRatio

GPU_BOUND_BERT = "gpubound/bert_2_fwd+mobilenetv2_32_fb1"


@pytest.mark.parametrize("switch_s", [112e-6, 0.0])
def test_time_slicing_serves_a_gpu_bound_request_every_other_slice(switch_s: float) -> None:
    # A GPU-bound BERT-large request (49 ms, ~48 slices) next to a trainer that always has work
    # runs every other slice: its service time is 2 (slice + switch) / slice its time alone
    # (2.22x at the model's constants, 2x with free switches), which the check then reports.
    sc = scenario.load(GPU_BOUND_BERT)
    (ratio,) = baseline_check.pair_ratios(sc, ("time-slicing",), duration_s=4.0, switch_s=switch_s)
    expected = 2 * (sc.gpu.slice_s + switch_s) / sc.gpu.slice_s
    assert ratio.service_ratio == pytest.approx(expected, rel=0.03)
    # Queueing comes on top: the server needs half the GPU and gets at most half of it.
    assert ratio.latency_ratio > ratio.service_ratio
    (check,) = [c for c in baseline_check.checks([ratio]) if c.metric == "service"]
    assert check.median_ratio == ratio.service_ratio
    assert check.inside == (1.8 <= expected <= 2.7)


def test_a_check_is_the_median_and_worst_of_its_pairs() -> None:
    ratios = [
        PairRatio("a", "mps", 2.0, 1.5),
        PairRatio("b", "mps", 30.0, 3.0),
        PairRatio("c", "mps", 4.0, 2.5),
        PairRatio("a", "exclusive", 1.0, 1.0),  # no published range: no check
    ]
    by = {(c.baseline, c.metric): c for c in baseline_check.checks(ratios)}
    assert set(by) == {("mps", "latency"), ("mps", "service")}
    lat = by[("mps", "latency")]
    assert (lat.pairs, lat.median_ratio, lat.worst_ratio) == (3, 4.0, 30.0)
    assert lat.median_ratio == statistics.median(r.latency_ratio for r in ratios[:3])
    assert by[("mps", "service")].median_ratio == 2.5


def test_a_check_says_how_far_outside_the_range_it_is() -> None:
    inside = Check("time-slicing", "service", 14, 2.26, 2.3, 1.8, 2.7)
    above = Check("time-slicing", "latency", 14, 18.3, 27.4, 1.8, 2.7)
    under = Check("mps-priority", "service", 14, 1.17, 1.4, 1.3, 6.0)
    assert inside.inside and inside.off_by == 1.0
    assert not above.inside and above.off_by == pytest.approx(18.3 / 2.7)
    assert not under.inside and under.off_by == pytest.approx(1.17 / 1.3)
