"""Windowed statistics: nearest rank, PromQL's bucket interpolation, the sorted sliding window."""

from __future__ import annotations

import math
import random

import pytest

from gpushare.latency.p99 import P99Tracker
from gpushare.node.probe_window import ProbeWindow
from gpushare.stats import SortedWindow, bucket_quantile, percentile, percentile_sorted


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(1, 1001)), 99) == 990
    assert percentile(list(range(1, 1001)), 50.0) == 500
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input is sorted


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile_sorted([], 99.0))
    assert math.isnan(percentile([], 50.0))


def test_bucket_quantile_interpolates_like_promql() -> None:
    # 980 requests under 25 ms, 20 between 250 and 500 ms: the 990th lies halfway into (0.25, 0.5].
    counts = {0.025: 980, 0.05: 980, 0.1: 980, 0.25: 980, 0.5: 1000, math.inf: 1000}
    assert bucket_quantile(0.99, counts) == pytest.approx(0.375)
    # Rank in +Inf: the largest finite bound.
    assert bucket_quantile(0.99, {0.1: 10, math.inf: 100}) == 0.1
    assert bucket_quantile(0.99, {}) is None
    assert bucket_quantile(0.99, {0.1: 0, math.inf: 0}) is None
    # Non-monotonic scrape (racing increments): fixed up, not crashing.
    # Monotone fix: 0.2 counts as 10, so the 12th of 20 lies 2/10 into (0.2, 0.3].
    assert bucket_quantile(0.6, {0.1: 10, 0.2: 8, 0.3: 20, math.inf: 20}) == pytest.approx(0.22)


def _direct(taken: list[tuple[float, float]], lo: float) -> list[float]:
    return sorted(v for t, v in taken if t >= lo)


def test_sorted_window_matches_sorting_the_window_every_period() -> None:
    rng = random.Random(3)
    taken: list[tuple[float, float]] = []
    window = SortedWindow()
    t = 0.0
    for period in range(1, 400):
        now = period * 0.1
        while t < now:
            t += rng.expovariate(200.0)
            value = rng.choice([2.0, 5.0, rng.uniform(1.0, 500.0)])
            taken.append((t, value))
            window.add(t, value)
        lo = now - 3.0
        got = window.since(lo)
        assert got == _direct(taken, lo)
        assert len(window) == len(got)
        assert window.percentile(99.0) == percentile(_direct(taken, lo), 99.0)
    assert taken[0][0] < lo  # the window slid past old values


def test_a_bounded_window_drops_its_oldest_value() -> None:
    window = SortedWindow(max_len=3)
    for at, value in [(0.0, 9.0), (1.0, 1.0), (2.0, 5.0), (3.0, 7.0)]:
        window.add(at, value)
    assert window.since(0.0) == [1.0, 5.0, 7.0]  # 9.0, the oldest, is gone though the largest


def test_the_app_tracker_and_the_probe_rank_as_the_module_does() -> None:
    values = [float(v) for v in random.Random(5).sample(range(1, 10_000), 250)]
    tracker = P99Tracker(window_s=100.0, min_samples=1)
    probe = ProbeWindow(window_s=100.0, baseline_window_s=100.0, period_s=0.05)
    for i, v in enumerate(values):
        tracker.add("c", v, at_s=i * 0.1)
        probe.add(at_s=i * 0.1, latency_ms=v, run_ms=v)
    now = len(values) * 0.1
    assert tracker.p99("c", now).p99_ms == pytest.approx(percentile(values, 99.0) * 1000.0)
    assert probe.reading(now).latency_ms == percentile(values, 99.0)
