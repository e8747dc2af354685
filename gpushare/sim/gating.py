"""Request gating in the simulated node, through the daemon's own :class:`Gatekeeper`.

An online service that uses ``gpushare.client`` says when each request starts and ends; the
daemon's :class:`~gpushare.daemon.gating.Gatekeeper` freezes the GPU's gated offline clients
while any request is in flight and thaws them ``[gate] hold`` after the last one ends
(docs/controller.md, "Request gating"). Here the simulated :class:`OnlineServer` reports its
boundaries in virtual time (:class:`BoundarySender`, the client's sending rule), each reaches
the same Gatekeeper the real daemon runs :data:`DELIVERY_S` later (the datagram's path to the
freeze request), and the gate's timer is driven by the simulation's events through
:meth:`Gatekeeper.poll` instead of a thread (:class:`GateDriver`). The Gatekeeper's pauser is
the simulated node's (:class:`gpushare.sim.adapters.SimPauser`), which models the freeze and
thaw latencies (:data:`gpushare.sim.workloads.FREEZE_S`, ``THAW_S``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from gpushare.client import FLUSH_INTERVAL_S, INFLIGHT_REFRESH_S
from gpushare.sim.gpu import EventLoop

if TYPE_CHECKING:
    from gpushare.daemon.gating import Gatekeeper
    from gpushare.sim.workloads import OnlineServer

#: From a request's start in the service to the gate's freeze request written: the median
#: "written" time of ``bench/gating_latency.py`` with one busy offline process and the gate's
#: threads at SCHED_FIFO in the run this was set from (0.20 ms; the medians of one offline
#: process in later runs, bench/results/gating_latency.json, lie between 0.14 and 0.35 ms).
#: The process then stops :data:`~gpushare.sim.workloads.FREEZE_S` later (the simulated
#: pauser's part).
DELIVERY_S = 0.20e-3
#: The gate's timer wakes this long after a hold or timeout runs out, as the daemon's timer
#: thread does (``Gatekeeper._run`` waits ``due - now + 1e-4``): evaluated exactly at the end of
#: the hold, float rounding can leave the gate a hair short of it.
TIMER_SLACK_S = 1e-4


class GateDriver:
    """Feeds one node's request boundaries to a Gatekeeper and runs its timer in virtual time."""

    def __init__(self, gate: Gatekeeper, loop: EventLoop) -> None:
        self.gate = gate
        self.loop = loop
        self._due: float | None = None
        #: Boundaries delivered to the gate and the ones it refused (with why), for tests.
        self.delivered = 0
        self.refused: list[str] = []
        # The controller's SetGating can change a gate's delay between datagrams: poll then too.
        gate.on_rearm = self._arm

    def send(self, client_id: str, pid: int, count: int) -> None:
        """A datagram leaves the service now: it reaches the gate :data:`DELIVERY_S` later."""
        self.loop.at(self.loop.now + DELIVERY_S, self._deliver, (client_id, pid, count))

    def _deliver(self, arg: object) -> None:
        client_id, pid, count = cast(tuple[str, int, int], arg)
        now = self.loop.now
        why = self.gate.on_inflight(client_id, pid, count, now)
        self.delivered += 1
        if why is not None:
            self.refused.append(why)
        self._arm(self.gate.next_due(now))

    def _arm(self, due: float | None) -> None:
        """Poll the gate just after ``due`` unless a poll at or before then is scheduled already."""
        if due is None:
            return
        at = due + TIMER_SLACK_S
        if self._due is not None and self.loop.now <= self._due <= at:
            return
        self._due = at
        self.loop.at(at, self._poll, at)

    def _poll(self, arg: object) -> None:
        if arg != self._due:
            return  # superseded by an earlier poll
        self._due = None
        self._arm(self.gate.poll(self.loop.now))


class BoundarySender:
    """``gpushare.client.request_started``/``request_ended``'s sending rule, in virtual time.

    A datagram with the process's count goes out at once when the count leaves or reaches 0,
    else at most every ``FLUSH_INTERVAL_S`` when it changed and every ``INFLIGHT_REFRESH_S``
    while requests stay in flight (on the next boundary, as in the client). ``send(client_id,
    pid, count)`` carries the datagram (:meth:`GateDriver.send` in virtual time).
    """

    def __init__(self, send: Callable[[str, int, int], None], server: OnlineServer) -> None:
        self.send = send
        self.server = server
        self.count = 0
        self._sent_n = 0
        self._sent_s = -1e18

    def boundary(self, delta: int, now: float) -> None:
        """A request started (+1) or ended (-1) in the service at ``now``."""
        if delta < 0 and self.count == 0:
            return
        self.count += delta
        edge = (self.count == 0) != (self._sent_n == 0)
        wait = FLUSH_INTERVAL_S if self.count != self._sent_n else INFLIGHT_REFRESH_S
        if not (edge or now - self._sent_s >= wait):
            return
        self.send(self.server.cid, self.server.pid, self.count)
        self._sent_s, self._sent_n = now, self.count
