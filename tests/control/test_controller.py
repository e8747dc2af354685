"""gpushare's controller: properties over random observation sequences, and scenarios."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.support.observations import GIB, GPU, observation, offline, online, with_p99
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController, GpuState, failure_backoff_s
from gpushare.model import (
    Action,
    Admit,
    Alert,
    ClientClass,
    ClientState,
    ClientView,
    Evict,
    Freeze,
    GpuEvent,
    MpsState,
    Observation,
    RecoverMps,
    RestartClient,
    SetDuty,
    SetOfflineShare,
    Severity,
    Thaw,
)

CFG = ControlConfig()
# The share tests below are about what the share is computed from, not when a quiet period starts
# to count (test_quiet_samples_wait_for_the_latency_windows_to_settle): every quiet tick counts.
SHARE_CFG = ControlConfig(quiet_settle_s=0.0)


def run(
    ctl: GpushareController, obs_seq: list[Observation], state: GpuState | None = None
) -> tuple[GpuState, list[list[Action]]]:
    state = state if state is not None else ctl.initial_state(GPU, 0.0)
    out = []
    for i, obs in enumerate(obs_seq):
        state, actions = ctl.step(state, obs, float(i) * ctl.config.period_s)
        out.append(list(actions))
    return state, out


def duties(actions: list[list[Action]]) -> list[float]:
    return [a.duty for tick in actions for a in tick if isinstance(a, SetDuty)]


def client_targets(action: Action) -> str | None:
    if isinstance(action, Freeze | Thaw | Evict | RestartClient | Admit):
        return action.client_id
    return None


# Strategies ------------------------------------------------------------------------------------

configs = st.builds(
    ControlConfig,
    comfort_ratio=st.sampled_from([0.5, 0.8, 0.9]),
    violation_ratio=st.sampled_from([1.0, 1.1]),
    hard_ratio=st.sampled_from([1.5, 2.0, 3.0]),
    duty_increase_step=st.sampled_from([0.01, 0.05, 0.1, 0.25]),
    duty_decrease_factor=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    increase_after_ticks=st.integers(1, 4),
    freeze_after_ticks=st.integers(1, 8),
    slow_increase_after_ticks=st.integers(1, 8),
    share_min_interval_s=st.sampled_from([0.0, 1.0, 60.0]),
)


@st.composite
def client_sets(draw: st.DrawFn) -> tuple[ClientView, ...]:
    n_on = draw(st.integers(0, 3))
    n_off = draw(st.integers(0, 5))
    clients: list[ClientView] = [
        online(f"on{i}", slo_ms=draw(st.sampled_from([None, 10.0, 40.0])), mem=2 * GIB)
        for i in range(n_on)
    ]
    for i in range(n_off):
        clients.append(
            offline(
                f"off{i}",
                sm_pct=draw(st.sampled_from([20.0, 50.0, 100.0])),
                mem=draw(st.sampled_from([None, 1 * GIB, 6 * GIB, 20 * GIB])),
                restartable=draw(st.booleans()),
                failures=draw(st.sampled_from([0, 0, 0, 7])),
                ceiling=draw(st.sampled_from([None, None, 40.0])),
            )
        )
    return tuple(clients)


tick_strategy = st.fixed_dictionaries(
    {
        "p99": st.one_of(st.none(), st.floats(1.0, 200.0)),
        "probe": st.one_of(st.none(), st.floats(0.5, 6.0)),
        "free_gib": st.one_of(st.none(), st.integers(0, 80)),
        "sm": st.one_of(st.none(), st.floats(0.0, 100.0)),
        "mps": st.sampled_from([MpsState.UP] * 8 + [MpsState.FAULT, MpsState.STARTING]),
        "lost": st.sampled_from([False] * 15 + [True]),
    }
)


def build(clients: tuple[ClientView, ...], tick: dict[str, object]) -> Observation:
    p99 = tick["p99"]
    clients = tuple(
        replace(c, p99_ms=p99) if c.cls is ClientClass.ONLINE else c  # type: ignore[arg-type]
        for c in clients
    )
    free = tick["free_gib"]
    return observation(
        clients,
        probe_ratio=tick["probe"],  # type: ignore[arg-type]
        mem_free=None if free is None else int(free) * GIB,  # type: ignore[call-overload]
        mem_total=80 * GIB,
        sm_active=tick["sm"],  # type: ignore[arg-type]
        mps_state=tick["mps"],  # type: ignore[arg-type]
        lost=tick["lost"],  # type: ignore[arg-type]
    )


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Properties ------------------------------------------------------------------------------------


@SETTINGS
@given(configs, client_sets(), st.lists(tick_strategy, min_size=1, max_size=40))
def test_actions_are_safe_over_random_sequences(
    config: ControlConfig, clients: tuple[ClientView, ...], ticks: list[dict[str, object]]
) -> None:
    ctl = GpushareController(config)
    state = ctl.initial_state(GPU, 0.0)
    online_ids = {c.client_id for c in clients if c.cls is ClientClass.ONLINE}
    last_sent: float | None = None
    for i, tick in enumerate(ticks):
        obs = build(clients, tick)
        state, actions = ctl.step(state, obs, i * config.period_s)
        assert 0.0 <= state.duty <= 1.0
        present = {c.client_id for c in obs.clients}
        for a in actions:
            assert a.reason, a
            target = client_targets(a)
            if target is not None:
                assert target in present, f"{a} targets a client that does not exist"
                assert target not in online_ids, f"{a} targets an online client"
            if isinstance(a, SetDuty):
                assert 0.0 <= a.duty <= 1.0
                assert a.gpu_uuid == GPU
                assert a.duty != last_sent, "SetDuty repeated an unchanged duty"
                last_sent = a.duty
            if isinstance(a, SetOfflineShare):
                assert config.offline_sm_pct_min <= a.sm_pct <= config.offline_sm_pct_max
        # SetDuty only on change: at most one per tick, and never repeating the last one sent.
        assert sum(isinstance(a, SetDuty) for a in actions) <= 1


@SETTINGS
@given(configs, client_sets(), st.lists(tick_strategy, max_size=25), st.floats(1.01, 50.0))
def test_persistent_violation_freezes_offline_within_configured_ticks(
    config: ControlConfig,
    clients: tuple[ClientView, ...],
    warmup: list[dict[str, object]],
    over: float,
) -> None:
    ctl = GpushareController(config)
    state, _ = run(ctl, [build(clients, t) for t in warmup])
    extra = (online("victim", slo_ms=10.0),)
    violating = observation(
        (*clients, *extra),
        probe_ratio=None,
        mem_free=79 * GIB,
    )
    violating = replace(
        violating,
        clients=tuple(
            replace(c, p99_ms=10.0 * config.violation_ratio * over)
            if c.client_id == "victim"
            else c
            for c in violating.clients
        ),
    )
    for _ in range(config.freeze_after_ticks):
        state, _ = ctl.step(state, violating, 100.0)
    assert state.duty == 0.0
    assert state.duty_emitted == 0.0


@SETTINGS
@given(configs, client_sets(), st.lists(tick_strategy, max_size=25))
def test_comfortable_slo_climbs_back_to_full_duty(
    config: ControlConfig, clients: tuple[ClientView, ...], warmup: list[dict[str, object]]
) -> None:
    ctl = GpushareController(config)
    state, _ = run(ctl, [build(clients, t) for t in warmup])
    calm = observation(
        (*clients, online("calm", slo_ms=100.0, p99_ms=1.0)),
        probe_ratio=1.0 * config.probe_slo_ratio * config.comfort_ratio * 0.5,
        mem_free=79 * GIB,
    )
    calm = with_p99(calm, 1.0)
    # After a breach in the warm-up, steps above half the breaching duty wait the cautious count.
    slowest = max(config.increase_after_ticks, config.slow_increase_after_ticks)
    bound = math.ceil(1.0 / config.duty_increase_step + 1) * slowest
    for i in range(bound):
        state, _ = ctl.step(state, calm, 200.0 + i * config.period_s)
    assert state.duty == 1.0
    assert state.duty_emitted == 1.0


@st.composite
def memory_scenarios(draw: st.DrawFn) -> tuple[tuple[ClientView, ...], int]:
    n = draw(st.integers(1, 8))
    clients: list[ClientView] = [online("on", mem=draw(st.sampled_from([4, 30])) * GIB)]
    for i in range(n):
        clients.append(
            offline(
                f"off{i}",
                mem=draw(st.sampled_from([None, 1 * GIB, 3 * GIB, 9 * GIB])),
                restartable=draw(st.booleans()),
            )
        )
    reserve = draw(st.sampled_from([2, 8, 16, 40])) * GIB
    return tuple(clients), reserve


@SETTINGS
@given(memory_scenarios(), st.integers(0, 3))
def test_evictions_restore_the_memory_reserve(
    scenario: tuple[tuple[ClientView, ...], int], linger_ticks: int
) -> None:
    clients, reserve = scenario
    total = sum(c.mem_used_bytes or 0 for c in clients) + reserve // 2
    ctl = GpushareController(CFG)
    state = ctl.initial_state(GPU, 0.0)
    live = {c.client_id: c for c in clients}
    leaving: dict[str, int] = {}
    evicted: list[str] = []
    now = 0.0
    for _ in range(60):
        obs = observation(tuple(live.values()), mem_total=total, reserve=reserve)
        state, actions = ctl.step(state, obs, now)
        now += CFG.evict_grace_s  # each tick long enough for an unknown-size eviction to settle
        for a in actions:
            if isinstance(a, Evict):
                victim = live[a.client_id]
                assert victim.cls is ClientClass.OFFLINE
                assert a.client_id not in evicted, "evicted twice while going away"
                assert a.requeue == victim.restartable
                # Restartable offline clients go before any other.
                if not victim.restartable:
                    assert not any(
                        c.restartable
                        and c.cls is ClientClass.OFFLINE
                        and c.client_id not in evicted
                        for c in live.values()
                    )
                evicted.append(a.client_id)
                leaving[a.client_id] = linger_ticks
        for cid in list(leaving):
            if leaving[cid] == 0:
                del live[cid], leaving[cid]
            else:
                leaving[cid] -= 1
    free = total - sum(c.mem_used_bytes or 0 for c in live.values())
    offline_left = [c for c in live.values() if c.cls is ClientClass.OFFLINE]
    assert free >= reserve or not offline_left


# Scenarios: throttle ---------------------------------------------------------------------------


def test_no_online_client_runs_offline_free() -> None:
    ctl = GpushareController(CFG)
    state = replace(ctl.initial_state(GPU, 0.0), duty=0.0, duty_emitted=0.0)
    state, actions = ctl.step(state, observation((offline(),)), 0.0)
    assert [a.duty for a in actions if isinstance(a, SetDuty)] == [1.0]


def test_a_steady_tick_keeps_the_state_object() -> None:
    # The step runs every tick for every GPU: when nothing changed it hands back the state it got
    # (no copy of every field), and the first change after that is still recorded.
    ctl = GpushareController(CFG)
    obs = observation((offline("a"), offline("b")), probe_ratio=None)
    state, _ = ctl.step(ctl.initial_state(GPU, 0.0), obs, 0.0)  # initial duty and share
    state, _ = ctl.step(state, obs, 0.1)  # the counters of a GPU without online work settle
    steady, actions = ctl.step(state, obs, 0.2)
    assert actions == [] and steady is state
    evicting = replace(state, evicting=(("gone", 0.1),))
    after, _ = ctl.step(evicting, obs, 0.3)
    assert after.evicting == () and after == state


# Scenarios and properties: the probe yields to app latency while the app SLOs have room -------


def _after_quiet(app_quiet: float, duty: float = 1.0) -> GpuState:
    """A GPU whose online work was measured alone at ``app_quiet`` x its SLO, running at ``duty``."""
    state = GpushareController(CFG).initial_state(GPU, 0.0)
    return replace(state, duty=duty, duty_emitted=duty, app_quiet_signals=((0.0, app_quiet),))


def test_probe_yields_to_app_latency_when_the_app_slo_has_room() -> None:
    ctl = GpushareController(CFG)
    # The probe at 1.03x its SLO: a violation on its own, under cut_ratio (1.05), so the duty
    # halves (at 1.05x and over it would be cut to 0 at once, test_a_clear_breach_cuts_at_once).
    probe_over = CFG.probe_slo_ratio * 1.03
    calm = observation((online(p99_ms=20.0), offline()), probe_ratio=probe_over)  # app at 0.5x
    # Online alone at 0.5x its SLO and at 0.5x now: the probe yields, the duty holds at 1 (the
    # app signal is comfortable, so after the usual wait it would even grow).
    state, actions = ctl.step(_after_quiet(0.5), calm, 0.1)
    assert state.duty == 1.0 and not [a for a in actions if isinstance(a, SetDuty)]
    assert state.violation_ticks == 0
    # A tight SLO (online alone at 0.9x its SLO): the probe is in charge, the duty halves.
    state, actions = ctl.step(_after_quiet(0.9), calm, 0.1)
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == 0.5 and "probe ratio" in set_duty.reason
    # App latency near its SLO (0.85x): the probe is the early warning again.
    state, _ = ctl.step(_after_quiet(0.5), with_p99(calm, 34.0), 0.1)
    assert state.duty == 0.5
    # An online client that reports no latency: only the probe sees it, so it stays in charge.
    blind = observation(
        (online(p99_ms=20.0), online("on2", p99_ms=None), offline()), probe_ratio=probe_over
    )
    state, _ = ctl.step(_after_quiet(0.5), blind, 0.1)
    assert state.duty == 0.5
    # No quiet measurement of the app yet: the probe is in charge.
    state, _ = ctl.step(ctl.initial_state(GPU, 0.0), calm, 0.1)
    assert state.duty == 0.5
    # At the hard ratio the probe freezes offline work whatever the app says.
    severe = observation(
        (online(p99_ms=20.0), offline()), probe_ratio=CFG.probe_slo_ratio * CFG.hard_ratio
    )
    state, actions = ctl.step(_after_quiet(0.5), severe, 0.1)
    assert state.duty == 0.0
    assert "hard ratio" in next(a.reason for a in actions if isinstance(a, SetDuty))


def test_yielding_probe_is_named_in_the_duty_reason() -> None:
    ctl = GpushareController(CFG)
    calm = observation((online(p99_ms=20.0), offline()), probe_ratio=CFG.probe_slo_ratio * 1.2)
    state = _after_quiet(0.5, duty=0.0)
    for i in range(CFG.increase_after_ticks):
        state, actions = ctl.step(state, calm, 0.1 * (i + 1))
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == CFG.duty_increase_step
    assert "yields to app latency" in set_duty.reason and "0.50x" in set_duty.reason


@settings(max_examples=150, deadline=None)
@given(
    app_quiet=st.floats(0.01, 2.0),
    app_now=st.lists(st.floats(0.01, 3.0), min_size=1, max_size=3),
    probe_norm=st.floats(0.0, 5.0),
    duty=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    blind=st.booleans(),
)
def test_the_probe_keeps_its_say_when_it_must(
    app_quiet: float, app_now: list[float], probe_norm: float, duty: float, blind: bool
) -> None:
    # Whatever the app SLOs leave: a probe at or over the hard ratio freezes offline work; with
    # an online client that reports no latency, a probe over the violation ratio cuts the duty
    # (the probe is the only signal that covers that client); so does an app over its SLO.
    ctl = GpushareController(CFG)
    clients = [online(f"on{i}", p99_ms=v * 40.0) for i, v in enumerate(app_now)]
    if blind:
        clients.append(online("silent", p99_ms=None))
    obs = observation((*clients, offline()), probe_ratio=probe_norm * CFG.probe_slo_ratio)
    state, _ = ctl.step(_after_quiet(app_quiet, duty), obs, 0.1)
    if probe_norm >= CFG.hard_ratio:
        assert state.duty == 0.0
    if (blind and probe_norm > CFG.violation_ratio) or max(app_now) > CFG.violation_ratio:
        assert state.duty < duty or duty == 0.0


def test_hard_ratio_freezes_at_once_and_duty_is_sent_only_on_change() -> None:
    ctl = GpushareController(CFG)
    calm = observation((online(p99_ms=10.0), offline()))
    state, ticks = run(ctl, [calm, calm])
    assert duties(ticks) == [1.0]  # the first tick states the duty, the second repeats nothing
    state, actions = ctl.step(state, with_p99(calm, 40.0 * CFG.hard_ratio), 1.0)
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == 0.0
    assert "hard ratio" in set_duty.reason


def test_multiplicative_decrease_then_additive_increase_with_hysteresis() -> None:
    ctl = GpushareController(CFG)
    base = observation((online(), offline()))
    over = with_p99(base, 41.0)  # 1.025 x SLO: over violation, under cut_ratio (1.05)
    band = with_p99(base, 36.0)  # 0.9 x SLO: inside the comfort band
    calm = with_p99(base, 20.0)  # 0.5 x SLO
    state, ticks = run(ctl, [over, over, band, band, calm, calm, calm, calm, calm, calm])
    assert duties(ticks) == [0.5, 0.25, 0.3, 0.35]
    assert state.duty == 0.35


def test_a_clear_breach_cuts_the_duty_at_once() -> None:
    """At cut_ratio (1.05x) and over, the duty goes to 0 within the tick (issue 14: the freeze
    lags by the offline queue, so halving over five ticks came too late), and the duty that broke
    the SLO is remembered for slow probing, as after a halving."""
    ctl = GpushareController(CFG)
    base = observation((online(), offline()))
    state, ticks = run(ctl, [base] * 3)
    assert state.duty == 1.0
    state, ticks = run(ctl, [with_p99(base, 40.0 * CFG.cut_ratio)], state)
    (set_duty,) = [a for t in ticks for a in t if isinstance(a, SetDuty)]
    assert set_duty.duty == 0.0
    assert "cut ratio" in set_duty.reason
    assert state.breach_duty == 1.0
    # Just under it: the multiplicative decrease as before.
    state, ticks = run(ctl, [with_p99(base, 40.0 * 1.04)])
    assert duties(ticks)[-1] == 0.5


def test_probe_is_a_signal_beside_app_latency() -> None:
    ctl = GpushareController(CFG)
    # 1.53 / probe_slo_ratio 1.5 = 1.02x the probe's SLO: a violation under cut_ratio.
    obs = observation((online(slo_ms=None, p99_ms=None), offline()), probe_ratio=1.53)
    _, actions = ctl.step(ctl.initial_state(GPU, 0.0), obs, 0.0)
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == 0.5 and "probe" in set_duty.reason


def test_online_without_any_signal_holds_duty_and_alerts_once() -> None:
    ctl = GpushareController(CFG)
    obs = observation((online(slo_ms=None, p99_ms=None), offline()), probe_ratio=None)
    state = replace(ctl.initial_state(GPU, 0.0), duty=0.4, duty_emitted=0.4)
    state, first = ctl.step(state, obs, 0.0)
    state, second = ctl.step(state, obs, 0.1)
    assert state.duty == 0.4
    assert sum(isinstance(a, Alert) for a in first) == 1
    assert not any(isinstance(a, Alert) for a in second)


# Scenarios: offline share and restarts ---------------------------------------------------------


def test_share_follows_online_demand_measured_while_offline_is_frozen() -> None:
    # A restart that costs nothing (issue 32's restart cost is tests/control/test_restart_cost.py).
    cfg = ControlConfig(share_min_interval_s=10.0, quiet_settle_s=0.0, restart_cost_s=0.0)
    ctl = GpushareController(cfg)
    victim = offline("ckpt", sm_pct=50.0, restartable=True)
    base = observation((online(), victim), sm_active=60.0)
    state, ticks = run(ctl, [with_p99(base, 100.0)] * 8)  # hard violation: frozen, quiet
    assert state.duty == 0.0
    assert state.demand_samples, "demand is sampled once offline has been quiet"
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0]  # only the initial share: no change in violation
    assert not any(isinstance(a, RestartClient) for t in ticks for a in t)
    # The SLO holds again: 100 - 60 (demand) - 10 (headroom) = 30 %.
    state, actions = ctl.step(state, with_p99(base, 36.0), 2.0)
    (share,) = [a for a in actions if isinstance(a, SetOfflineShare)]
    assert share.sm_pct == 30.0 and "demand 60%" in share.reason
    (restart,) = [a for a in actions if isinstance(a, RestartClient)]
    assert restart.client_id == "ckpt" and restart.sm_pct == 30.0
    # A second offline client arrives while the first restarts: the share is split between them
    # at once (a decrease protects the SLO and does not wait for the interval), and no second
    # restart starts while the first is in flight.
    other = offline("ckpt2", sm_pct=50.0, restartable=True)
    busy = observation(
        (online(p99_ms=36.0), replace(victim, state=ClientState.RESTARTING), other), sm_active=60.0
    )
    state, actions = ctl.step(state, busy, 2.1)
    assert [a.sm_pct for a in actions if isinstance(a, SetOfflineShare)] == [15.0]
    assert not any(isinstance(a, RestartClient) for a in actions)
    # The first came back under 15 %: the next one is restarted.
    done = observation(
        (online(p99_ms=36.0), replace(victim, limits=replace(victim.limits, sm_pct=15.0)), other),
        sm_active=60.0,
    )
    state, actions = ctl.step(state, done, 2.2)
    assert [a.client_id for a in actions if isinstance(a, RestartClient)] == ["ckpt2"]
    # An increase waits for the minimum interval since the last change (at 2.1).
    state, actions = ctl.step(state, observation((offline(),)), 3.0)
    assert not any(isinstance(a, SetOfflineShare) for a in actions)
    state, actions = ctl.step(state, observation((offline(),)), 12.2)
    assert [a.sm_pct for a in actions if isinstance(a, SetOfflineShare)] == [100.0]


def test_share_decrease_does_not_wait_behind_a_recent_increase() -> None:
    # make demo's start: offline work alone raises the share to 100 %, then an online client
    # arrives a moment later. Protecting it must not wait out the interval of that increase.
    cfg = ControlConfig(share_min_interval_s=60.0, quiet_settle_s=0.0, restart_cost_s=0.0)
    ctl = GpushareController(cfg)
    job = offline("job", sm_pct=100.0, restartable=True)
    state, ticks = run(ctl, [observation((job,))] * 3)
    assert [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)][-1] == 100.0
    shared = observation((online(p99_ms=36.0), job), sm_active=60.0)
    state, ticks = run(ctl, [with_p99(shared, 100.0)] * 8, state)  # frozen: demand measured
    state, actions = ctl.step(state, shared, 2.0)  # SLO holds again, 1.7 s after the increase
    (share,) = [a for a in actions if isinstance(a, SetOfflineShare)]
    assert share.sm_pct == 30.0
    assert [a.client_id for a in actions if isinstance(a, RestartClient)] == ["job"]


def test_share_is_bounded_by_the_latency_online_work_has_alone() -> None:
    ctl = GpushareController(SHARE_CFG)
    # Online alone at 0.7x its SLO, 20 % SM activity: the SM demand alone would allow 70 %, but
    # online work held to 70 % of the SMs may run up to 1/0.7 slower: the SLO leaves 30 %.
    alone = observation((online(p99_ms=28.0),), sm_active=20.0, probe_ratio=1.0)
    state, ticks = run(ctl, [alone] * 4)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 30.0]
    assert "0.70x its SLO" in shares[1].reason
    # A looser SLO leaves more (the interval has passed): the latency bound sets the share, not
    # the SM demand (100 - 20 - 10 headroom = 70 would be lower).
    loose = observation((online(p99_ms=8.0),), sm_active=20.0, probe_ratio=0.3)
    later = [a for t in run(ctl, [loose] * 4, state)[1] for a in t]
    assert not [a for a in later if isinstance(a, SetOfflineShare)], "interval not yet passed"
    state, actions = ctl.step(state, loose, SHARE_CFG.share_min_interval_s + SHARE_CFG.period_s * 4)
    (share,) = [a for a in actions if isinstance(a, SetOfflineShare)]
    assert share.sm_pct == 80.0 and "0.20x its SLO" in share.reason


def test_share_follows_the_slo_not_a_busy_tick_of_sm_activity() -> None:
    ctl = GpushareController(SHARE_CFG)
    # A service at half load whose kernels fill the GPU: some ticks read ~100 % SM activity, yet
    # alone it runs at 0.5x its SLO. SM demand would leave nothing (the 10 % floor); the SLO
    # leaves half the SMs.
    busy = observation((online(p99_ms=20.0),), sm_active=97.0, probe_ratio=0.6)
    state, ticks = run(ctl, [busy] * 4)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0] and state.quiet_signals and state.demand_samples
    # A tighter SLO (alone at 0.9x): the SLO leaves 10 %.
    tight = observation((online(p99_ms=36.0),), sm_active=97.0, probe_ratio=0.6)
    _, ticks = run(ctl, [tight] * 4)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 10.0]
    assert "0.90x its SLO" in shares[1].reason


def test_share_follows_app_latency_where_the_probe_yields_to_it() -> None:
    ctl = GpushareController(SHARE_CFG)
    # An LLM server alone: a batch always in flight, so the SMs read busy and the probe, queued
    # behind the server's kernels, is over its SLO (1.8 / 1.5); its own TPOT is at 0.65x its SLO.
    # As in the duty cycle, the probe yields to app latency with room: the SLO leaves 35 %, not
    # the 10 % floor the SM demand (100 %) would give.
    server = observation((online(p99_ms=26.0),), sm_active=100.0, probe_ratio=1.8)
    _, ticks = run(ctl, [server] * 6)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 35.0], shares
    assert "0.65x its SLO" in shares[1].reason
    # Where the app SLO leaves little room alone (0.9x, over comfort_ratio) the probe keeps its
    # say, as in the duty cycle: a violation, during which the share does not move.
    tight = observation((online(p99_ms=36.0),), sm_active=100.0, probe_ratio=1.8)
    _, ticks = run(ctl, [tight] * 6)
    assert [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)] == [50.0]


def test_share_falls_back_on_sm_demand_when_online_alone_breaks_its_slo() -> None:
    ctl = GpushareController(SHARE_CFG)
    # Online over its SLO even with offline quiet (the quiet level stays in the window after the
    # violation ends): the SLO leaves nothing measurable, so the SMs online work leaves idle set
    # the share (100 - 75 - 10 headroom).
    over = observation((online(p99_ms=44.0),), sm_active=75.0, probe_ratio=1.0)
    state, ticks = run(ctl, [over] * 4)
    assert [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)] == [50.0]
    state, actions = ctl.step(state, with_p99(over, 36.0), 0.4)
    (share,) = [a for a in actions if isinstance(a, SetOfflineShare)]
    assert share.sm_pct == 15.0 and "demand 75%" in share.reason


@settings(max_examples=60, deadline=None)
@given(
    p99_ratio=st.floats(0.05, 0.99),
    probe_ratio=st.floats(0.5, 1.45),
    sm_active=st.floats(0.0, 100.0),
)
def test_share_with_a_quiet_latency_is_the_latency_bound(
    p99_ratio: float, probe_ratio: float, sm_active: float
) -> None:
    # With online work alone under its SLO, the share is what the SLO leaves (the worst signal
    # q, the app's where the probe yields to it: 100 x (1 - q), floored and clamped), whatever
    # SM activity reads; it changes from the initial share only beyond the hysteresis.
    ctl = GpushareController(SHARE_CFG)
    obs = observation(
        (online(p99_ms=p99_ratio * 40.0),), sm_active=sm_active, probe_ratio=probe_ratio
    )
    state, _ = run(ctl, [obs] * 4)
    q = max(p99_ratio, probe_ratio / SHARE_CFG.probe_slo_ratio)
    if p99_ratio < SHARE_CFG.comfort_ratio and p99_ratio < probe_ratio / SHARE_CFG.probe_slo_ratio:
        q = p99_ratio  # the probe yields to app latency with room (as in the duty cycle)
    target = float(math.floor(min(100.0, max(SHARE_CFG.offline_sm_pct_min, 100.0 * (1.0 - q)))))
    target = max(SHARE_CFG.offline_sm_pct_min, target)
    if abs(target - SHARE_CFG.offline_sm_pct_default) > SHARE_CFG.share_hysteresis_pct:
        assert state.share_pct == target
    else:
        assert state.share_pct == SHARE_CFG.offline_sm_pct_default


def test_share_waits_for_a_latency_measured_while_offline_is_quiet() -> None:
    ctl = GpushareController(CFG)
    blind = observation(
        (online(slo_ms=None, p99_ms=None),), sm_active=10.0, probe_ratio=None
    )  # SM demand known, latency not: the share stays where it is
    _, ticks = run(ctl, [blind] * 6)
    assert [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)] == [50.0]


def test_quiet_samples_wait_for_the_latency_windows_to_settle() -> None:
    # A breach freezes offline work; the latency window keeps reporting the pre-freeze tail
    # (2.5x the SLO) for 1 s, then reads what online work has alone (0.3x). Only the settled
    # reading is evidence of online work alone: the share follows the SLO (70 %), not the tail.
    job = offline("job", sm_pct=50.0)
    tail = observation((online(p99_ms=100.0), job), sm_active=25.0, probe_ratio=0.3)
    alone = with_p99(tail, 12.0)
    settle_ticks = round(CFG.quiet_settle_s / CFG.period_s)
    seq = [tail] * settle_ticks + [alone] * 2
    state, ticks = run(GpushareController(CFG), seq)
    assert state.quiet_signals and max(v for _, v in state.quiet_signals) < 1.0
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 70.0] and "0.30x its SLO" in shares[1].reason
    # Read at once, the tail says online work alone breaks its SLO: the share falls back on SM
    # demand (100 - 25 - 10 headroom) instead.
    _, ticks = run(GpushareController(SHARE_CFG), seq)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 65.0] and "demand 25%" in shares[1].reason


def test_share_is_split_over_the_offline_clients_of_the_gpu() -> None:
    ctl = GpushareController(SHARE_CFG)
    queued = (
        offline("a", state=ClientState.QUEUED),
        offline("b", state=ClientState.QUEUED),
        offline("gone", state=ClientState.EXITED),
    )
    # Online at 0.5x its SLO, demand 20 %: 50 % for offline work, 25 % for each of two jobs.
    obs = observation((online(p99_ms=20.0), *queued), sm_active=20.0, probe_ratio=0.3)
    _, ticks = run(ctl, [obs] * 4)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 25.0]
    assert "split over 2 offline clients" in shares[1].reason


def test_increases_are_cautious_above_half_the_duty_that_broke_the_slo() -> None:
    cfg = ControlConfig(slow_increase_after_ticks=30)
    ctl = GpushareController(cfg)
    base = observation((online(), offline()))
    over = with_p99(base, 41.0)  # 1.025 x SLO: halvings (under cut_ratio)
    calm = with_p99(base, 20.0)
    state, _ = run(ctl, [over] * cfg.freeze_after_ticks)  # broke at duty 1: frozen
    assert state.duty == 0.0 and state.breach_duty == 1.0
    # Up to 0.5 (half the breaching duty) at the usual pace: 10 steps, 3 ticks each.
    state, ticks = run(ctl, [calm] * 30, state)
    assert state.duty == 0.5
    state, ticks = run(ctl, [calm] * 29, state)
    assert state.duty == 0.5 and not duties(ticks)
    state, ticks = run(ctl, [calm], state)
    assert duties(ticks) == [0.55]
    # A breach at 0.6 sets the memory there; passing it unharmed forgets it.
    state = replace(state, duty=0.6, duty_emitted=0.6)
    state, _ = run(ctl, [over], state)
    assert state.breach_duty == 0.6 and state.duty == 0.3
    state, _ = run(ctl, [calm] * (30 * 7), state)  # 0.3 -> 0.65, every step above 0.3 cautious
    assert state.duty == 0.65 and state.breach_duty is None
    state, _ = run(ctl, [calm] * 3, state)  # the usual pace again
    assert state.duty == 0.7


def test_share_hysteresis_ignores_small_changes() -> None:
    ctl = GpushareController(ControlConfig(share_min_interval_s=0.0))
    state = replace(ctl.initial_state(GPU, 0.0), share_pct=35.0, share_emitted=True)
    state = replace(state, demand_samples=((0.0, 50.0),), quiet_ticks=5)
    obs = observation((online(), offline()), sm_active=50.0)
    state, actions = ctl.step(state, obs, 0.1)  # target 40: within 10 points of 35
    assert not any(isinstance(a, SetOfflineShare) for a in actions)


def test_ceilings_clamp_the_share_and_restarts() -> None:
    ctl = GpushareController(ControlConfig(share_min_interval_s=0.0))
    capped = offline("capped", sm_pct=50.0, restartable=True, ceiling=20.0)
    state, ticks = run(ctl, [observation((capped,), offline_max=40.0)] * 3)
    shares = [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert shares == [40.0]  # default 50 clamped to this GPU's offline ceiling
    restarts = [a for t in ticks for a in t if isinstance(a, RestartClient)]
    assert [(r.client_id, r.sm_pct) for r in restarts] == [("capped", 20.0)]
    # The GPU's ceiling comes down later: the share follows at once.
    state, actions = ctl.step(state, observation((), offline_max=25.0), 0.5)
    assert [a.sm_pct for a in actions if isinstance(a, SetOfflineShare)] == [25.0]


# Scenarios: memory, failures, faults -----------------------------------------------------------


def test_memory_evictions_order_and_requeue() -> None:
    ctl = GpushareController(CFG)
    clients = (
        online("on", mem=40 * GIB),
        offline("big", mem=20 * GIB),
        offline("small-ckpt", mem=2 * GIB, restartable=True),
        offline("mid-ckpt", mem=6 * GIB, restartable=True),
    )
    obs = observation(clients, mem_total=70 * GIB, reserve=10 * GIB)  # free 2 GiB, need 8 more
    state, actions = ctl.step(ctl.initial_state(GPU, 0.0), obs, 0.0)
    evicts = [a for a in actions if isinstance(a, Evict)]
    assert [(e.client_id, e.requeue) for e in evicts] == [("mid-ckpt", True), ("small-ckpt", True)]
    # Still going away next tick: not evicted again, and their memory counts as pending.
    state, actions = ctl.step(state, obs, 0.1)
    assert not any(isinstance(a, Evict) for a in actions)


def test_memory_reserve_held_by_online_alone_alerts_once() -> None:
    ctl = GpushareController(CFG)
    obs = observation((online(mem=79 * GIB),), mem_total=80 * GIB, reserve=2 * GIB)
    state, first = ctl.step(ctl.initial_state(GPU, 0.0), obs, 0.0)
    state, second = ctl.step(state, obs, 0.1)
    assert [a.severity for a in first if isinstance(a, Alert)] == [Severity.WARNING]
    assert not any(isinstance(a, Alert) for a in second)


def test_repeated_failures_stop_the_client_with_a_reason() -> None:
    ctl = GpushareController(CFG)
    flaky = offline("flaky", failures=CFG.max_client_failures, restartable=True)
    obs = observation((online(), flaky, offline("fine", failures=1)))
    state, actions = ctl.step(ctl.initial_state(GPU, 0.0), obs, 0.0)
    (evict,) = [a for a in actions if isinstance(a, Evict)]
    assert evict.client_id == "flaky" and evict.requeue is False
    assert "failed 5 times" in evict.reason
    assert any(isinstance(a, Alert) and "flaky" in a.reason for a in actions)
    state, actions = ctl.step(state, obs, 0.1)
    assert not any(isinstance(a, Evict) for a in actions)


def test_failure_backoff_doubles_to_its_maximum() -> None:
    assert [failure_backoff_s(n, CFG) for n in range(0, 4)] == [0.0, 5.0, 10.0, 20.0]
    assert failure_backoff_s(40, CFG) == CFG.failure_backoff_max_s


def test_fault_recovery_ordering() -> None:
    ctl = GpushareController(CFG)
    clients = (online(), offline("ckpt", restartable=True), offline("plain"))
    healthy = observation(clients)
    state, _ = run(ctl, [healthy] * 3)
    # FAULT: recover first, alert, and nothing else (no throttling, eviction or restart of the
    # poisoned clients by the controller: the recovery removes offline clients first).
    state, actions = ctl.step(state, observation(clients, mps_state=MpsState.FAULT), 1.0)
    assert [type(a) for a in actions] == [RecoverMps, Alert]
    assert actions[1].severity is Severity.CRITICAL  # type: ignore[union-attr]
    assert "offline clients removed first" in actions[0].reason
    # Still FAULT within the backoff: not repeated.
    state, actions = ctl.step(state, observation(clients, mps_state=MpsState.FAULT), 2.0)
    assert actions == []
    # Still FAULT after the backoff: tried again.
    later = 1.0 + CFG.failure_backoff_min_s
    state, actions = ctl.step(state, observation(clients, mps_state=MpsState.FAULT), later)
    assert [type(a) for a in actions] == [RecoverMps, Alert]
    # Recovery in progress (STARTING): nothing decided.
    starting = observation((online(),), mps_state=MpsState.STARTING, mem_free=1 * GIB)
    state, actions = ctl.step(state, starting, later + 1)
    assert actions == []
    # Back up: an info alert, and control resumes.
    state, actions = ctl.step(state, with_p99(observation((online(),)), 100.0), later + 2)
    assert isinstance(actions[0], Alert) and actions[0].severity is Severity.INFO
    assert any(isinstance(a, SetDuty) and a.duty == 0.0 for a in actions)


def test_fatal_xid_triggers_recovery_and_nonfatal_only_alerts() -> None:
    ctl = GpushareController(CFG)
    clients = (online(), offline())
    xid = GpuEvent(GPU, xid=79, at_s=5.0, fatal=True)
    state, actions = ctl.step(
        ctl.initial_state(GPU, 0.0), observation(clients, gpu_events=(xid,)), 5.0
    )
    assert isinstance(actions[0], RecoverMps) and "XID 79" in actions[0].reason
    warn = GpuEvent(GPU, xid=31, at_s=9.0, fatal=False)
    state = ctl.initial_state(GPU, 0.0)
    state, actions = ctl.step(state, observation(clients, gpu_events=(warn,)), 9.0)
    assert not any(isinstance(a, RecoverMps) for a in actions)
    assert any(isinstance(a, Alert) and a.severity is Severity.WARNING for a in actions)


def test_lost_gpu_alerts_once_and_decides_nothing() -> None:
    ctl = GpushareController(CFG)
    lost = observation((online(p99_ms=400.0), offline()), lost=True)
    state, first = ctl.step(ctl.initial_state(GPU, 0.0), lost, 0.0)
    state, second = ctl.step(state, lost, 0.1)
    assert [type(a) for a in first] == [Alert] and "admissions stopped" in first[0].reason
    assert second == []
    state, back = ctl.step(state, observation((offline(),)), 0.2)
    assert isinstance(back[0], Alert) and back[0].severity is Severity.INFO


@pytest.mark.parametrize("ticks", [1, 3, 8])
def test_freeze_after_ticks_bounds_a_slow_decrease(ticks: int) -> None:
    ctl = GpushareController(ControlConfig(duty_decrease_factor=1.0, freeze_after_ticks=ticks))
    over = observation((online(p99_ms=41.0), offline()))  # under cut_ratio: no cut at once
    state, out = run(ctl, [over] * ticks)
    assert state.duty == 0.0
    state, out = run(ctl, [over] * (ticks - 1))
    assert state.duty == 1.0


# Closed loop against a fake GPU whose latency follows the applied duty -------------------------


@pytest.mark.parametrize("lag_ticks", [0, 1, 3, 5])
def test_closed_loop_keeps_the_slo_and_gives_offline_the_rest(lag_ticks: int) -> None:
    """Online p99 = 20 ms x (1 + gain x duty applied lag_ticks ago); the SLO is 40 ms.

    The freezer's lag (queued kernels drain) is the delay. The load rises at tick 300 (gain 2 -> 4)
    and falls at tick 600 (gain 0.5): the controller must hold the SLO after each settling spell,
    give offline work what the SLO leaves, and give it everything when the SLO allows.
    """
    ctl = GpushareController(CFG)
    state = ctl.initial_state(GPU, 0.0)
    in_effect = [1.0] * (lag_ticks + 1)
    sent = 1.0
    p99s: list[float] = []
    sent_duties: list[float] = []
    for i in range(900):
        gain = 2.0 if i < 300 else 4.0 if i < 600 else 0.5
        p99 = 20.0 * (1.0 + gain * in_effect[0])
        obs = observation((online(p99_ms=p99), offline()), probe_ratio=1.0)
        state, actions = ctl.step(state, obs, i * CFG.period_s)
        for a in actions:
            if isinstance(a, SetDuty):
                sent = a.duty
        in_effect = [*in_effect[1:], sent]
        p99s.append(p99)
        sent_duties.append(sent)
    for start, stop, equilibrium in ((50, 300, 0.5), (350, 600, 0.25)):
        assert max(p99s[start:stop]) <= 40.0, "SLO broken after settling"
        mean = sum(sent_duties[start:stop]) / (stop - start)
        # Offline gets a useful part of what the SLO leaves (the comfort band costs some).
        assert 0.5 * equilibrium <= mean <= equilibrium
    assert sent_duties[-1] == 1.0  # gain 0.5: 30 ms at full duty, comfortable: offline runs free
