"""The baseline policies: each does what the system it stands for does, and only that."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.support.observations import GPU, observation, offline, online
from gpushare.config import ControlConfig
from gpushare.control.baselines import (
    TGS_DUTY_MIN,
    ExclusivePolicy,
    StaticSharePolicy,
    TgsPolicy,
    TimeSlicingPolicy,
)
from gpushare.control.registry import make_policy
from gpushare.model import Action, Observation, SetDuty, SetOfflineShare

WITH_ONLINE = observation((online(), offline()))
OFFLINE_ONLY = observation((offline(),))


def duty_trace(policy: object, seq: list[Observation], dt: float = 0.1) -> list[float]:
    state = policy.initial_state(GPU, 0.0)  # type: ignore[attr-defined]
    current = None
    trace = []
    for i, obs in enumerate(seq):
        state, actions = policy.step(state, obs, i * dt)  # type: ignore[attr-defined]
        for a in actions:
            if isinstance(a, SetDuty):
                current = a.duty
        trace.append(current)
    return trace


def shares(policy: object, obs: Observation) -> list[float]:
    state = policy.initial_state(GPU, 0.0)  # type: ignore[attr-defined]
    out: list[Action] = []
    for i in range(3):
        state, actions = policy.step(state, obs, float(i))  # type: ignore[attr-defined]
        out += actions
    return [a.sm_pct for a in out if isinstance(a, SetOfflineShare)]


def test_exclusive_stops_offline_while_online_is_present() -> None:
    seq = [OFFLINE_ONLY, WITH_ONLINE, WITH_ONLINE, OFFLINE_ONLY]
    assert duty_trace(ExclusivePolicy(), seq) == [1.0, 0.0, 0.0, 1.0]


def test_time_slicing_alternates_per_slice() -> None:
    seq = [WITH_ONLINE] * 6 + [OFFLINE_ONLY]
    assert duty_trace(TimeSlicingPolicy(), seq) == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert duty_trace(TimeSlicingPolicy(slice_ticks=2), seq[:6]) == [0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="slice_ticks"):
        TimeSlicingPolicy(slice_ticks=0)


def test_time_slicing_on_a_time_sliced_gpu_leaves_the_slicing_to_the_driver() -> None:
    sliced = replace(WITH_ONLINE, time_sliced=True)
    policy = TimeSlicingPolicy()
    state = policy.initial_state(GPU, 0.0)
    sent: list[Action] = []
    for i in range(6):
        state, actions = policy.step(state, sliced, i * 0.1)
        sent += actions
    # The offline share once, and never a duty: the hardware alternates the contexts.
    assert [type(a) for a in sent] == [SetOfflineShare]
    assert sent[0].sm_pct == 100.0  # type: ignore[attr-defined]
    assert "driver time-slices" in sent[0].reason


def test_time_slicing_releases_its_duty_when_the_gpu_becomes_time_sliced() -> None:
    policy = TimeSlicingPolicy()
    state = policy.initial_state(GPU, 0.0)
    state, first = policy.step(state, WITH_ONLINE, 0.0)  # MPS: the online slice, duty 0
    assert [a.duty for a in first if isinstance(a, SetDuty)] == [0.0]
    sliced = replace(WITH_ONLINE, time_sliced=True)
    state, actions = policy.step(state, sliced, 0.1)
    assert [(type(a), getattr(a, "duty", None)) for a in actions] == [(SetDuty, 1.0)]
    state, actions = policy.step(state, sliced, 0.2)
    assert actions == []
    # Back on MPS: its own slices again, from the online one.
    assert duty_trace(policy, [WITH_ONLINE, WITH_ONLINE]) == [0.0, 1.0]


def test_mps_variants_never_throttle_and_differ_in_share_and_priority() -> None:
    cfg = ControlConfig(offline_sm_pct_default=30.0)
    plain, prio, split = (make_policy(n, cfg) for n in ("mps", "mps-priority", "static-split"))
    for policy in (plain, prio, split):
        bad = observation((online(p99_ms=400.0), offline()), probe_ratio=9.0)
        assert set(duty_trace(policy, [bad] * 5)) == {1.0}
    assert shares(plain, WITH_ONLINE) == [100.0]
    assert shares(split, WITH_ONLINE) == [30.0]
    assert (plain.offline_mps_priority, prio.offline_mps_priority) == (0, 1)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="share_pct"):
        StaticSharePolicy("x", 0.0)


def probe_obs(ratio: float) -> Observation:
    return observation((online(slo_ms=None, p99_ms=None), offline()), probe_ratio=ratio)


def test_tgs_law_and_cadence() -> None:
    tgs = TgsPolicy()
    state = tgs.initial_state(GPU, 0.0)
    # Within tolerance in slow start: limit x 1.5 + 1, capped at full duty.
    state, _ = tgs.step(state, probe_obs(1.0), 0.0)
    assert state.duty == 1.0 and state.slow_start
    # Error 1 - 1/1.2 = 16.7 % >= 3 theta: limit / 10, slow start. Only after the 5 s cadence.
    state, actions = tgs.step(state, probe_obs(1.2), 1.0)
    assert state.duty == 1.0 and actions == []
    state, actions = tgs.step(state, probe_obs(1.2), 5.0)
    assert state.duty == pytest.approx(0.1)
    assert "limit / 10" in actions[-1].reason  # type: ignore[union-attr]
    # Slow start: x 1.5 (+ 1 block normalised).
    state, _ = tgs.step(state, probe_obs(1.0), 10.0)
    assert state.duty == pytest.approx(0.15 + 1 / 20000)
    # Error 1 - 1/1.05 = 4.8 %: over theta in slow start: / 1.5, congestion avoidance.
    state, _ = tgs.step(state, probe_obs(1.05), 15.0)
    assert not state.slow_start
    assert state.duty == pytest.approx((0.15 + 1 / 20000) / 1.5)
    # Congestion avoidance over theta: limit - max(8 %, RATE_MIN), floored at RATE_MIN.
    before = state.duty
    state, _ = tgs.step(state, probe_obs(1.05), 20.0)
    assert state.duty == pytest.approx(max(TGS_DUTY_MIN, before - max(0.08 * before, 0.05)))
    # Congestion avoidance within theta: additive RATE_MIN step.
    before = state.duty
    state, _ = tgs.step(state, probe_obs(1.01), 25.0)
    assert state.duty == pytest.approx(before + 0.05)


def test_tgs_never_stops_offline_and_decays_rmax_after_20_bad_samples() -> None:
    tgs = TgsPolicy()
    state = tgs.initial_state(GPU, 0.0)
    for i in range(19):
        state, _ = tgs.step(state, probe_obs(1.5), i * 5.0)
        assert state.duty >= TGS_DUTY_MIN
    assert state.rmax_scale == 1.0 and state.bad_samples == 19
    state, _ = tgs.step(state, probe_obs(1.5), 19 * 5.0)
    assert state.rmax_scale == pytest.approx(0.8) and state.bad_samples == 0
    # No online client: the limit is lifted to its cap at once.
    assert duty_trace(tgs, [probe_obs(3.0)] * 2 + [OFFLINE_ONLY])[-1] == 1.0
