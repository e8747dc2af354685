"""The per-client thaw history: fraction of the last minute and running total, bounded memory."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.daemon.thawlog import ThawLog


def test_duty_cycle_fraction_and_total():
    log = ThawLog()
    t = 1000.0
    log.set("c1", True, t)
    # 120 s of a 30 % duty cycle at a 100 ms period: thawed 30 ms, frozen 70 ms.
    for _ in range(1200):
        log.set("c1", False, t + 0.03)
        t += 0.1
        log.set("c1", True, t)
    assert log.fraction("c1", t) == pytest.approx(0.3, abs=0.01)
    assert log.total_s("c1", t) == pytest.approx(36.0, abs=1e-6)


def test_only_the_last_minute_counts():
    log = ThawLog()
    log.set("c1", True, 0.0)
    log.set("c1", False, 300.0)  # thawed five minutes, then frozen
    assert log.fraction("c1", 330.0) == pytest.approx(30 / 60, abs=1 / 60)
    assert log.fraction("c1", 400.0) == 0.0
    assert log.total_s("c1", 400.0) == pytest.approx(300.0)
    log.set("c1", True, 400.0)
    assert log.fraction("c1", 415.0) == pytest.approx(15 / 60, abs=1 / 60)


def test_young_client_is_measured_over_its_life():
    log = ThawLog()
    log.set("c1", True, 10.5)
    log.set("c1", False, 12.5)
    assert log.fraction("c1", 14.5) == pytest.approx(0.5)
    assert log.fraction("c1", 12.5) == pytest.approx(1.0)


def test_unknown_and_forgotten_clients():
    log = ThawLog()
    assert log.fraction("x", 1.0) is None
    assert log.total_s("x", 1.0) is None
    log.set("x", False, 5.0)
    assert log.fraction("x", 5.0) == 0.0  # no time yet: its current state
    assert log.thawed("x") is False
    log.forget("x")
    assert log.clients() == []
    assert log.thawed("x") is None


def test_memory_is_fixed_per_client():
    log = ThawLog(window_s=60.0, bin_s=1.0)
    log.set("c1", True, 0.0)
    for i in range(1, 20000):
        log.set("c1", i % 2 == 0, i * 0.05)
    track = log._tracks["c1"]
    assert len(track.bins) == len(track.ids) == 61


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="bin_s"):
        ThawLog(window_s=1.0, bin_s=2.0)


def _reference(edges, since, now, window_start):
    """Thawed seconds in [window_start, now] from the full list of (time, thawed) edges."""
    total = 0.0
    for (t0, state), (t1, _) in zip(edges, [*edges[1:], (now, None)], strict=True):
        lo, hi = max(t0, window_start), min(t1, now)
        if state and hi > lo:
            total += hi - lo
    return total


@settings(max_examples=80, deadline=None)
@given(
    st.floats(0.0, 1000.0),
    st.lists(st.tuples(st.floats(0.001, 20.0), st.booleans()), min_size=1, max_size=60),
    st.floats(0.0, 30.0),
)
def test_matches_a_full_history(start, steps, tail):
    log = ThawLog()
    edges = [(start, True)]
    log.set("c", True, start)
    t = start
    for dt, state in steps:
        t += dt
        log.set("c", state, t)
        edges.append((t, state))
    now = t + tail
    # The window is whole bins: from the start of the bin 60 before the current one.
    window_start = max(start, (math.floor(now) - 60) * 1.0)
    span = now - window_start
    want = _reference(edges, start, now, window_start)
    got = log.fraction("c", now)
    if span > 0:
        assert got == pytest.approx(want / span, abs=1e-6)
    assert log.total_s("c", now) == pytest.approx(_reference(edges, start, now, start), abs=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    st.floats(0.0, 5000.0),
    st.lists(
        st.tuples(st.floats(0.001, 90.0), st.booleans(), st.booleans()), min_size=1, max_size=80
    ),
)
def test_queries_between_edges_match_a_full_history(start, steps):
    """Asked at every edge (as status and metrics do each tick), the running sum stays exact."""
    log = ThawLog()
    edges = [(start, True)]
    log.set("c", True, start)
    t = start
    for dt, state, ask in steps:
        t += dt
        if ask:
            window_start = max(start, (math.floor(t) - 60) * 1.0)
            want = _reference(edges, start, t, window_start) / (t - window_start)
            assert log.fraction("c", t) == pytest.approx(want, abs=1e-6)
        log.set("c", state, t)
        edges.append((t, state))


def test_hours_of_duty_cycling_stay_exact():
    log = ThawLog()
    t = 1e6  # a monotonic clock of a machine up for days
    log.set("c", True, t)
    for i in range(6 * 3600 * 10):  # six hours of a 100 ms period at duty 0.25
        log.set("c", False, t + 0.025)
        t += 0.1
        log.set("c", True, t)
        if i % 997 == 0:
            assert log.fraction("c", t) == pytest.approx(0.25, abs=0.005)
    assert log.fraction("c", t) == pytest.approx(0.25, abs=0.005)
    assert log.total_s("c", t) == pytest.approx(6 * 3600 * 0.25, rel=1e-6)
