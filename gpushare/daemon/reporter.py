"""What the loop tells the outside after each tick: systemd's READY, STATUS and WATCHDOG, and metrics.

:class:`Reporter` sends ``READY=1`` once every shared GPU's MPS answers, a ``STATUS=`` line when
the clients' counts or MPS health change, and the watchdog ping after each completed tick (a stuck
loop stops the pings and systemd acts). It also makes the metrics exporter's snapshot, and keeps
the two counters only the metrics show (throttle events and MPS restarts per GPU), which the
actuator and the sensing step report to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import structlog

from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.metrics import Exporter, GpuControl, NodeMetrics
from gpushare.model import ClientClass, ClientState, MpsState, Observation
from gpushare.node import notify as sd

log = structlog.get_logger(__name__)

Counts = tuple[int, int, int]
"""Online and offline live clients, and queued ones (the STATUS= line)."""


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
        """Hand the tick's snapshot to the metrics exporter, if there is one."""
        if self.metrics is not None:
            self.metrics.update(self._snapshot(observations, records, tick))

    def _snapshot(
        self, observations: Mapping[str, Observation], records: Sequence[ClientRecord], tick: Tick
    ) -> NodeMetrics:
        ops, now = self.s.ops, tick.monotonic_s
        control = {
            uuid: GpuControl(
                duty=self.s.duty.get(uuid, 1.0),
                offline_sm_pct=self.s.default_sm(ClientClass.OFFLINE, uuid),
                throttle_events=self._throttle_events.get(uuid, 0),
                mps_restarts=self._mps_restarts.get(uuid, 0),
                evictions=ops.gpu_evictions(uuid),
                step_s=ops.step_histogram(uuid),
            )
            for uuid in observations
        }
        names = {r.uid: r.user for r in records}
        clients = {
            r.id: ops.client_stats(r.id, r.name, r.restarts, now)
            for r in records
            if r.state.is_live
        }
        queued = sum(1 for r in records if r.state is ClientState.QUEUED)
        return NodeMetrics(
            observations=tuple(observations.values()),
            control=control,
            user_names=names,
            clients=clients,
            admission=ops.admission(queued, tick.wall_s),
            events=self.s.registry.event_counts(),
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
