"""What the request gates learn from each tick: the online clients, their processes, the gated.

:class:`GateFeed` tells the :class:`~gpushare.daemon.gating.Gatekeeper` once a tick which online
clients exist on which GPU (and their processes, so the receiver thread can name a sender without
the daemon's lock) and which offline clients each GPU's gate may freeze: the running ones with a
process that were not told to go. It keeps the last tick's lists and reuses them while no record
changed and no client was told to go since.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import ClientClass

_Lists = tuple[tuple[str, ...], dict[str, str], dict[str, list[str]]]


class GateFeed:
    """See the module docstring."""

    def __init__(self, state: NodeState, lifecycle: Lifecycle) -> None:
        self.s = state
        self.life = lifecycle
        # The clients told to go, the online clients and the gated ones, as of the last remake.
        self._kept: _Lists | None = None

    def update(self, records: Sequence[ClientRecord], tick: Tick, *, changed: bool) -> None:
        """Tell the gates which online clients (and processes) and gated offline clients exist.

        ``changed``: whether any record changed since the last tick; when none did and no client
        was told to go since, the online and gated clients are the last tick's.
        """
        life = self.life
        going = life.going()
        kept = self._kept
        if not changed and kept is not None and kept[0] == going:
            _, online, gated = kept
        else:
            online, gated = {}, {}
            spans = []
            for rec in records:
                if rec.gpu_uuid is None or not rec.state.is_live:
                    continue
                if rec.cls is ClientClass.ONLINE:
                    online[rec.id] = rec.gpu_uuid
                    if len(rec.gang) > 1:
                        spans.append(rec.gang)
                elif (
                    rec.state in RUNNING_STATES and rec.pid is not None and not life.exiting(rec.id)
                ):
                    for uuid in rec.gpus():  # a gang is gated by every GPU it uses
                        gated.setdefault(uuid, []).append(rec.id)
            _union(gated, spans)
            self._kept = (going, online, gated)
        pids = life.main_pids(online) if online else {}
        for cid in online:
            try:
                pids.update(dict.fromkeys(self.s.pauser.pids(cid), cid))
            except PAUSE_ERRORS:
                continue  # the main pid is known; a pauser that cannot list keeps that
        self.s.gate.update_clients(online, gated, tick.monotonic_s, pids)


def _union(gated: dict[str, list[str]], spans: Sequence[Sequence[str]]) -> None:
    """Gate the offline clients of every GPU of an online gang by its rank 0's GPU's gate.

    A tensor-parallel server runs each request on all its GPUs at once, and its request
    boundaries hold the gate of the GPU it is known by (rank 0's): that gate freezes the offline
    clients on every GPU it uses, so its request finds all of them free (issue 35).
    """
    own = {uuid: tuple(ids) for uuid, ids in gated.items()}  # each GPU's own, before any union
    for span in spans:
        into = gated.setdefault(span[0], [])
        for uuid in span[1:]:
            into.extend(cid for cid in own.get(uuid, ()) if cid not in into)
