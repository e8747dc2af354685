"""gpushare's controller and GPU memory: evictions restore the reserve, in order, requeueing what
may restart; a reserve held by online work alone alerts once.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bench.support.observations import GIB, GPU, observation, offline, online
from gpushare.control.controller import GpushareController
from gpushare.model import Alert, ClientClass, ClientView, Evict, Severity
from tests.support.controller_steps import CFG, SETTINGS


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


# Scenarios ---------------------------------------------------------------------------------------


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
