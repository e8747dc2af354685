"""The simulator's control file: live ``--queue auto`` clients switched in virtual time (issue 32).

On a host the daemon rewrites a per-GPU file that the in-flight library maps and reads at every
launch (``gpushare.daemon.inflight_control.ControlFiles``). Here the same daemon code writes
through :class:`SimBoundWriter`, which sets the bound of every simulated trainer launched with
that GPU's control path (``GPUSHARE_INFLIGHT_CONTROL`` in its launch environment, the library
preloaded), at once. A trainer switched mid-iteration keeps running the kernels of that iteration
that were queued before: the bounded model (:meth:`gpushare.sim.workloads.OfflineTrainer.set_inflight`)
forgets the completion times of the chunks before the switch, so those launch without waiting,
as kernels already in a deep queue do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpushare import native
from gpushare.sim.workloads import OfflineTrainer

if TYPE_CHECKING:
    from gpushare.sim.node import SimNode

#: The prefix of a simulated control path (nothing is created on disk).
PATH_PREFIX = "sim-inflight:"


class SimBoundWriter:
    """:class:`gpushare.daemon.inflight_control.BoundWriter` on a simulated node."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        #: The bound last written per control path (absent: 0, as a new file holds).
        self.bounds: dict[str, int] = {}
        #: The clients following a control path, by client id.
        self.followers: dict[str, str] = {}
        #: Every write, for tests and reports: (virtual s, GPU, bound).
        self.writes: list[tuple[float, str, int]] = []

    def path(self, gpu_uuid: str) -> str:
        """The GPU's simulated control path."""
        return PATH_PREFIX + gpu_uuid

    def write(self, gpu_uuid: str, bound: int) -> None:
        """Set the bound of every live trainer that follows the GPU's path."""
        path = self.path(gpu_uuid)
        self.bounds[path] = max(0, bound)
        self.writes.append((self.node.loop.now, gpu_uuid, max(0, bound)))
        for cid, followed in self.followers.items():
            c = self.node.client(cid)
            if followed == path and isinstance(c, OfflineTrainer) and c.pid in self.node.processes:
                c.set_inflight(max(0, bound))

    def bound_at_spawn(self, client_id: str, env: Mapping[str, str], bound: int) -> int:
        """The bound a trainer launched with ``env`` starts with (``bound``: its variables').

        With the library preloaded (``bound`` > 0 says so) and a control path, the path's bound
        overrides ``GPUSHARE_MAX_INFLIGHT``, as the library does, and later writes reach it.
        """
        path = env.get(native.CONTROL_ENV)
        if not path or bound <= 0:
            self.followers.pop(client_id, None)
            return bound
        self.followers[client_id] = path
        return self.bounds.get(path, 0)
