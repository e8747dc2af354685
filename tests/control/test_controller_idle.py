"""The controller's idle fast path: a GPU with no client and nothing to settle gets, without the
sections running, exactly what the full step gives (``GpushareController._idle``)."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.support.observations import GIB, GPU, observation, offline, online
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController, GpuState
from gpushare.control.restart_cost import DutyTally
from gpushare.model import GateReading, GpuEvent, MpsState, Observation


class FullStep(GpushareController):
    """The controller with the fast path off: every section runs."""

    def _idle(self, state: GpuState, obs: Observation) -> GpuState | None:
        return None


def idle_state(**kw: object) -> GpuState:
    """What an empty GPU's state settles to after a few ticks (share at the ceiling)."""
    base = GpuState(
        gpu_uuid=GPU, duty=1.0, duty_emitted=1.0, share_pct=100.0, share_emitted=True,
        share_changed_at_s=0.5, gating_emitted=False, gating_changed_at_s=0.2, quiet_ticks=7,
        duty_tally=DutyTally(0.5, 0.5, 1.0, 0.0),  # the duty counted since the share was set
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


GATE = GateReading(enabled=False, closed=False, inflight=0, signalled_clients=0, busy_fraction=0.0)

configs = st.builds(
    ControlConfig,
    offline_sm_pct_min=st.sampled_from([1.0, 10.0, 40.0]),
    offline_sm_pct_max=st.sampled_from([40.0, 80.5, 100.0]),
    offline_sm_pct_default=st.just(40.0),
    share_hysteresis_pct=st.sampled_from([0.0, 10.0, 30.0]),
    share_min_interval_s=st.sampled_from([0.0, 1.0, 60.0]),
)

# Each field of the state at its settled value, but for none, one or two fields at a value that
# some section of the step acts on (or that the fast path must not pass over).
PERTURBED: dict[str, list[object]] = {
    "duty": [0.0, 0.5],
    "duty_tally": [None, DutyTally(0.2, 0.2, 1.0, 0.0), DutyTally(0.5, 3.0, 0.5, 2.5)],
    "duty_emitted": [None, 0.0, 0.5],
    "comfortable_ticks": [2],
    "violation_ticks": [1],
    "quiet_ticks": [0, 10**6],
    "quiet_sampled_since_s": [9.0],
    "share_pct": [10.0, 40.0, 50.0, 80.0, 95.0, 100.0],
    "share_emitted": [False],
    "share_changed_at_s": [None, 9.9],
    "demand_samples": [((9.5, 40.0),)],
    "quiet_signals": [((0.1, 0.5),)],
    "app_quiet_signals": [((9.5, 0.5),)],
    "breach_duty": [0.5],
    "evicting": [(("gone", 1.0),)],
    "stopped": [frozenset({"gone"})],
    "restart_pending": [("gone", 1.0)],
    "recovering_since_s": [1.0],
    "last_recover_s": [1.0, 9.9],
    "recover_attempts": [2],
    "lost": [True],
    "unsignalled_alerted": [True],
    "memory_alerted": [True],
    "gating_emitted": [None, True],
    "gating_changed_at_s": [None, 9.99],
    "gated_shallow": [True],
}


@st.composite
def perturbations(draw: st.DrawFn) -> dict[str, object]:
    keys = draw(st.lists(st.sampled_from(sorted(PERTURBED)), max_size=2, unique=True))
    return {k: draw(st.sampled_from(PERTURBED[k])) for k in keys}


def some(draw: st.DrawFn, usual: object, *others: object) -> object:
    """``usual`` about five times in six, else one of ``others``."""
    return draw(st.sampled_from([usual] * 5 * max(1, len(others)) + list(others)))


@st.composite
def observations(draw: st.DrawFn) -> Observation:
    clients = some(draw, (), (offline("train", mem=GIB),), (online("web", mem=GIB),))
    obs = observation(
        clients,  # type: ignore[arg-type]
        probe_ratio=draw(st.sampled_from([None, 1.0, 5.0])),
        mem_free=some(draw, None, 0, GIB, 80 * GIB),  # type: ignore[arg-type]
        mem_total=some(draw, 80 * GIB, None),  # type: ignore[arg-type]
        reserve=some(draw, 2 * GIB, 0, 100 * GIB),  # type: ignore[arg-type]
        mps_state=some(draw, MpsState.UP, MpsState.FAULT, MpsState.DOWN),  # type: ignore[arg-type]
        gpu_events=some(
            draw, (), (GpuEvent(GPU, 13, 5.0, False),), (GpuEvent(GPU, 79, 5.0, True),)
        ),  # type: ignore[arg-type]
        lost=some(draw, False, True),  # type: ignore[arg-type]
        offline_max=some(draw, 100.0, 30.0, 80.5),  # type: ignore[arg-type]
    )
    return replace(obs, gate=some(draw, GATE, None))  # type: ignore[arg-type]


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, perturbations(), observations(), st.sampled_from([10.0, 100.0, 1e5]))
def test_the_fast_path_gives_what_the_full_step_gives(
    cfg: ControlConfig, changes: dict[str, object], obs: Observation, now: float
) -> None:
    # Settled, the share sits where _share puts it with no online client: the GPU's ceiling.
    top = min(cfg.offline_sm_pct_max, obs.offline_sm_pct_max)
    settled = max(min(cfg.offline_sm_pct_min, top), float(math.floor(top)))
    state = idle_state(**{"share_pct": settled, **changes})
    fast = GpushareController(cfg).step(state, obs, now)
    full = FullStep(cfg).step(state, obs, now)
    assert (fast[0], list(fast[1])) == (full[0], list(full[1]))


def test_an_empty_settled_gpu_takes_the_fast_path_and_one_with_work_does_not() -> None:
    ctl = GpushareController(ControlConfig())
    empty = replace(observation(), gate=GATE)
    assert ctl._idle(idle_state(), empty) == idle_state(quiet_ticks=8)
    # Ten ticks on: the same answer as the full step, one quiet tick more each.
    state = idle_state()
    for i in range(10):
        state, actions = ctl.step(state, empty, 10.0 + i)
        assert actions == []
    assert state == idle_state(quiet_ticks=17)
    assert ctl._idle(idle_state(), observation((offline("train"),))) is None
    assert ctl._idle(idle_state(gating_emitted=None), empty) is None  # gating off not yet sent
    assert ctl._idle(idle_state(), replace(empty, mps_state=MpsState.FAULT)) is None


def test_every_single_departure_from_settled_gives_what_the_full_step_gives() -> None:
    # Each field off its settled value alone, on GPUs with and without a gate, under configs
    # whose share ceiling, floor and hysteresis differ: the cases a random draw meets rarely.
    cfgs = [
        ControlConfig(),
        ControlConfig(
            offline_sm_pct_min=40.0, offline_sm_pct_default=40.0, offline_sm_pct_max=80.5,
            share_hysteresis_pct=0.0, share_min_interval_s=0.0,
        ),
        ControlConfig(share_hysteresis_pct=30.0, share_min_interval_s=60.0),
        ControlConfig(offline_sm_pct_max=80.5, share_hysteresis_pct=30.0),
    ]  # fmt: skip
    taken = 0
    for cfg in cfgs:
        for gate in (GATE, None):
            obs = replace(observation(), gate=gate)
            top = min(cfg.offline_sm_pct_max, obs.offline_sm_pct_max)
            settled = max(min(cfg.offline_sm_pct_min, top), float(math.floor(top)))
            for key, values in [("", [None]), *PERTURBED.items()]:
                for value in values:
                    changes = {key: value} if key else {}
                    state = idle_state(**{"share_pct": settled, **changes})
                    for now in (10.0, 1e5):
                        fast = GpushareController(cfg).step(state, obs, now)
                        full = FullStep(cfg).step(state, obs, now)
                        assert (fast[0], list(fast[1])) == (full[0], list(full[1])), (key, value)
                        taken += GpushareController(cfg)._idle(state, obs) is not None
    assert taken >= 100  # the fast path was taken, not only declined
