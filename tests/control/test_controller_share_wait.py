"""A share cut while the duty holds offline work frozen waits for the evidence to settle.

``make demo``: request gating turned off at the busy threshold, the duty went to 0, and the share
fell 100 -> 25 % on the first quiet demand sample (39 %) and 25 -> 10 % on the next (69 %): two
cuts, each restarting every restartable offline job, within 100 ms. While offline work is frozen
a cut protects nothing yet, so it waits until this freeze's samples span ``quiet_settle`` and
lands once, on the settled target; it never waits past the tick the duty lets offline work run
(``gpushare.control.share.cut_waits``; docs/controller.md, "The offline share (slow lever)").
"""

from __future__ import annotations

from dataclasses import replace

from bench.support.observations import GPU, observation, offline, online, with_p99
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController, GpuState
from gpushare.model import (
    Action,
    ClientView,
    Observation,
    RestartClient,
    SetDuty,
    SetOfflineShare,
)

# quiet_settle 1 s, period 100 ms, hysteresis 10 points; a restart that costs nothing, so the
# restart goes out with the cut (issue 32's restart cost: tests/control/test_restart_cost.py).
CFG = ControlConfig(restart_cost_s=0.0)
SETTLE_TICKS = round(CFG.quiet_settle_s / CFG.period_s)


def jobs(restartable: bool = True) -> tuple[ClientView, ...]:
    """The demo's moment: two training jobs at the share gating gave them (100 %)."""
    return tuple(
        offline(name, sm_pct=100.0, restartable=restartable) for name in ("train-a", "train-b")
    )


def start() -> GpuState:
    """Offline running at a 100 % share (what request gating left), nothing sampled yet."""
    return GpuState(
        gpu_uuid=GPU, duty=1.0, duty_emitted=1.0, share_pct=100.0, share_emitted=True,
        share_changed_at_s=0.0,
    )  # fmt: skip


def tick_obs(p99_ms: float, sm_active: float, restartable: bool = True) -> Observation:
    base = observation((online(), *jobs(restartable=restartable)), sm_active=sm_active)
    return with_p99(base, p99_ms)


def run(
    ctl: GpushareController, seq: list[Observation], state: GpuState, t0: float = 0.0
) -> tuple[GpuState, list[list[Action]]]:
    out = []
    for i, obs in enumerate(seq):
        state, actions = ctl.step(state, obs, round(t0 + i * CFG.period_s, 6))
        out.append(list(actions))
    return state, out


def share_ticks(ticks: list[list[Action]]) -> list[tuple[int, float]]:
    return [(i, a.sm_pct) for i, t in enumerate(ticks) for a in t if isinstance(a, SetOfflineShare)]


# The demo's gating-off moment on one GPU: online work alone breaks its SLO (2.5x: duty 0) long
# enough for the quiet sampling to start, then sits in the comfort band (0.9x: duty held at 0,
# no violation, so a cut may go out). SM demand reads 39 % on the first sample, 69 % after.
BREACH = [tick_obs(100.0, 39.0)] * (SETTLE_TICKS + 1)
HELD = [tick_obs(36.0, 39.0)] + [tick_obs(36.0, 69.0)] * (2 * SETTLE_TICKS)


def test_a_cut_while_frozen_waits_for_the_settle_span_and_lands_once() -> None:
    ctl = GpushareController(CFG)
    state, ticks = run(ctl, BREACH + HELD, start())
    assert state.duty == 0.0 and not [a for t in ticks for a in t if isinstance(a, SetDuty)][1:]
    shares = share_ticks(ticks)
    # One cut, to the settled target: (100 - 69 demand - 10 headroom) / 2 jobs = 10 %.
    assert [s for _, s in shares] == [10.0], shares
    (at, _) = shares[0]
    first_sample = state.demand_samples[0][0]
    assert at * CFG.period_s >= first_sample + CFG.quiet_settle_s - 1e-9
    (cut,) = [a for a in ticks[at] if isinstance(a, SetOfflineShare)]
    assert "with offline frozen" in cut.reason
    # The first job's restart goes out with the cut (one at a time: the fake never relaunches
    # it, so the second waits), straight to the settled share.
    restarts = [(i, a.client_id, a.sm_pct) for i, t in enumerate(ticks) for a in t
                if isinstance(a, RestartClient)]  # fmt: skip
    assert restarts == [(at, "train-b", 10.0)]


def test_the_cut_is_immediate_while_offline_runs() -> None:
    # The same evidence (a quiet spell sampled 39 % then 69 %), but the duty lets offline work run
    # (0.5): the cut protects online work now, so it goes out on the first tick it is due.
    ctl = GpushareController(CFG)
    state = replace(
        start(), duty=0.5, duty_emitted=0.5, breach_duty=1.0,
        demand_samples=((0.0, 39.0), (0.1, 69.0)), quiet_signals=((0.0, 2.5), (0.1, 2.5)),
    )  # fmt: skip
    state, ticks = run(ctl, [tick_obs(36.0, 69.0)], state, t0=0.2)
    assert state.duty == 0.5
    assert share_ticks(ticks) == [(0, 10.0)]
    assert [a.client_id for a in ticks[0] if isinstance(a, RestartClient)] == ["train-b"]


def test_the_cut_lands_no_later_than_the_duty_lets_offline_run() -> None:
    # As above, but online latency drops under the comfort ratio right after the breach: the
    # duty climbs off 0 after increase_after_ticks comfortable ticks, well before the samples
    # span quiet_settle. The cut does not wait past that: it goes out in the step whose SetDuty
    # lets offline work run, and no earlier tick let it run under the higher share.
    ctl = GpushareController(CFG)
    calm = [tick_obs(20.0, 39.0)] + [tick_obs(20.0, 69.0)] * (SETTLE_TICKS - 1)
    state, ticks = run(ctl, BREACH + calm, start())
    shares = share_ticks(ticks)
    assert [s for _, s in shares] == [10.0], shares
    (at, _) = shares[0]
    rises = [i for i, t in enumerate(ticks) for a in t if isinstance(a, SetDuty) and a.duty > 0]
    assert rises and rises[0] == at, (rises, at)
    assert at - len(BREACH) == CFG.increase_after_ticks - 1  # the 3rd comfortable tick
    assert at * CFG.period_s < state.demand_samples[0][0] + CFG.quiet_settle_s


def test_a_cut_that_restarts_nobody_is_not_held_back() -> None:
    # Jobs that cannot be restarted keep their cap whatever the share: the cut costs nothing
    # and applies at once (a job launched meanwhile starts under it); it moves with the evidence.
    ctl = GpushareController(CFG)
    seq = [tick_obs(100.0, 39.0, False)] * (SETTLE_TICKS + 1) + [
        tick_obs(36.0, 39.0, False),
        tick_obs(36.0, 69.0, False),
    ]
    _, ticks = run(ctl, seq, start())
    assert share_ticks(ticks) == [(SETTLE_TICKS + 1, 25.0), (SETTLE_TICKS + 2, 10.0)]
