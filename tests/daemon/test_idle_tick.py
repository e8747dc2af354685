"""An idle node's tick does no per-client work that changes nothing (issue 29 item 6).

At 8 GPUs x 200 idle clients the duty cycle called ``Lifecycle.freeze_for`` for every client at
every tick, each call taking the freeze arbiter's lock to change nothing, and the request gates
asked the arbiter once per gated client whether its gate held it: a quarter of the daemon's CPU.
Each now takes the arbiter's lock once per tick and asks for a change only where one is due. The
arbiter's lock is counted here (a counting lock in its place), not timed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

from gpushare import config
from gpushare.config import GateConfig
from gpushare.daemon.dutycycle import DutyCycle
from gpushare.daemon.freeze import DUTY, HOLD, FreezeArbiter
from gpushare.daemon.gating import Gatekeeper
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import Registry
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import ClientClass, ClientState
from gpushare.node.clock import SystemClock
from gpushare.node.procs.host import HostProcesses
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_pauser import FakePauser

GPU = fake_uuid(0)
CLIENTS = 20


class CountingLock:
    """A lock that counts how often it is taken (the arbiter's lock, swapped in by a test)."""

    def __init__(self) -> None:
        self._inner = threading.Lock()
        self.taken = 0

    def __enter__(self) -> bool:
        self.taken += 1
        return self._inner.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._inner.__exit__(kind, exc, tb)


def count_arbiter(arbiter: FreezeArbiter) -> CountingLock:
    lock = CountingLock()
    arbiter._lock = lock  # type: ignore[assignment]  # the test's counting stand-in
    return lock


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[NodeState, Lifecycle, FakePauser, list[str]]]:
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{tmp_path}/run"
state_dir = "{tmp_path}/state"
""")
    pauser = FakePauser()
    state = NodeState(
        cfg, registry=Registry.in_memory(), gpu=FakeGpuBackend(), mps=FakeMpsNode([GPU]),
        pauser=pauser, probe=None, policy=None, clock=SystemClock(), procs=HostProcesses(),
        shallow_library=None,
    )  # fmt: skip
    ids = []
    for i in range(CLIENTS):
        rec = state.registry.add_client(
            cls=ClientClass.OFFLINE, argv=["sleep", "600"], uid=1000, gid=1000, user="u",
            state=ClientState.STARTING, priority=1, gpu_uuid=GPU, gpu_index=0, now=0.0,
        )  # fmt: skip
        state.registry.transition(rec.id, ClientState.RUNNING, pid=100000 + i)
        ids.append(rec.id)
    yield state, Lifecycle(state), pauser, ids
    state.registry.close()


def test_the_duty_cycle_takes_the_arbiter_once_a_tick_for_unchanged_clients(
    node: tuple[NodeState, Lifecycle, FakePauser, list[str]],
) -> None:
    state, life, pauser, ids = node
    duty = DutyCycle(state, life)
    lock = count_arbiter(state.freeze)
    state.duty[GPU] = 0.0
    duty.phase(Tick(1.0, 1.0))
    # Every client frozen for its duty, one request each (as before), then states follow.
    assert pauser.calls == [((c,), True) for c in ids]
    assert all(state.registry.get(c).state is ClientState.THROTTLED for c in ids)
    for t in (1.1, 1.2, 1.3):
        lock.taken = 0
        duty.phase(Tick(t, t))
        # Before: one freeze_for, so one take of the lock, for each of the clients each tick.
        assert lock.taken == 1
    assert len(pauser.calls) == CLIENTS
    state.duty[GPU] = 1.0
    lock.taken = 0
    duty.phase(Tick(1.4, 1.4))
    # The duty changed: every client thawed, in the same order and one request each.
    assert pauser.calls[CLIENTS:] == [((c,), False) for c in ids]
    assert lock.taken == 1 + CLIENTS
    assert all(state.registry.get(c).state is ClientState.RUNNING for c in ids)


def test_a_request_that_failed_is_asked_again_at_the_next_tick_and_only_it(
    node: tuple[NodeState, Lifecycle, FakePauser, list[str]],
) -> None:
    state, life, pauser, ids = node
    duty = DutyCycle(state, life)
    pauser.fail = {ids[3]}
    state.duty[GPU] = 0.0
    duty.phase(Tick(1.0, 1.0))
    assert state.freeze.reasons(ids[3]) == frozenset()  # the failure took the reason back
    pauser.calls.clear()
    duty.phase(Tick(1.1, 1.1))
    assert pauser.calls == [((ids[3],), True)]
    pauser.fail = set()
    duty.phase(Tick(1.2, 1.2))
    assert pauser.calls[-1] == ((ids[3],), True) and state.freeze.reasons(ids[3]) == {DUTY}
    pauser.calls.clear()
    duty.phase(Tick(1.3, 1.3))
    assert pauser.calls == []


def test_a_held_client_keeps_its_reason_without_a_request_each_tick(
    node: tuple[NodeState, Lifecycle, FakePauser, list[str]],
) -> None:
    state, life, pauser, ids = node
    duty = DutyCycle(state, life)
    state.duty[GPU] = 0.5
    life.hold(ids[0], True, "paused by u")
    duty.phase(Tick(1.0, 1.0))
    assert state.freeze.reasons(ids[0]) == {HOLD}
    assert state.registry.get(ids[0]).state is ClientState.FROZEN
    assert state.registry.get(ids[1]).state is ClientState.THROTTLED
    assert duty.next_edge(9.0) == pytest.approx(1.0 + 0.5 * state.config.control.period_s)
    calls = len(pauser.calls)
    lock = count_arbiter(state.freeze)
    duty.phase(Tick(1.1, 1.1))
    assert len(pauser.calls) == calls and lock.taken == 1
    # The duty edges are set again each period, whether or not any freeze changed.
    assert duty.next_edge(9.0) == pytest.approx(1.1 + 0.5 * state.config.control.period_s)


def test_a_settled_gate_asks_the_arbiter_once_for_all_its_gated_clients() -> None:
    keeper = Gatekeeper(GateConfig(), FakePauser())
    gated = {GPU: [f"c{i}" for i in range(CLIENTS)], fake_uuid(1): ["d0", "d1"]}
    keeper.update_clients({}, gated, 0.0)
    lock = count_arbiter(keeper.arbiter)
    keeper.update_clients({}, gated, 0.1)
    # Before: one has_any, so one take of the lock, per gated client at every tick.
    assert lock.taken == 1
    keeper.arbiter.set_quietly(["c7"], f"gate:{GPU}", True)
    lock.taken = 0
    keeper.update_clients({}, gated, 0.2)
    # Not settled (a gated client frozen by its gate): the gate is evaluated, which thaws it.
    assert lock.taken > 1 and not keeper.arbiter.frozen("c7")


def test_clients_frozen_at_the_duty_edge_are_thawed_at_the_next_period(
    node: tuple[NodeState, Lifecycle, FakePauser, list[str]],
) -> None:
    # A period that changed nothing is not repeated blindly: the edge's freezes between two
    # periods change the arbiter's reasons, and the next period thaws every client again.
    state, life, pauser, ids = node
    duty = DutyCycle(state, life)
    state.duty[GPU] = 0.5
    period = state.config.control.period_s
    for n in range(3):
        start = 1.0 + n * period
        duty.phase(Tick(start, start))
        assert duty.next_edge(9.0) == pytest.approx(start + 0.5 * period)
        assert not any(state.freeze.frozen(c) for c in ids)
        pauser.calls.clear()
        edge = start + 0.5 * period
        duty.edges_due(Tick(edge, edge))
        assert pauser.calls == [(tuple(ids), True)] and not duty.pending()
        assert all(state.freeze.reasons(c) == {DUTY} for c in ids)
        pauser.calls.clear()
    duty.phase(Tick(9.0, 9.0))
    assert pauser.calls == [((c,), False) for c in ids]
    # A client held between two quiet periods: the next one moves it to FROZEN.
    pauser.calls.clear()
    duty.phase(Tick(9.1, 9.1))
    assert pauser.calls == []
    state.registry.update(ids[5], held=True)
    duty.phase(Tick(9.2, 9.2))
    assert state.registry.get(ids[5]).state is ClientState.FROZEN
    assert state.freeze.reasons(ids[5]) == {HOLD} and pauser.calls == [((ids[5],), True)]
