"""The pure request gate (gpushare.control.gate): closed exactly while requests are in flight (plus
the hold), never longer than the in-flight timeout after the last signal, busy time measured."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.config import GateConfig
from gpushare.control import gate
from gpushare.control.gate import GateState

CFG = GateConfig(hold_s=0.002, inflight_timeout_s=5.0, busy_window_s=10.0)


def on() -> GateState:
    return gate.set_enabled(GateState(), True)


def test_a_request_closes_the_gate_and_its_end_opens_it_after_the_hold() -> None:
    s = gate.evaluate(gate.record(on(), "web", "web/pid:7", 1, 10.0), 10.0, CFG)
    assert s.closed and gate.inflight(s, 10.0, CFG) == 1
    s = gate.evaluate(gate.record(s, "web", "web/pid:7", 0, 10.5), 10.5, CFG)
    assert s.closed, "still closed during the hold"
    assert gate.reopens_at(s, CFG) == 10.5 + CFG.hold_s
    s = gate.evaluate(s, 10.5 + CFG.hold_s, CFG)
    assert not s.closed and gate.inflight(s, 10.6, CFG) == 0


def test_a_disabled_gate_never_closes_but_still_measures_busy_time() -> None:
    s = GateState()
    for i in range(30):
        s = gate.evaluate(gate.record(s, "web", "web/pid:7", 1, i * 0.1), i * 0.1, CFG)
        assert not s.closed
    assert s.busy
    assert gate.busy_fraction(s, 2.9, CFG) == 1.0


def test_a_silent_source_stops_holding_the_gate_after_the_timeout() -> None:
    s = gate.evaluate(gate.record(on(), "web", "web/pid:7", 3, 1.0), 1.0, CFG)
    assert gate.reopens_at(s, CFG) == 1.0 + CFG.inflight_timeout_s
    assert gate.evaluate(s, 1.0 + CFG.inflight_timeout_s, CFG).closed
    s = gate.evaluate(s, 1.0 + CFG.inflight_timeout_s + 1e-6, CFG)
    assert not s.closed and s.sources == ()
    assert not gate.knows(s, "web/pid:7"), "its late end is an end without a start"


def test_forget_releases_a_dead_clients_requests() -> None:
    s = gate.record(on(), "web", "web/pid:7", 2, 1.0)
    s = gate.evaluate(gate.record(s, "api", "api/gauge", 1, 1.0), 1.0, CFG)
    s = gate.evaluate(gate.forget(s, "web"), 1.1, CFG)
    assert s.closed and gate.inflight(s, 1.1, CFG) == 1
    s = gate.evaluate(gate.forget(s, "api"), 1.2, CFG)
    # The hold still counts from the last signal (1.0), long over.
    assert not s.closed


def test_counts_are_clamped() -> None:
    s = gate.record(on(), "web", "web/pid:7", 10**12, 0.0)
    assert gate.inflight(s, 0.0, CFG) == gate.MAX_INFLIGHT
    s = gate.record(s, "web", "web/pid:7", -5, 0.1)
    assert gate.inflight(s, 0.1, CFG) == 0


def test_busy_fraction_follows_the_share_of_time_requests_are_in_flight() -> None:
    s = on()
    t = 0.0
    # 20 s of 100 ms cycles: 30 ms in flight, 70 ms idle.
    while t < 20.0:
        s = gate.evaluate(gate.record(s, "web", "web/pid:1", 1, t), t, CFG)
        s = gate.evaluate(gate.record(s, "web", "web/pid:1", 0, t + 0.03), t + 0.03, CFG)
        s = gate.evaluate(s, t + 0.05, CFG)
        t = round(t + 0.1, 9)
    frac = gate.busy_fraction(s, t, CFG)
    assert frac is not None
    assert math.isclose(frac, 0.32, abs_tol=0.01)  # 30 ms + the 2 ms hold per 100 ms
    assert len(s.checkpoints) <= CFG.busy_window_s + 3


def test_busy_fraction_needs_a_second_of_history() -> None:
    s = gate.evaluate(gate.record(on(), "web", "web/pid:1", 1, 0.0), 0.0, CFG)
    assert gate.busy_fraction(s, 0.5, CFG) is None


def test_with_a_delay_the_gate_closes_only_once_the_spell_lasted_it() -> None:
    s = gate.set_enabled(GateState(), True, delay_s=0.05)
    s = gate.evaluate(gate.record(s, "web", "web/pid:7", 1, 10.0), 10.0, CFG)
    assert not s.closed and s.busy, "a request starts a spell; offline work runs beside it"
    assert gate.closes_at(s) == 10.05
    assert gate.due_at(s, CFG) == 10.05, "the timer wakes to close it, before any reopening"
    assert not gate.evaluate(s, 10.04, CFG).closed
    s = gate.evaluate(s, 10.05, CFG)
    assert s.closed and gate.closes_at(s) is None
    # A longer delay set now does not reopen it: the spell already lasted the old one.
    s = gate.evaluate(gate.set_enabled(s, True, delay_s=1.0), 10.06, CFG)
    assert s.closed
    s = gate.evaluate(gate.record(s, "web", "web/pid:7", 0, 10.1), 10.1, CFG)
    s = gate.evaluate(s, 10.1 + CFG.hold_s, CFG)
    assert not s.closed and not s.busy
    # A spell shorter than the delay never closes the gate.
    s = gate.evaluate(gate.record(s, "web", "web/pid:7", 1, 11.0), 11.0, CFG)
    s = gate.evaluate(gate.record(s, "web", "web/pid:7", 0, 11.5), 11.5, CFG)
    s = gate.evaluate(s, 12.0, CFG)
    assert not s.closed and gate.closes_at(s) is None
    # set_enabled without a delay keeps it; a negative one counts as 0.
    assert gate.set_enabled(s, False).delay_s == 1.0
    assert gate.set_enabled(s, True, delay_s=-3.0).delay_s == 0.0


# --------------------------------------------------------------------------- properties

events = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=3.0),  # time since the previous event
        st.sampled_from(["web/pid:1", "web/pid:2", "api/gauge", None]),  # None: only evaluate
        st.integers(min_value=-2, max_value=5),
        st.booleans(),  # the controller's lever
    ),
    max_size=60,
)
configs = st.builds(
    GateConfig,
    hold_s=st.floats(min_value=0.0, max_value=0.5),
    inflight_timeout_s=st.floats(min_value=0.6, max_value=8.0),
    busy_window_s=st.floats(min_value=1.0, max_value=20.0),
)


def test_an_idle_gate_is_settled_only_until_its_next_checkpoint_or_while_held() -> None:
    s = gate.evaluate(on(), 0.0, CFG)
    assert gate.settled(s, 0.5, CFG)
    assert gate.evaluate(s, 0.5, CFG) == s
    # A checkpoint is due: evaluating changes the state, so it is not settled.
    assert not gate.settled(s, 1.0, CFG)
    assert gate.evaluate(s, 1.0, CFG) != s
    assert not gate.settled(GateState(), 0.0, CFG), "never evaluated: no checkpoint yet"
    s = gate.evaluate(gate.record(s, "web", "web/pid:1", 1, 0.1), 0.1, CFG)
    assert not gate.settled(s, 0.2, CFG), "a request in flight"
    s = gate.evaluate(gate.record(s, "web", "web/pid:1", 0, 0.2), 0.2, CFG)
    assert not gate.settled(s, 0.2 + CFG.hold_s / 2, CFG), "closed for the hold"
    s = gate.evaluate(s, 0.3, CFG)
    assert not s.closed and gate.settled(s, 0.3, CFG)


@settings(max_examples=300, deadline=None)
@given(events, configs)
def test_gate_properties(evs: list[tuple[float, str | None, int, bool]], cfg: GateConfig) -> None:
    s = GateState()
    now = 0.0
    last_signal: float | None = None
    last_end: float | None = None
    for dt, key, count, enabled in evs:
        now += dt
        if enabled != s.enabled:
            s = gate.set_enabled(s, enabled)
        if key is not None:
            was = gate.inflight(s, now, cfg)
            s = gate.record(s, key.split("/")[0], key, count, now)
            last_signal = now
            if was and not gate.inflight(s, now, cfg):
                last_end = now
        if gate.settled(s, now, cfg):
            # The daemon's tick skips evaluating a settled gate: it must be a no-op.
            assert gate.evaluate(s, now, cfg) == s
        s = gate.evaluate(s, now, cfg)
        if s.closed:
            assert s.enabled, "a disabled gate never closes"
            # Never closed longer than the timeout after the last live signal.
            assert last_signal is not None
            assert now - last_signal <= cfg.inflight_timeout_s
        if s.enabled and gate.inflight(s, now, cfg) > 0:
            assert s.closed, "closed while any request is in flight"
        if (
            s.enabled
            and gate.inflight(s, now, cfg) == 0
            and last_signal is not None
            and now - last_signal < cfg.hold_s
            and last_end == last_signal
        ):
            assert s.closed, "closed for the hold after the last end"
        opens = gate.reopens_at(s, cfg)
        if opens is not None and key is not None:
            # Absent further signals the gate is open from reopens_at on.
            assert not gate.evaluate(s, opens + 1e-9, cfg).closed
        frac = gate.busy_fraction(s, now, cfg)
        assert frac is None or 0.0 <= frac <= 1.0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(min_value=0.001, max_value=2.0), min_size=1, max_size=40),
    configs,
)
def test_a_lying_source_holds_the_gate_only_while_it_keeps_talking(
    gaps: list[float], cfg: GateConfig
) -> None:
    """A source that says 'one in flight' and then falls silent frees the gate within the timeout."""
    s = on()
    now = 0.0
    for gap in gaps:
        now += gap
        s = gate.evaluate(gate.record(s, "liar", "liar/pid:9", 1, now), now, cfg)
        assert s.closed
    assert not gate.evaluate(s, now + cfg.inflight_timeout_s + 1e-6, cfg).closed


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=1.0),  # time since the previous event
            st.sampled_from(["web/pid:1", "web/pid:2", "api/gauge", None]),
            st.integers(min_value=-1, max_value=3),
            st.booleans(),  # gating on
            st.sampled_from([None, 0.0, 0.01, 0.2, 0.7, 3.0]),  # the delay (None: kept)
        ),
        max_size=60,
    ),
    configs,
)
def test_gate_delay_properties(
    evs: list[tuple[float, str | None, int, bool, float | None]], cfg: GateConfig
) -> None:
    """With delays: open beside at most ``delay`` of a request, closed only once a spell lasted
    it, never longer than the timeout after the last signal; ``closes_at`` is kept."""
    s = GateState()
    now = 0.0
    last_signal: float | None = None
    inflight_since: float | None = None  # requests in flight at every event since
    for dt, key, count, enabled, delay in evs:
        now += dt
        s = gate.set_enabled(s, enabled, delay)
        if key is not None:
            s = gate.record(s, key.split("/")[0], key, count, now)
            last_signal = now
        was_closed = s.closed
        s = gate.evaluate(s, now, cfg)
        if gate.inflight(s, now, cfg) > 0:
            inflight_since = now if inflight_since is None else inflight_since
        else:
            inflight_since = None
        if s.enabled and inflight_since is not None and now - inflight_since >= s.delay_s:
            assert s.closed, "never open longer than the delay into a request"
        if s.closed and not was_closed:
            assert s.busy_since_s is not None
            assert now - s.busy_since_s >= s.delay_s - 1e-9, "closed before the spell lasted it"
        if s.closed:
            assert s.enabled and last_signal is not None
            assert now - last_signal <= cfg.inflight_timeout_s
        closes = gate.closes_at(s)
        if closes is not None:
            assert not s.closed and s.enabled
            opens = gate.reopens_at(s, cfg)
            at = max(closes, now)
            if opens is not None and opens > at:
                # Absent further signals the timer's evaluation at closes_at closes it.
                assert gate.evaluate(s, at, cfg).closed
