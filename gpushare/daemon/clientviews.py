"""The clients as one tick sees them: each client's view, by GPU, remade only when records change.

The registry hands out the same record object until a client changes, so a tick whose records
are all the ones the last tick saw has nothing to remake: :class:`ClientViews` keeps, from the
last tick that changed any record, each client's :class:`~gpushare.model.ClientView` (reused
while its record is the same object and its queue has not switched live), the views of each GPU's clients, and the clients' counts
for the STATUS= line. It is the one owner of these identity-keyed caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpushare.daemon import startcost
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.reporter import Counts, count
from gpushare.daemon.tick import Tick
from gpushare.model import ClientClass, ClientState, ClientView, Limits


class ClientViews:
    """See the module docstring."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.life = lifecycle
        self._synced: Sequence[ClientRecord] = ()  # the records the last refresh saw
        # Each client's view and the record it was made from.
        self._views: dict[str, tuple[ClientRecord, ClientView]] = {}
        self._shallow: frozenset[str] = frozenset()  # the clients the views show shallow
        #: The GPUs a client's gang spans where its record names one GPU: the simulator's gangs,
        #: whose ranks are one-GPU clients tied outside the daemon (:mod:`gpushare.sim.gangrun`).
        #: Set before the clients' records exist (a view is remade only when its record changes).
        self.spans: dict[str, int] = {}
        self._by_gpu: dict[str | None, list[ClientRecord]] = {}
        self._gang_gpus: frozenset[str | None] = frozenset()
        self._view_map: dict[str, ClientView] = {}
        self._gpu_views: dict[str, tuple[ClientView, ...]] = {}
        #: Online and offline live clients, and queued ones, as of the last change.
        self.counts: Counts = (0, 0, 0)
        #: The live clients' ids, as of the last change.
        self.live_ids: frozenset[str] = frozenset()
        #: Whether any job waits for admission (queued, or admitted in the foreground and not
        #: yet taken by its submitter), as of the last change.
        self.admitting = False

    def refresh(self, records: Sequence[ClientRecord], tick: Tick) -> bool:
        """Take this tick's records; whether any changed since the last call (then remade)."""
        synced = self._synced
        changed = len(records) != len(synced) or any(
            a is not b for a, b in zip(records, synced, strict=True)
        )
        # A live --queue auto client turns shallow or deep when gating flips, and no record
        # changes (issue 32): a view kept then hid gating back on from the controller.
        shallow = frozenset(self.life.shallow)
        if changed or shallow != self._shallow:
            self._shallow = shallow
            self._synced = records
            by_gpu: dict[str | None, list[ClientRecord]] = {}
            for rec in records:
                # A gang is a client of every GPU it uses: each GPU's controller sees its rank.
                for uuid in rec.gpus() or (None,):
                    by_gpu.setdefault(uuid, []).append(rec)
            self._by_gpu = by_gpu
            # The GPUs an offline gang spans: only their views are re-read each tick (a gang's
            # share changes with no record changing); the rest stay cached, as at 8 x 200 idle.
            self._gang_gpus = frozenset(u for r in records if len(r.gang) > 1 for u in r.gpus())
            self._view_map = self._views_of(records, tick)
            self._gpu_views = {}
            self.counts = count(records)
            # Both only change with a record: kept, not recounted over every client each tick.
            self.live_ids = frozenset(r.id for r in records if r.state.is_live)
            self.admitting = any(
                r.state is ClientState.QUEUED or (r.state is ClientState.STARTING and r.pid is None)
                for r in records
            )
        return changed

    def of_gpu(self, gpu_uuid: str) -> tuple[ClientView, ...]:
        """The views of the clients placed on a GPU, in the registry's order."""
        mine = self._gpu_views.get(gpu_uuid)
        if mine is None:
            views = self._view_map
            mine = tuple(views[r.id] for r in self._by_gpu.get(gpu_uuid, ()))
            self._gpu_views[gpu_uuid] = mine
        if gpu_uuid in self._gang_gpus:
            mine = self._gang_shares(gpu_uuid, mine)
        return mine

    def _gang_shares(self, gpu_uuid: str, views: tuple[ClientView, ...]) -> tuple[ClientView, ...]:
        """An offline gang's view on one GPU with its other GPUs' smallest share (issue 35).

        Read each tick, not kept: a share changes with no record changing.
        """
        s = self.life.s
        gangs = {r.id: r.gang for r in self._by_gpu.get(gpu_uuid, ()) if len(r.gang) > 1}
        out = []
        for v in views:
            others = [u for u in gangs.get(v.client_id, ()) if u != gpu_uuid]
            if others and v.cls is ClientClass.OFFLINE:
                low = min(s.default_sm(ClientClass.OFFLINE, u) for u in others)
                v = replace(v, gang_share_pct=low)
            out.append(v)
        return tuple(out)

    def _views_of(self, records: Sequence[ClientRecord], tick: Tick) -> dict[str, ClientView]:
        """Every client's view, made anew only for the records that changed since the last tick."""
        old = self._views
        shallow = self._shallow
        fresh: dict[str, tuple[ClientRecord, ClientView]] = {}
        for rec in records:
            known = old.get(rec.id)
            if known is not None and known[0] is rec and known[1].shallow == (rec.id in shallow):
                fresh[rec.id] = known
            else:
                fresh[rec.id] = (rec, self._view(rec, tick))
        self._views = fresh  # finished clients drop out with their records
        return {cid: view for cid, (_, view) in fresh.items()}

    def _view(self, rec: ClientRecord, tick: Tick) -> ClientView:
        started = None
        if rec.started_at is not None:
            started = tick.monotonic_s - max(0.0, tick.wall_s - rec.started_at)
        cost, source = startcost.fed_cost(
            rec.restart_cost_s, rec.startup_s, self.life.s.config.control
        )
        return ClientView(
            client_id=rec.id,
            cls=rec.cls,
            state=rec.state,
            limits=Limits(
                sm_pct=rec.sm_pct if rec.sm_pct is not None else 100.0,
                pinned_mem_bytes=rec.mem_bytes,
                priority=rec.priority,
            ),
            uid=rec.uid,
            pid=rec.pid,
            slo_p99_ms=rec.slo_p99_ms,
            slo_ttft_p99_ms=rec.slo_ttft_p99_ms,
            slo_tpot_p99_ms=rec.slo_tpot_p99_ms,
            restartable=rec.restartable,
            ceiling_sm_pct=rec.sm_ceiling,
            failures=rec.failures,
            started_at_s=started,
            held=rec.held,
            queue=rec.queue,
            shallow=self.life.is_shallow(rec.id),
            live_queue=self.life.live.is_live(rec.id),  # issue 32
            # Issue 32: declared, else measured (capped), else None: the controller's default.
            restart_cost_s=cost,
            restart_cost_measured=source == startcost.MEASURED,
            restarts=rec.restarts,
            gang_gpus=max(len(rec.gpus()), self.spans.get(rec.id, 1), 1),
        )
