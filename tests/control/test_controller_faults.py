"""gpushare's controller and faults: clients that keep failing, MPS faults and their recovery,
XID errors and a lost GPU.
"""

from __future__ import annotations

from bench.support.observations import GIB, GPU, observation, offline, online, with_p99
from gpushare.control.controller import GpushareController, failure_backoff_s
from gpushare.model import Alert, Evict, GpuEvent, MpsState, RecoverMps, SetDuty, Severity
from tests.support.controller_steps import CFG, run


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
