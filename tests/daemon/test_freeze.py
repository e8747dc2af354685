"""The freeze arbiter (gpushare.daemon.freeze): the one owner of why each client is frozen.

The duty cycle, holds (user pause, controller Freeze), the request gates and the stop all set
reasons at one arbiter; the lifecycle asks it instead of keeping a set of its own, so the daemon
never believes a client thawed that the arbiter holds frozen (or the other way round).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare import config
from gpushare.daemon.freeze import DUTY, GATE, HOLD, FreezeArbiter
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import Registry
from gpushare.daemon.state import NodeState
from gpushare.model import ClientClass, ClientState
from gpushare.node.clock import SystemClock
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.host import HostProcesses
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_pauser import FakePauser

GPU = fake_uuid(0)


def test_a_reason_replaced_in_one_step_never_thaws_the_client() -> None:
    pauser = FakePauser()
    arb = FreezeArbiter(pauser)
    arb.set(["job"], HOLD, True)
    # A hold released at duty 0: the duty cycle's reason takes the hold's place.
    arb.change(["job"], add=(DUTY,), drop=(HOLD,))
    assert pauser.calls == [(("job",), True)]
    assert arb.reasons("job") == {DUTY}
    arb.change(["job"], drop=(DUTY, HOLD))
    assert pauser.calls[-1] == (("job",), False)
    assert not arb.frozen("job")


def test_the_gate_and_the_daemon_never_undo_each_others_freeze() -> None:
    pauser = FakePauser()
    edges: list[tuple[tuple[str, ...], bool]] = []
    arb = FreezeArbiter(
        pauser, on_edge=lambda ids, frozen, _now: edges.append((tuple(ids), frozen))
    )
    arb.set_quietly(["a", "b"], GATE, True)
    arb.set(["a"], DUTY, True)  # already frozen by the gate: no request, no edge
    arb.set_quietly(["a", "b"], GATE, False)  # b thaws; a stays for its duty
    assert pauser.calls == [(("a", "b"), True), (("b",), False)]
    assert edges == pauser.calls
    assert arb.holding({DUTY}) == {"a"} and arb.holding({GATE}) == frozenset()


def test_a_failed_request_takes_the_reason_back_and_forget_requests_nothing() -> None:
    pauser = FakePauser()
    pauser.fail = {"gone"}
    arb = FreezeArbiter(pauser)
    with pytest.raises(PauserError, match="cannot freeze"):
        arb.set(["ok", "gone"], DUTY, True)
    assert arb.reasons("gone") == frozenset() and arb.reasons("ok") == {DUTY}
    calls = len(pauser.calls)
    arb.forget("ok")
    assert not arb.frozen("ok") and len(pauser.calls) == calls


@pytest.fixture
def life(tmp_path: Path) -> Iterator[tuple[Lifecycle, FakePauser]]:
    base = tmp_path  # nothing is loaded from it: no daemon starts
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
""")
    pauser = FakePauser()
    state = NodeState(
        cfg, registry=Registry.in_memory(), gpu=FakeGpuBackend(), mps=FakeMpsNode([GPU]),
        pauser=pauser, probe=None, policy=None, clock=SystemClock(), procs=HostProcesses(),
        shallow_library=None,
    )  # fmt: skip
    yield Lifecycle(state), pauser
    state.registry.close()


def test_a_freeze_the_kernel_did_not_confirm_is_still_the_daemons_freeze(
    life: tuple[Lifecycle, FakePauser],
) -> None:
    # Before the arbiter, the lifecycle kept its own set and left a client out of it when the
    # kernel's confirmation timed out, while the gates' arbiter kept it frozen: two answers.
    lifecycle, pauser = life
    pauser.timeout = True
    lifecycle.freeze_for("job", DUTY)
    assert lifecycle.is_paused("job")
    assert lifecycle.paused == {"job"} == lifecycle.s.freeze.holding({DUTY})


def test_a_hold_released_at_duty_zero_keeps_the_client_frozen_for_the_duty(
    life: tuple[Lifecycle, FakePauser],
) -> None:
    lifecycle, pauser = life
    s = lifecycle.s
    rec = s.registry.add_client(
        cls=ClientClass.OFFLINE, argv=["train"], uid=1000, gid=1000, user="u",
        state=ClientState.STARTING, priority=1, gpu_uuid=GPU, gpu_index=0, now=0.0,
    )  # fmt: skip
    s.registry.transition(rec.id, ClientState.RUNNING, pid=123456)
    s.duty[GPU] = 0.0
    lifecycle.hold(rec.id, True, "paused by u")
    assert s.freeze.reasons(rec.id) == {HOLD} and s.registry.get(rec.id).held
    lifecycle.hold(rec.id, False, "resumed by u")
    # Never thawed in between: one freeze request, and the duty's reason in the hold's place.
    assert pauser.calls == [((rec.id,), True)]
    assert s.freeze.reasons(rec.id) == {DUTY} and not s.registry.get(rec.id).held
