"""gpushare's controller: properties over random observation sequences (safe actions, freezing
under a persistent violation, climbing back to full duty).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from bench.support.observations import GIB, GPU, observation, offline, online, with_p99
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController
from gpushare.model import (
    Action,
    Admit,
    ClientClass,
    ClientView,
    Evict,
    Freeze,
    MpsState,
    Observation,
    RestartClient,
    SetDuty,
    SetOfflineShare,
    Thaw,
)
from tests.support.controller_steps import SETTINGS, run


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
