"""``[control] offline_mps_priority``: the MPS priority gpushare launches offline clients with.

Every path that launches or describes an offline client reads it from the policy: the daemon
(tests/daemon/test_daemon_submit.py), the Slurm and Kubernetes environments (``envresolve``), the
simulator's node (``PolicyTraits``), and a gang-duty wrapper of the controller. Below, the
priority chosen per GPU from the online clients' room (``gpushare.control.priority``,
``[control] equal_priority_below``); the daemon's side in
tests/daemon/test_offline_priority_launch.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.support.observations import observation, online
from gpushare import config
from gpushare.control.controller import GpushareController
from gpushare.control.gang import GangDuty
from gpushare.control.gpu_state import GpuState
from gpushare.control.priority import offline_priority
from gpushare.control.registry import make_policy
from gpushare.control.signals import Signals
from gpushare.model import Action, ClientView, SetOfflinePriority
from gpushare.roots import envresolve
from gpushare.sim.node import PolicyTraits


@pytest.mark.parametrize("prio", [0, 1])
def test_every_reader_of_the_policy_gets_the_configured_priority(prio: int) -> None:
    cfg = config.loads(f"[control]\noffline_mps_priority = {prio}\n")
    policy = make_policy("gpushare", cfg.control)
    assert isinstance(policy, GpushareController)
    assert policy.offline_mps_priority == prio
    assert GangDuty(policy, [["GPU-a", "GPU-b"]]).offline_mps_priority == prio
    assert envresolve.offline_priority(cfg) == prio
    assert PolicyTraits.of(policy).offline_priority == prio


def test_the_default_stays_below_normal() -> None:
    assert make_policy("gpushare", config.loads("").control).offline_mps_priority == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [("2", "out of range: 2"), ("0.5", "expected an integer"), ('"low"', "expected an integer")],
)
def test_a_bad_priority_is_one_line_naming_the_key(value: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=f"control.offline_mps_priority: {message}"):
        config.loads(f"[control]\noffline_mps_priority = {value}\n")


# --- The offline priority chosen per GPU (gpushare.control.priority) ---------------------------

CFG = config.ControlConfig()
GPU = "GPU-p"


def _signals(app: float | None, *, probe: float | None = None, online: int = 1) -> Signals:
    """One online client reporting ``app`` x its SLO (``None``: no report), and the probe."""
    worst = max((v for v in (app, probe) if v is not None), default=None)
    return Signals(
        worst=worst, worst_source="client llm TPOT p99" if app is not None else "probe",
        count=sum(v is not None for v in (app, probe)), online=online, app_worst=app,
        app_source="client llm TPOT p99 28.0ms" if app is not None else "",
        app_complete=app is not None and online > 0, probe=probe,
    )  # fmt: skip


def _run(
    readings: list[Signals], cfg: config.ControlConfig = CFG, state: GpuState | None = None
) -> tuple[GpuState, list[tuple[float, SetOfflinePriority]]]:
    """Step the rule once a tick (``period``) over ``readings``; the state and what it sent."""
    st = state or GpuState(gpu_uuid=GPU)
    sent: list[tuple[float, SetOfflinePriority]] = []
    for k, sig in enumerate(readings):
        now = k * cfg.period_s
        actions: list[Action] = []
        st = offline_priority(cfg, st, sig, now, actions)
        assert all(isinstance(a, SetOfflinePriority) for a in actions), actions
        sent += [(now, a) for a in actions if isinstance(a, SetOfflinePriority)]
    return st, sent


def _ticks(seconds: float) -> int:
    return round(seconds / CFG.period_s)


def test_priority_0_once_online_latency_has_stayed_well_under_its_slos_for_the_interval() -> None:
    interval = _ticks(CFG.share_min_interval_s)
    state, sent = _run([_signals(0.67)] * (interval + 50))
    assert len(sent) == 1, sent
    at, action = sent[0]
    assert at == pytest.approx(CFG.share_min_interval_s)
    assert (action.gpu_uuid, action.priority) == (GPU, 0)
    assert "0.75x" in action.reason and "client llm TPOT p99" in action.reason
    assert state.offline_priority == 0
    # A tick short of the interval: nothing yet.
    _, early = _run([_signals(0.67)] * interval)
    assert early == []


@pytest.mark.parametrize(
    ("readings", "why"),
    [
        ([_signals(0.76)], "over equal_priority_below (a 1.1x SLO alone reads 0.91)"),
        ([_signals(None, probe=0.5)], "no app latency: the probe alone is no SLO's evidence"),
        ([_signals(None, online=0)], "no online client: no evidence"),
    ],
)
def test_no_priority_0_without_room_measured(readings: list[Signals], why: str) -> None:
    _, sent = _run(readings * _ticks(2 * CFG.share_min_interval_s))
    assert sent == [], why


def test_one_reading_over_the_bound_starts_the_interval_again() -> None:
    half = _ticks(CFG.share_min_interval_s / 2)
    readings = [_signals(0.6)] * (half + 10) + [_signals(0.8)] + [_signals(0.6)] * (half + 10)
    _, sent = _run(readings)
    assert sent == []
    _, later = _run(readings + [_signals(0.6)] * half)
    assert [a.priority for _, a in later] == [0]


def test_the_probe_over_its_slo_yields_to_app_latency_with_room() -> None:
    # An LLM server alone keeps the probe over its SLO (it waits behind the server's kernels).
    _, sent = _run([_signals(0.67, probe=1.2)] * (_ticks(CFG.share_min_interval_s) + 1))
    assert [a.priority for _, a in sent] == [0]


def test_back_to_the_configured_priority_at_the_first_violation_or_with_no_online_client() -> None:
    zero, _ = _run([_signals(0.6)] * (_ticks(CFG.share_min_interval_s) + 1))
    assert zero.offline_priority == 0
    # Between the bound and the SLO it stays: the duty cycle polices that band.
    held, none = _run([_signals(0.95)] * 50, state=zero)
    assert none == [] and held.offline_priority == 0
    back, sent = _run([_signals(1.02)], state=zero)
    assert [(a.priority, a.reason) for _, a in sent] == [
        (1, "online at 1.02x its SLO: offline launches below online clients again (1)")
    ]
    assert (back.offline_priority, back.priority_room_since_s) == (None, None)
    gone, sent = _run([_signals(None, online=0)], state=zero)
    assert [a.priority for _, a in sent] == [1] and gone.offline_priority is None
    assert "no online client left" in sent[0][1].reason


@pytest.mark.parametrize(
    "cfg",
    [replace(CFG, offline_mps_priority=0), replace(CFG, equal_priority_below=0.0)],
    ids=["configured-0", "rule-off"],
)
def test_nothing_to_choose_when_configured_0_or_turned_off(cfg: config.ControlConfig) -> None:
    _, sent = _run([_signals(0.3)] * _ticks(2 * CFG.share_min_interval_s), cfg=cfg)
    assert sent == []


def test_the_controller_chooses_it_in_its_step() -> None:
    # The full step: an online client alone at 0.6x its request SLO, no offline client yet.
    assert _chosen((online(slo_ms=100.0, p99_ms=60.0),), CFG.share_min_interval_s) == [0]


def _chosen(obs_clients: tuple[ClientView, ...], seconds: float) -> list[int]:
    """The priorities the full step sends over ``seconds`` of one unchanging observation."""
    ctl = GpushareController(CFG)
    obs = observation(obs_clients, probe_ratio=1.0)
    state = ctl.initial_state(obs.gpu_uuid, 0.0)
    chosen = []
    for k in range(_ticks(seconds) + 2):
        state, actions = ctl.step(state, obs, k * CFG.period_s)
        chosen += [a.priority for a in actions if isinstance(a, SetOfflinePriority)]
    return chosen


def test_one_users_low_reports_do_not_give_offline_work_priority_0_beside_another_service() -> None:
    # docs/security.md 3.1: any user's online client may report whatever latency it likes for
    # itself. Beside another user's service with less room, or one without a report of its own,
    # it cannot have offline work launched at the online clients' priority.
    liar = online("liar", slo_ms=100.0, p99_ms=1.0, uid=1001)
    tight = online("web", slo_ms=100.0, p99_ms=90.0, uid=1002)
    silent = online("grpc", slo_ms=100.0, p99_ms=None, uid=1003)
    two_minutes = 2 * CFG.share_min_interval_s
    assert _chosen((liar, tight), two_minutes) == []
    assert _chosen((liar, silent), two_minutes) == []
    # Alone, it gets it for offline work beside its own service only.
    assert _chosen((liar,), two_minutes) == [0]
