"""The simulator's incremental latency window against the direct computation; arrival series."""

from __future__ import annotations

import random

from gpushare.sim.workloads import (
    WindowLatencies,
    percentile,
    percentile_sorted,
    rate_series_arrivals,
)


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


def test_a_quiet_bin_does_not_end_a_rate_series_early() -> None:
    # The middle bin's rate is 1e-5 of the peak: its draw lands far past the end, which must move
    # on to the busy bin after it, not end the arrivals (genai-idle lost its last 8 s that way).
    arrivals = list(
        rate_series_arrivals((1.0, 1e-5, 1.0), bin_s=1.0, peak_rps=200.0, seed=7, end_s=3.0)
    )
    assert all(0.0 <= a < 3.0 for a in arrivals)
    assert sorted(arrivals) == arrivals
    last_bin = [a for a in arrivals if a >= 2.0]
    assert 140 < len(last_bin) < 260  # Poisson at 200/s for 1 s
    assert not [a for a in arrivals if 1.0 <= a < 2.0]
