"""The simulator's arrival series."""

from __future__ import annotations

from gpushare.sim.arrivals import rate_series_arrivals


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
