"""The control loop's tick reads the clock once and hands that time to every part it runs.

Before the loop was split into parts (gpushare.daemon.tick), the tick's callees read the clock
again (the client views, the ops sync, the drain's pause notes, the actuator's records), so one
tick's decisions were made at several instants. The simulator's virtual clock runs the loop.
"""

from __future__ import annotations

import threading

from gpushare.node.base import Clock
from gpushare.sim import runner
from gpushare.sim.node import PolicyTraits, SimNode
from tests.fakes.fake_policy import FixedPolicy
from tests.sim.test_sim_model import pair


class CountingClock:
    """A clock that counts the reads made through it."""

    def __init__(self, inner: Clock) -> None:
        self.inner = inner
        self.reads: list[str] = []

    def monotonic(self) -> float:
        self.reads.append("monotonic")
        return self.inner.monotonic()

    def time(self) -> float:
        self.reads.append("time")
        return self.inner.time()

    def sleep_until(self, deadline: float, stop: threading.Event) -> bool:
        return self.inner.sleep_until(deadline, stop)


def test_a_tick_reads_the_clock_once_whatever_its_parts_do() -> None:
    node = SimNode(pair(duration="3s"), traits=PolicyTraits())
    node.start()
    sim = runner.SimDaemon(node, FixedPolicy(duty=0.5, share_pct=60.0))
    sim.run(1.5)  # the offline job admitted, running on a duty cycle, frozen at its edges
    rec = sim.state.registry.get("train")
    assert rec.state.is_live
    counting = CountingClock(sim.state.clock)
    sim.state.clock = counting
    sim.loop.tick()
    assert sim.loop.ticks > 0
    assert counting.reads == ["monotonic", "time"]
