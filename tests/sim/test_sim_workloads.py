"""Tests of the simulator's incremental latency window against the direct computation."""

from __future__ import annotations

import random

from gpushare.sim.workloads import WindowLatencies, percentile, percentile_sorted


def _direct(completed: list[tuple[float, float]], lo: float) -> list[float]:
    return sorted(lat * 1e3 for arr, lat in completed if arr + lat >= lo)


def test_window_latencies_match_sorting_the_window_every_period() -> None:
    rng = random.Random(3)
    completed: list[tuple[float, float]] = []
    window = WindowLatencies(completed)
    t = 0.0
    seen_removal = False
    for period in range(1, 400):
        now = period * 0.1
        while t < now:
            lat = rng.choice([0.002, 0.005, rng.uniform(0.001, 0.5)])
            t += rng.expovariate(200.0)
            completed.append((t - lat, lat))
        lo = now - 3.0
        got = window.update(lo)
        assert got == _direct(completed, lo)
        seen_removal = seen_removal or completed[0][0] + completed[0][1] < lo
        if got:
            assert percentile_sorted(got, 99.0) == percentile(_direct(completed, lo), 99.0)
    assert seen_removal  # the window slid past old completions


def test_percentile_sorted_of_nothing_is_nan() -> None:
    value = percentile_sorted([], 99.0)
    assert value != value
