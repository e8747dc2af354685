"""The controller's gating lever (SetGating), alone and in a closed loop with the pure gate."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.support.observations import GPU, observation, offline, online
from gpushare.config import ControlConfig, GateConfig
from gpushare.control import gate
from gpushare.control.controller import GpushareController
from gpushare.control.gate import GateState
from gpushare.model import GateReading, Observation, RestartClient, SetGating

CTL = GpushareController(ControlConfig())
GCFG = GateConfig()


def reading(signalled: int = 1, busy: float | None = 0.3, enabled: bool = False) -> GateReading:
    return GateReading(
        enabled=enabled, closed=False, inflight=0, signalled_clients=signalled, busy_fraction=busy
    )


def gating_actions(actions: object) -> list[SetGating]:
    assert isinstance(actions, list | tuple)
    return [a for a in actions if isinstance(a, SetGating)]


def test_no_gate_reading_means_no_gating_action() -> None:
    obs = observation((online(p99_ms=10.0), offline()))
    state = CTL.initial_state(GPU, 0.0)
    for i in range(5):
        state, actions = CTL.step(state, obs, i * 0.1)
        assert not gating_actions(actions)


def test_gating_follows_request_boundaries_and_busy_share() -> None:
    base = observation((online(p99_ms=10.0), offline()))
    state = CTL.initial_state(GPU, 0.0)
    state, actions = CTL.step(state, replace(base, gate=reading(signalled=0)), 0.0)
    assert [a.on for a in gating_actions(actions)] == [False]
    state, actions = CTL.step(state, replace(base, gate=reading()), 0.1)
    (on,) = gating_actions(actions)
    assert on.on
    assert "1 online client(s) send request boundaries" in on.reason
    state, actions = CTL.step(state, replace(base, gate=reading()), 0.2)
    assert not gating_actions(actions), "sent only when it changes"
    # Busy nearly all the time: off, and back on only 0.1 under max_busy.
    state, actions = CTL.step(state, replace(base, gate=reading(busy=0.95)), 0.3)
    (off,) = gating_actions(actions)
    assert not off.on
    assert "the duty cycle decides" in off.reason
    state, actions = CTL.step(state, replace(base, gate=reading(busy=0.85)), 0.4)
    assert not gating_actions(actions)
    state, actions = CTL.step(state, replace(base, gate=reading(busy=0.75)), 0.5)
    assert [a.on for a in gating_actions(actions)] == [True]
    # No online client left: off.
    gone = replace(observation((offline(),)), gate=reading())
    state, actions = CTL.step(state, gone, 0.6)
    assert [a.on for a in gating_actions(actions)] == [False]


def _closed_loop(pattern: list[tuple[float, int]], seconds: float) -> tuple[float, float, bool]:
    """Run controller and pure gate together.

    Returns:
        The longest closed spell seen at the ticks, the last tick it was closed, and whether
        gating was on at the end.

    ``pattern`` is a cycle of (duration, count) a single source reports, one datagram each.
    """
    obs0 = observation((online(p99_ms=10.0), offline()))
    ctl_state = CTL.initial_state(GPU, 0.0)
    g = GateState()
    period = CTL.config.period_s
    now, tick, i = 0.0, 0.0, 0
    closed_since: float | None = None
    longest, last_closed = 0.0, -1.0
    while now < seconds:
        dur, count = pattern[i % len(pattern)]
        i += 1
        g = gate.evaluate(gate.record(g, "web", "web/pid:1", count, now), now, GCFG)
        end = now + dur
        while tick <= end and tick < seconds:
            g = gate.evaluate(g, tick, GCFG)
            view = GateReading(
                enabled=g.enabled,
                closed=g.closed,
                inflight=gate.inflight(g, tick, GCFG),
                signalled_clients=1,
                busy_fraction=gate.busy_fraction(g, tick, GCFG),
                max_busy=GCFG.max_busy,
            )
            obs: Observation = replace(obs0, gate=view)
            ctl_state, actions = CTL.step(ctl_state, obs, tick)
            for a in gating_actions(actions):
                g = gate.evaluate(gate.set_enabled(g, a.on), tick, GCFG)
            if g.closed:
                closed_since = tick if closed_since is None else closed_since
                longest = max(longest, tick - closed_since)
                last_closed = tick
            else:
                closed_since = None
            tick = round(tick + period, 9)
        now = end
    return longest, last_closed, g.enabled


def test_a_client_that_claims_a_request_forever_cannot_freeze_offline_work_for_good() -> None:
    # One datagram "1 in flight" every second, never an end.
    longest, last_closed, _ = _closed_loop([(1.0, 1)], 60.0)
    # Off once the busy share passes max_busy over the window: within the window, never again.
    assert longest <= GCFG.busy_window_s + 0.2
    assert last_closed <= GCFG.busy_window_s + 0.2


@settings(max_examples=30, deadline=None)
@given(
    st.floats(min_value=0.005, max_value=0.2),
    # Idle spells longer than two ticks: the loop looks at the gate once a tick.
    st.floats(min_value=0.25, max_value=0.5),
)
def test_gating_stays_on_for_a_service_with_idle_time(busy_s: float, idle_s: float) -> None:
    """A service busy under max_busy of the time keeps gating on: closed spells follow requests."""
    frac = (busy_s + GCFG.hold_s) / (busy_s + idle_s)
    longest, _, enabled = _closed_loop([(busy_s, 1), (idle_s, 0)], 20.0)
    if frac < GCFG.max_busy - 0.15:
        assert enabled, "gating still on at the end"
        assert longest <= busy_s + GCFG.hold_s + CTL.config.period_s + 1e-6


def _restarts(actions: object) -> list[RestartClient]:
    assert isinstance(actions, list | tuple)
    return [a for a in actions if isinstance(a, RestartClient)]


@pytest.mark.parametrize("alone", [True, False])
def test_a_deep_auto_client_is_relaunched_shallow_soon_after_gating_turns_on(alone: bool) -> None:
    # The job was admitted before the service's first request: --queue auto launched it deep.
    cfg = ControlConfig(share_min_interval_s=60.0)
    ctl = GpushareController(cfg)
    trainer = replace(offline("t1", restartable=True), queue="auto", shallow=False)
    fixed = replace(offline("t2", restartable=True), queue="deep", shallow=False)
    jobs = (trainer,) if alone else (trainer, fixed)
    obs = replace(observation((online(p99_ms=10.0), *jobs)), gate=reading())
    state = ctl.initial_state(GPU, 0.0)
    seen: list[tuple[float, RestartClient]] = []
    for i in range(100):  # 10 s
        now = i * 0.1
        state, actions = ctl.step(state, obs, now)
        seen += [(now, a) for a in _restarts(actions)]
        if seen and state.restart_pending is not None:
            # The runner relaunched it shallow, under the share asked for.
            again = replace(
                trainer,
                shallow=True,
                started_at_s=now,
                limits=replace(trainer.limits, sm_pct=seen[0][1].sm_pct),
            )
            obs = replace(obs, clients=(obs.clients[0], again, *jobs[1:]))
    (at, restart), *more = seen
    assert not more, "one relaunch, for the auto client only"
    # Not share_min_interval: a second of gating on (and a busy share) is the whole wait.
    assert 1.0 <= at <= 1.2
    assert restart.client_id == "t1"
    assert "shallow" in restart.reason
    if alone:
        # Gated with no deep queue left: the share goes straight to the ceiling, one checkpoint.
        assert restart.sm_pct == cfg.offline_sm_pct_max
        assert state.share_pct == cfg.offline_sm_pct_max
    else:
        # t2 keeps its deep queue: the duty cycle and the share stay in charge; its share stays.
        assert restart.sm_pct == trainer.limits.sm_pct
    assert state.restart_pending is None, "the relaunch ended the pending record"


def test_gating_off_relaunches_auto_clients_deep_only_after_the_interval() -> None:
    # The way back only saves the launch gap: it waits share_min_interval, which bounds churn.
    cfg = ControlConfig(share_min_interval_s=60.0)
    ctl = GpushareController(cfg)
    trainer = replace(offline("t1", restartable=True), queue="auto", shallow=True)
    obs = replace(observation((online(p99_ms=10.0), trainer)), gate=reading(signalled=0))
    state = ctl.initial_state(GPU, 0.0)
    seen: list[float] = []
    for i in range(700):  # 70 s
        now = i * 0.1
        state, actions = ctl.step(state, obs, now)
        seen += [now for a in _restarts(actions)]
        if seen and state.restart_pending is not None:
            obs = replace(
                obs, clients=(obs.clients[0], replace(trainer, shallow=False, started_at_s=now))
            )
    assert len(seen) == 1
    assert seen[0] >= cfg.share_min_interval_s


def test_a_relaunch_ends_the_pending_restart_whatever_the_share_did_meanwhile() -> None:
    # Relaunched shallow at 10 % while gating moved the share to the ceiling: the restart asked
    # for has happened; waiting for the client to match the new share held the next restart
    # (to the ceiling) for the 300 s restart patience.
    job = replace(offline("t1", restartable=True, sm_pct=10.0), queue="auto", shallow=True)
    obs = replace(
        observation((online(p99_ms=10.0), replace(job, started_at_s=5.5))),
        gate=reading(enabled=True),
    )
    state = replace(
        CTL.initial_state(GPU, 0.0),
        share_pct=10.0,
        share_emitted=True,
        gating_emitted=True,
        gating_changed_at_s=1.0,
        restart_pending=("t1", 5.0),
    )
    # A restart that costs nothing: the pending one is what this test is about (issue 32).
    ctl = GpushareController(ControlConfig(restart_cost_s=0.0))
    state, actions = ctl.step(state, obs, 6.0)
    assert state.share_pct == CTL.config.offline_sm_pct_max
    (restart,) = _restarts(actions)
    assert restart.sm_pct == CTL.config.offline_sm_pct_max
    # Not yet relaunched (started before the request): still pending, nothing more asked.
    state = replace(state, restart_pending=("t1", 5.0))
    stale = replace(obs, clients=(obs.clients[0], replace(job, started_at_s=4.0)))
    state, actions = ctl.step(state, stale, 6.1)
    assert state.restart_pending == ("t1", 5.0)
    assert not _restarts(actions)


def _duty_after_breach(gating: bool, p99_ms: float, *, shallow: bool = True) -> float | None:
    """The duty the controller sets when the online p99 jumps to ``p99_ms`` (SLO 40 ms)."""
    job = replace(offline(), shallow=shallow)
    calm = observation((online(p99_ms=20.0), job))
    state = CTL.initial_state(GPU, 0.0)
    g = reading(signalled=1 if gating else 0, enabled=gating)
    for i in range(3):
        state, _ = CTL.step(state, replace(calm, gate=g), i * 0.1)
    assert state.gating_emitted is gating
    hot = replace(observation((online(p99_ms=p99_ms), job)), gate=g)
    state, actions = CTL.step(state, hot, 0.3)
    return state.duty


def test_gated_a_breach_under_the_hard_ratio_leaves_the_duty_to_the_gate() -> None:
    # 1.25x the SLO: the cut ratio's breach. Without gating the duty goes to 0 at once.
    assert _duty_after_breach(False, 50.0) == 0.0
    # Gated with a shallow queue, offline work is frozen while requests are in flight already:
    # the duty stays.
    assert _duty_after_breach(True, 50.0) == 1.0
    # A deep queue runs on past a freeze: the duty cycle cuts as without gating.
    assert _duty_after_breach(True, 50.0, shallow=False) == 0.0
    # Past the hard ratio (2x) gating has evidently not contained it: cut.
    assert _duty_after_breach(True, 81.0) == 0.0


@pytest.mark.parametrize("jobs", [1, 2])
def test_gated_the_offline_share_is_the_gpus_ceiling(jobs: int) -> None:
    # Not split between offline clients either: they share the time between requests only.
    offs = tuple(replace(offline(f"train{i}"), shallow=True) for i in range(jobs))
    obs = observation((online(p99_ms=20.0), *offs))
    g = reading(signalled=1, enabled=True)
    state = replace(CTL.initial_state(GPU, 0.0), share_pct=30.0, share_emitted=True)
    shares = []
    for i in range(5):
        state, actions = CTL.step(state, replace(obs, gate=g), i * 0.1)
        shares += [a for a in actions if type(a).__name__ == "SetOfflineShare"]
    assert shares and shares[-1].sm_pct == ControlConfig().offline_sm_pct_max
    assert "request gating on" in shares[-1].reason


def test_gated_the_duty_follows_the_app_latency_not_the_probe() -> None:
    # The probe meets offline work between requests, where gating puts it on purpose: at 3x its
    # SLO it cuts the duty without gating (hard ratio), not with it while the app latency is fine.
    job = replace(offline(), shallow=True)
    for gating, expect in ((False, 0.0), (True, 1.0)):
        g = reading(signalled=1 if gating else 0, enabled=gating)
        state = CTL.initial_state(GPU, 0.0)
        calm = replace(observation((online(p99_ms=20.0), job)), gate=g)
        for i in range(3):
            state, _ = CTL.step(state, calm, i * 0.1)
        hot = replace(observation((online(p99_ms=20.0), job), probe_ratio=3.0), gate=g)
        state, _ = CTL.step(state, hot, 0.3)
        assert state.duty == expect, gating


def test_entering_gating_with_shallow_queues_resets_a_duty_set_without_it() -> None:
    # A breach while the offline client ran a deep queue cut the duty; relaunched shallow under
    # gating, the duty starts again at 1 instead of climbing back from 0 for half a minute.
    g = reading(signalled=1, enabled=True)
    deep = replace(offline(), shallow=False)
    state = CTL.initial_state(GPU, 0.0)
    for i in range(3):
        calm = replace(observation((online(p99_ms=20.0), deep)), gate=g)
        state, _ = CTL.step(state, calm, i * 0.1)
    hot = replace(observation((online(p99_ms=50.0), deep)), gate=g)
    state, _ = CTL.step(state, hot, 0.3)
    assert state.duty == 0.0 and not state.gated_shallow
    shallow = replace(observation((online(p99_ms=20.0), replace(deep, shallow=True))), gate=g)
    state, actions = CTL.step(state, shallow, 0.4)
    assert state.duty == 1.0 and state.gated_shallow
    assert any("duty reset to 1" in getattr(a, "reason", "") for a in actions)


def test_gated_without_app_latency_the_probe_does_not_cut_the_duty() -> None:
    g = reading(signalled=1, enabled=True)
    job = replace(offline(), shallow=True)
    state = CTL.initial_state(GPU, 0.0)
    for i in range(3):
        obs = replace(observation((online(p99_ms=None), job), probe_ratio=5.0), gate=g)
        state, actions = CTL.step(state, obs, i * 0.1)
        assert not any(type(a).__name__ == "Alert" and "no latency" in a.reason for a in actions)
    assert state.duty == 1.0


# --------------------------------------------------------------------------- the gate's delay

DCFG = ControlConfig()  # gate_delay_min 2 ms, max 300 ms, raise after 5 ticks
# The room rule alone: a steady p99 at half its SLO is also a loose SLO, measured
# (test_controller_loose.py), which these tests of the room rule leave out.
ROOM = GpushareController(replace(DCFG, gate_delay_loose_below=0.0))


def _delay_run(
    p99s: list[float | None],
    *,
    slo_ms: float = 2000.0,
    shallow: bool = True,
    state: object = None,
    t0: float = 0.0,
    ctl: GpushareController = CTL,
) -> tuple[object, list[tuple[float, float]]]:
    """Step gated with the app p99 of each tick; the (time, delay) sent, in order."""
    job = replace(offline(), shallow=shallow)
    g = reading(signalled=1, enabled=True)
    st_ = ctl.initial_state(GPU, 0.0) if state is None else state
    sent: list[tuple[float, float]] = []
    for i, p99 in enumerate(p99s):
        now = round(t0 + i * 0.1, 6)
        obs = replace(observation((online(p99_ms=p99, slo_ms=slo_ms), job)), gate=g)
        st_, actions = ctl.step(st_, obs, now)  # type: ignore[arg-type]
        sent += [(now, a.delay_s) for a in gating_actions(actions) if a.on]
    return st_, sent


def _delays(sent: list[tuple[float, float]]) -> list[float]:
    return [d for _, d in sent]


def test_the_delay_rises_while_app_latency_has_room_doubling_to_the_max() -> None:
    # App p99 at a fifth of a 2 s SLO (a loose SLO: the room, 1.6 s, is past the max once the
    # tail has been known for the trust span).
    state, sent = _delay_run([400.0] * 700)
    assert sent[0] == (0.0, 0.0), "gating comes on closing at the first request"
    raises = sent[1:]
    # Not before 5 s of app latency: one window says little of the tail.
    assert raises[0] == (5.0, 0.002)
    assert _delays(raises)[:4] == [0.002, 0.004, 0.008, 0.016]
    assert _delays(raises)[-1] == DCFG.gate_delay_max_s == max(_delays(raises))
    assert state.gate_delay_s == DCFG.gate_delay_max_s  # type: ignore[attr-defined]


def test_the_delay_stays_within_the_room_the_slo_leaves_over_the_tail() -> None:
    # SLO 40 ms, p99 20 ms: the SLO leaves 20 ms over the tail, but until 30 s of app latency
    # the tail counts as at least the comfort band's edge (0.8), and the room grows with how long
    # the tail is known (times t / 60 s): at most 8 ms x 30/60 before 30 s, 20 ms after 60 s.
    state, sent = _delay_run([20.0] * 700, slo_ms=40.0, ctl=ROOM)
    assert all(d <= 0.008 * t / 60.0 + 1e-9 for t, d in sent if t < 30.0), sent
    assert all(d <= 0.020 * t / 60.0 + 1e-9 for t, d in sent), sent
    assert _delays(sent)[-1] == 0.02 and state.gate_delay_s == 0.02  # type: ignore[attr-defined]
    # The room caps raises, it does not cut: a window at 0.9 of the SLO (inside the comfort band)
    # holds the delay, and no raise follows while it is in memory.
    state, sent = _delay_run([36.0] + [20.0] * 250, slo_ms=40.0, state=state, t0=70.0, ctl=ROOM)
    assert sent == [] and state.gate_delay_s == 0.02  # type: ignore[attr-defined]


def test_gate_delay_trust_sets_how_soon_the_room_counts_in_full() -> None:
    # The same steady 45 s: trusted at once, the room is the full 20 ms from 30 s on; with the
    # default 60 s it is at most three quarters of that by 45 s; ten minutes hold it back longer.
    at_once = GpushareController(replace(ROOM.config, gate_delay_trust_s=0.0))
    slow = GpushareController(replace(ROOM.config, gate_delay_trust_s=600.0))
    _, now_sent = _delay_run([20.0] * 450, slo_ms=40.0, ctl=at_once)
    _, dflt_sent = _delay_run([20.0] * 450, slo_ms=40.0, ctl=ROOM)
    _, slow_sent = _delay_run([20.0] * 450, slo_ms=40.0, ctl=slow)
    assert now_sent[-1] == (30.5, 0.02), now_sent  # the whole room once 30 s of tail are seen
    assert max(_delays(dflt_sent)) <= 0.020 * 45.0 / 60.0 + 1e-9, dflt_sent
    assert max(_delays(slow_sent)) <= 0.020 * 45.0 / 600.0 + 1e-9, slow_sent


def test_a_window_seen_once_caps_the_delay_for_the_long_memory() -> None:
    # One window at 0.9 of the SLO early on leaves 4 ms (x the trust ramp) for ten minutes, long
    # after it has left the 30 s memory; then the room is the 20 ms the steady tail leaves.
    state, sent = _delay_run([20.0] * 5 + [36.0] + [20.0] * 5000, slo_ms=40.0, ctl=ROOM)
    assert max(_delays(sent)) <= 0.004 and state.gate_delay_s == 0.004  # type: ignore[attr-defined]
    state, sent = _delay_run([20.0] * 1500, slo_ms=40.0, state=state, t0=500.6, ctl=ROOM)
    assert [t for t, d in sent if d > 0.004] and min(t for t, d in sent if d > 0.004) > 600.0
    assert state.gate_delay_s == 0.02  # type: ignore[attr-defined]


def test_a_tail_seen_before_gating_went_off_still_caps_the_delay() -> None:
    # A burst at 0.9 of the SLO, then requests in flight 99 % of the time (gating off, the 30 s
    # memory restarts), then a calm 90 s: the burst still caps the room (4 ms, not 20 ms).
    ctl, slo_ms = ROOM, 40.0
    job = replace(offline(), shallow=True)
    st_ = ctl.initial_state(GPU, 0.0)
    sent: list[float] = []
    for i in range(1200):
        now = round(i * 0.1, 6)
        busy, p99 = (0.99, 36.0) if 30 <= i < 60 else (0.3, 36.0 if i < 30 else 20.0)
        g = reading(signalled=1, busy=busy, enabled=True)
        obs = replace(observation((online(p99_ms=p99, slo_ms=slo_ms), job)), gate=g)
        st_, actions = ctl.step(st_, obs, now)
        sent += [a.delay_s for a in gating_actions(actions) if a.on]
    assert st_.gating_emitted and max(sent) == 0.004 == st_.gate_delay_s


def test_no_delay_while_app_latency_is_inside_the_comfort_band() -> None:
    # A tight SLO (online alone at 0.9 of it, as at 1.1x): the gate keeps closing at once.
    state, sent = _delay_run([1800.0] * 100)
    assert _delays(sent) == [0.0] and state.gate_delay_s == 0.0  # type: ignore[attr-defined]


def test_a_breach_halves_the_delay_once_per_cooldown_and_the_cut_ratio_drops_it() -> None:
    state, _ = _delay_run([400.0] * 700, t0=-60.0)
    before = state.gate_delay_s  # type: ignore[attr-defined]
    assert before == DCFG.gate_delay_max_s
    # 1.03x the SLO for 3 s (under the cut ratio): halved at once, again only after the 2 s
    # cooldown (the window still holds the breach after a cut).
    state, sent = _delay_run([2060.0] * 30, state=state, t0=10.0)
    assert sent == [(10.0, before / 2), (12.0, before / 4)]
    # The delay the breach last persisted at (the second cut found it still breaching).
    assert state.gate_delay_breach_s == before / 2  # type: ignore[attr-defined]
    # The breach stays in the tail's long memory for 10 min: no raise until it has left it...
    state, sent = _delay_run([400.0] * 6500, state=state, t0=13.0)
    assert sent and sent[0][0] > 10.0 + 600.0, sent[:3]
    # ...and raises past half the breaching delay wait slow_increase_after_ticks, not 5.
    assert _delays(sent)[:2] == [before / 2, before]
    assert sent[1][0] - sent[0][0] >= DCFG.slow_increase_after_ticks * DCFG.period_s - 1e-6
    # A clear breach (cut_ratio, 1.05x): no delay at once, no halving.
    state, sent = _delay_run([2200.0], state=state, t0=700.0)
    assert _delays(sent) == [0.0] and state.gate_delay_s == 0.0  # type: ignore[attr-defined]
    assert state.gate_delay_breach_s == before  # type: ignore[attr-defined]


def test_no_delay_with_a_deep_queue_or_without_app_latency_for_long() -> None:
    # A deep queue runs past a freeze by an iteration: the gate closes at once.
    state, sent = _delay_run([400.0] * 100, shallow=False)
    assert state.gate_delay_s == 0.0 and set(_delays(sent)) <= {0.0}  # type: ignore[attr-defined]
    # Without app latency (a thin window) the delay is held for 10 s, then dropped.
    state, _ = _delay_run([400.0] * 100)
    held = state.gate_delay_s  # type: ignore[attr-defined]
    assert held > 0
    state, sent = _delay_run([None] * 100, state=state, t0=10.0)
    assert sent == [] and state.gate_delay_s == held  # type: ignore[attr-defined]
    state, sent = _delay_run([None] * 10, state=state, t0=20.0)
    assert _delays(sent) == [0.0]


def test_gate_delay_max_0_turns_the_delay_off() -> None:
    ctl = GpushareController(replace(DCFG, gate_delay_max_s=0.0))
    state, sent = _delay_run([200.0] * 100, ctl=ctl)
    assert _delays(sent) == [0.0] and state.gate_delay_s == 0.0  # type: ignore[attr-defined]
