"""Kernel-granularity preemption in the simulated node: the ``tally-like`` reference.

Tally (docs/sources.md) intercepts kernel launches and runs a best-effort kernel only while the
high-priority client has nothing to run, so a high-priority kernel waits at most for the
best-effort kernel already on the GPU. :class:`TallyTrainer` and :class:`TallyServer` model that on
top of the GPU model: a trainer presents one kernel (a profile chunk) at a time, and only while no
online server of its GPU has a request in progress or queued; a request that arrives withdraws the
trainer's kernel not yet started, and the kernel already running finishes. No launch gap is
charged (Tally's own scheduling cost is left out: this is the upper reference request gating
approaches). The runner builds these classes for a policy with ``preemption = "kernel"``.
"""

from __future__ import annotations

from gpushare.sim.workloads import OfflineTrainer, OnlineServer


class TallyScheduler:
    """One GPU's online servers and trainers, and whether offline work may issue now."""

    def __init__(self) -> None:
        self.servers: list[TallyServer] = []
        self.trainers: list[TallyTrainer] = []

    def online_busy(self) -> bool:
        """A request of an online server of this GPU is in progress or queued."""
        return any(s.pos < s._n or s.queue for s in self.servers)

    def changed(self, now: float) -> None:
        """An online server started or finished a request: withdraw or release offline kernels."""
        busy = self.online_busy()
        for t in self.trainers:
            if busy:
                t.withdraw()
            else:
                t.release(now)


class TallyServer(OnlineServer):
    """An online server that tells its GPU's :class:`TallyScheduler` when requests begin and end."""

    tally: TallyScheduler

    def _begin_next(self, now: float) -> None:
        super()._begin_next(now)
        self.tally.changed(now)


class TallyTrainer(OfflineTrainer):
    """A trainer that issues one kernel at a time, only while online work is idle."""

    tally: TallyScheduler
    _parked: int | None = None

    def _present(self, p: int, now: float) -> None:
        if self.tally.online_busy():
            self.nxt = None
            self._parked = p
            return
        self._parked = None
        self.nxt = self._kernels[p]
        self.eligible_since = now

    def withdraw(self) -> None:
        """Take back the issued kernel that has not started (a request arrived)."""
        if self.nxt is not None and self.run is None and self.pos < self._n:
            self.nxt = None
            self._parked = self.pos

    def release(self, now: float) -> None:
        """Issue the kernel held back while online work ran."""
        p = self._parked
        if p is None or not self.active or p != self.pos or self.pos >= self._n:
            return
        running = not self.frozen or now < self._stops_at
        if not running:
            return
        self._present(p, now)
        self.gpu.wake()
