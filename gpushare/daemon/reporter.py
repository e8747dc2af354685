"""What the loop tells the outside after each tick: systemd's READY, STATUS and WATCHDOG, and metrics.

:class:`Reporter` sends ``READY=1`` once every shared GPU's MPS answers, a ``STATUS=`` line when
the clients' counts or MPS health change, and the watchdog ping after each completed tick (a stuck
loop stops the pings and systemd acts). It also makes the metrics exporter's snapshot, and keeps
the two counters only the metrics show (throttle events and MPS restarts per GPU), which the
actuator and the sensing step report to it.

The snapshot is built when ``/metrics`` is scraped, not every tick: at 8 GPUs x 200 clients it took
0.94 ms a tick, almost all of it each client's thaw figures. A tick keeps only its own objects and
the per-GPU and node figures (:class:`Published`, nothing per client); a scrape works out the
clients' figures from those, as of that tick, without the state lock (the thaw log has its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gpushare.daemon.opstats import OpStats, QueueFigures
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.metrics import ClientStats, Exporter, GpuControl, NodeMetrics
from gpushare.model import ClientClass, ClientState, MpsState, Observation
from gpushare.node import notify as sd

log = structlog.get_logger(__name__)

Counts = tuple[int, int, int]
"""Online and offline live clients, and queued ones (the STATUS= line)."""


@dataclass(frozen=True, slots=True)
class Published:
    """What a tick leaves for the next scrape: its own objects and O(GPUs) figures, none per client.

    ``records`` and ``observations`` are the tick's (neither is changed after it); ``evictions``
    is the eviction counts' mapping as of the tick (:meth:`OpStats.eviction_counts`); ``ops``
    answers the clients' thaw figures at the scrape, as of ``monotonic_s``.
    """

    observations: tuple[Observation, ...]
    records: tuple[ClientRecord, ...]
    control: Mapping[str, GpuControl]
    evictions: Mapping[str, int]
    queue: QueueFigures
    events: Mapping[tuple[str, str, str], int]
    monotonic_s: float
    ops: OpStats


class Reporter:
    """Health for systemd and the metrics snapshot; see the module docstring."""

    def __init__(
        self, state: NodeState, *, notify: Callable[..., bool], metrics: Exporter | None
    ) -> None:
        self.s = state
        self._notify = notify
        self.metrics = metrics
        #: Whether READY=1 has been sent.
        self.ready = False
        self._status_line = ""
        self._last_watchdog = 0.0
        self._watchdog_s = sd.watchdog_period_s()
        self._throttle_events: dict[str, int] = {}
        self._mps_restarts: dict[str, int] = {}
        #: The last completed tick's figures for the exporter (``None`` before the first).
        self.published: Published | None = None
        if metrics is not None:
            metrics.attach(self.metrics_snapshot)

    # ----------------------------------------------------------------------------- counters

    def throttled(self, gpu_uuid: str) -> None:
        """A GPU's offline duty went down (``gpushare_throttle_events_total``)."""
        self._throttle_events[gpu_uuid] = self._throttle_events.get(gpu_uuid, 0) + 1

    def mps_restarted(self, gpu_uuid: str) -> None:
        """A GPU's MPS daemon restarted (``gpushare_mps_restarts_total``)."""
        self._mps_restarts[gpu_uuid] = self._mps_restarts.get(gpu_uuid, 0) + 1

    # ----------------------------------------------------------------------------- metrics

    def publish(
        self, observations: Mapping[str, Observation], records: Sequence[ClientRecord], tick: Tick
    ) -> None:
        """Keep the tick's figures for the next scrape and tell the exporter the tick completed.

        Called under the state lock; costs O(GPUs), nothing per client (:class:`Published`).
        """
        if self.metrics is None:
            return
        ops = self.s.ops
        control = {
            uuid: GpuControl(
                duty=self.s.duty.get(uuid, 1.0),
                offline_sm_pct=self.s.default_sm(ClientClass.OFFLINE, uuid),
                offline_mps_priority=self.s.priority(ClientClass.OFFLINE, (uuid,)),
                throttle_events=self._throttle_events.get(uuid, 0),
                mps_restarts=self._mps_restarts.get(uuid, 0),
                evictions=ops.gpu_evictions(uuid),
                step_s=ops.step_histogram(uuid),
            )
            for uuid in observations
        }
        self.published = Published(
            observations=tuple(observations.values()),
            records=tuple(records),
            control=control,
            evictions=ops.eviction_counts(),
            queue=ops.queue_figures(tick.wall_s),
            events=self.s.registry.event_counts(),
            monotonic_s=tick.monotonic_s,
            ops=ops,
        )
        self.metrics.ticked()

    def metrics_snapshot(self) -> NodeMetrics:
        """The exporter's snapshot as of the last published tick; a scrape's thread calls it.

        Reads only :attr:`published`, which no one changes, and the thaw log under its own lock:
        never the state lock, so a scrape never waits for a tick nor makes one wait.
        """
        p = self.published
        if p is None:
            return NodeMetrics()
        live = [r for r in p.records if r.state.is_live]
        thaw = p.ops.thaw_figures([r.id for r in live], p.monotonic_s)
        clients = {
            r.id: ClientStats(
                name=r.name,
                thawed_s=thaw[r.id][0],
                thawed_ratio=thaw[r.id][1],
                restarts=r.restarts,
                evictions=p.evictions.get(r.id, 0),
            )
            for r in live
        }
        queued = sum(1 for r in p.records if r.state is ClientState.QUEUED)
        return NodeMetrics(
            observations=p.observations,
            control=p.control,
            user_names={r.uid: r.user for r in p.records},
            clients=clients,
            admission=p.queue.admission(queued),
            events=p.events,
        )

    # ----------------------------------------------------------------------------- health

    def report(self, tick: Tick, line: str) -> None:
        """After a tick: READY once every MPS is up, STATUS= when ``line`` changed, the watchdog."""
        if not self.ready and self._all_mps_up():
            self.ready = True
            self._notify("READY=1", sd.status_field(line))
            self._status_line = line  # sent with READY=1: not again on its own below
            self.s.registry.add_event("daemon_ready", f"ready: {line}")
            log.info("daemon_ready")
        if line != self._status_line:
            self._status_line = line
            self._notify(sd.status_field(line))
        now = tick.monotonic_s
        if self._watchdog_s is not None and now - self._last_watchdog >= self._watchdog_s:
            # Pinged only after a completed tick: a stuck loop stops the pings and systemd acts.
            self._last_watchdog = now
            self._notify("WATCHDOG=1")

    def _all_mps_up(self) -> bool:
        shared = [x for x in self.s.samples if self.s.shared(x)]
        return all(self.s.mps_states.get(x.uuid) is MpsState.UP for x in shared)

    def summary(self, records: Sequence[ClientRecord] | None = None) -> str:
        """The one-line STATUS= summary (of ``records``, by default the registry's clients)."""
        return self.summary_line(count(self.s.registry.clients() if records is None else records))

    def summary_line(self, counts: Counts) -> str:
        """The STATUS= line for these counts and the last tick's MPS states."""
        s = self.s
        shared = [x for x in s.samples if s.shared(x)]
        up = sum(1 for x in shared if s.mps_states.get(x.uuid) is MpsState.UP)
        online, offline, queued = counts
        return (
            f"{len(shared)} GPU(s), MPS up {up}/{len(shared)}, {online} online + {offline} "
            f"offline client(s), {queued} queued"
        )


def count(records: Sequence[ClientRecord]) -> Counts:
    """Online and offline live clients, and queued ones, for the STATUS= line."""
    online = offline = queued = 0
    for r in records:
        if r.state is ClientState.QUEUED:
            queued += 1
        elif r.state.is_live:
            if r.cls is ClientClass.ONLINE:
                online += 1
            else:
                offline += 1
    return online, offline, queued
