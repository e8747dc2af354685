"""gpushare's controller: the offline share (slow lever) and the restarts that carry it out, computed
from what online work measured alone leaves (its latency against its SLO, else its SM demand).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.support.observations import GPU, observation, offline, online, with_p99
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController
from gpushare.model import ClientState, ClientView, RestartClient, SetOfflineShare
from tests.support.controller_steps import CFG, run

# The share tests below are about what the share is computed from, not when a quiet period starts
# to count (test_quiet_samples_wait_for_the_latency_windows_to_settle): every quiet tick counts.
SHARE_CFG = ControlConfig(quiet_settle_s=0.0)


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


def _llm_server(client_id: str = "llm") -> ClientView:
    """An LLM server with TTFT and TPOT SLOs only, alone at 0.65x them (the worst of the two)."""
    return replace(
        online(client_id, slo_ms=None, p99_ms=None),
        slo_ttft_p99_ms=1000.0, ttft_p99_ms=600.0, slo_tpot_p99_ms=40.0, tpot_p99_ms=26.0,
    )  # fmt: skip


def test_share_beside_token_slos_only_assumes_llm_steps_slow_less_than_their_sms() -> None:
    # The law leaves online work (1 - (1 - q) / s) of the SMs, s = token_sm_sensitivity (0.91):
    # an LLM server's steps lose at most 0.91 of the proportional slowdown on fewer SMs.
    server = observation((_llm_server(),), sm_active=100.0, probe_ratio=1.8)
    _, ticks = run(GpushareController(SHARE_CFG), [server] * 6)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 38.0], shares  # floor(35 / 0.91)
    assert "token_sm_sensitivity" in shares[1].reason and "0.65x its token SLOs" in shares[1].reason
    # 1: the proportional law, as for a request p99.
    proportional = GpushareController(replace(SHARE_CFG, token_sm_sensitivity=1.0))
    _, ticks = run(proportional, [server] * 6)
    assert [a.sm_pct for t in ticks for a in t if isinstance(a, SetOfflineShare)] == [50.0, 35.0]


def test_a_request_p99_service_beside_an_llm_server_keeps_the_proportional_law() -> None:
    # The GPU's worst signal is still the LLM server's 0.65x, but a service on a request p99
    # (a CNN or BERT: iGniter's lose up to all of the proportional slowdown) shares the GPU: the
    # share cannot assume less for it.
    cnn = online("cnn", slo_ms=40.0, p99_ms=10.0)
    both = observation((_llm_server(), cnn), sm_active=100.0, probe_ratio=1.8)
    _, ticks = run(GpushareController(SHARE_CFG), [both] * 6)
    shares = [a for t in ticks for a in t if isinstance(a, SetOfflineShare)]
    assert [s.sm_pct for s in shares] == [50.0, 35.0], shares
    assert "token_sm_sensitivity" not in shares[1].reason


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
