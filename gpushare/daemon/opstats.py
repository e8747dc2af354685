"""What operators see beyond the registry: thawed time, evictions, the last action per GPU, timings.

The control loop feeds an :class:`OpStats` as it acts (freeze/thaw, evictions, controller steps,
admissions) and calls :meth:`OpStats.sync` once per tick with the clients the registry holds, which
starts tracking new clients and drops ended ones, so memory is bounded by the live and queued
clients plus a fixed amount per GPU. Everything here is in memory and starts afresh with the daemon
(counters since the daemon started, as Prometheus counters are). :func:`latency_status` and
:func:`gate_status` build the ``status`` fields of docs/status-schema.md from it.

The metrics exporter reads it on a scrape, not every tick: a tick keeps what it needs in O(GPUs)
(the eviction counts are a mapping replaced, never changed, on each eviction, so keeping it is a
reference; :meth:`OpStats.queue_figures`), and the per-client thaw figures are worked out when a
scrape asks (:meth:`OpStats.thaw_figures`, under the thaw log's own lock).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.daemon.thawlog import ThawLog
from gpushare.latency.p99 import LatencyP99
from gpushare.metrics import (
    STEP_BUCKETS_S,
    WAIT_BUCKETS_S,
    AdmissionStats,
    ClientStats,
    DurationHistogram,
    HistogramSnapshot,
)
from gpushare.model import ClientState

ThawFigures = tuple[float | None, float | None]
"""A client's thawed seconds since tracking began and thawed fraction of the last minute."""


@dataclass(frozen=True, slots=True)
class LastAction:
    """The last controller action that changed something on a GPU, and why."""

    kind: str
    reason: str
    at_wall_s: float
    at_mono_s: float
    client_id: str | None = None


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """The admission queue's figures as of one tick, kept for a later scrape.

    ``oldest_since_wall_s`` is when the longest-waiting queued job was queued (``None``: none
    known); ``wait_s`` the waits of admitted jobs; ``at_wall_s`` the tick's wall-clock time.
    """

    oldest_since_wall_s: float | None
    wait_s: HistogramSnapshot
    at_wall_s: float

    def admission(self, queued: int) -> AdmissionStats:
        """The ``/metrics`` admission figures for ``queued`` jobs queued at that tick."""
        oldest = self.oldest_since_wall_s
        return AdmissionStats(
            queued=queued,
            oldest_wait_s=None
            if oldest is None or not queued
            else max(0.0, self.at_wall_s - oldest),
            wait_s=self.wait_s,
        )


@dataclass(frozen=True, slots=True)
class Tracked:
    """A client as :meth:`OpStats.sync` needs it."""

    client_id: str
    live: bool
    thawed: bool
    queued: bool = False
    queued_since_wall_s: float | None = None


class OpStats:
    """Per-client and per-GPU figures for ``status`` and ``/metrics``.

    One owner (the loop's lock), except the thawed time: freezes and thaws are reported by the
    freeze arbiter (``daemon.freeze``) from whichever thread caused them (the request receiver's included), so the
    thaw log has a lock of its own, and time never runs backwards in it.
    """

    def __init__(self, thaw_window_s: float = 60.0) -> None:
        self.thaw = ThawLog(window_s=thaw_window_s)
        self._thaw_lock = threading.Lock()
        self._thaw_now = float("-inf")
        # Replaced on each change, never changed in place: a tick keeps it for a later scrape.
        self._evictions: Mapping[str, int] = {}
        self._gpu_evictions: dict[str, int] = {}
        self._steps: dict[str, DurationHistogram] = {}
        self._wait = DurationHistogram(WAIT_BUCKETS_S)
        self._last: dict[str, LastAction] = {}
        self._queued_since: dict[str, float] = {}

    # ----------------------------------------------------------------------------- feeding

    def paused(self, client_id: str, paused: bool, now: float) -> None:
        """A client was frozen or thawed (``now``: monotonic seconds); any thread."""
        with self._thaw_lock:
            self.thaw.set(client_id, not paused, self._clamp(now))

    def _clamp(self, now: float) -> float:
        # Callers read the clock before taking the lock: keep the log's time monotonic.
        self._thaw_now = max(self._thaw_now, now)
        return self._thaw_now

    def evicted(self, client_id: str, gpu_uuid: str) -> None:
        """A client is being evicted from a GPU."""
        self._evictions = {**self._evictions, client_id: self._evictions.get(client_id, 0) + 1}
        self._gpu_evictions[gpu_uuid] = self._gpu_evictions.get(gpu_uuid, 0) + 1

    def stepped(self, gpu_uuid: str, seconds: float) -> None:
        """The controller's step for a GPU took ``seconds``."""
        hist = self._steps.get(gpu_uuid)
        if hist is None:
            hist = self._steps[gpu_uuid] = DurationHistogram(STEP_BUCKETS_S)
        hist.observe(seconds)

    def acted(self, gpu_uuid: str, action: LastAction) -> None:
        """Remember the GPU's last effective controller action."""
        self._last[gpu_uuid] = action

    def admitted(self, client_id: str, now_wall_s: float) -> None:
        """A queued client was admitted: count how long it waited."""
        since = self._queued_since.pop(client_id, None)
        if since is not None:
            self._wait.observe(max(0.0, now_wall_s - since))

    def sync(self, clients: Iterable[Tracked], now: float) -> None:
        """Once per tick: track new live clients, drop ended ones, note queued ones."""
        live: set[str] = set()
        known: set[str] = set()
        for c in clients:
            known.add(c.client_id)
            if c.live:
                live.add(c.client_id)
                with self._thaw_lock:
                    if self.thaw.thawed(c.client_id) is None:
                        self.thaw.set(c.client_id, c.thawed, self._clamp(now))
            if c.queued and c.client_id not in self._queued_since:
                since = c.queued_since_wall_s
                self._queued_since[c.client_id] = since if since is not None else now
        with self._thaw_lock:
            for cid in self.thaw.clients():
                if cid not in live:
                    self.thaw.forget(cid)
        for cid in [k for k in self._queued_since if k not in known]:
            del self._queued_since[cid]
        if any(k not in known for k in self._evictions):
            self._evictions = {k: n for k, n in self._evictions.items() if k in known}

    # ----------------------------------------------------------------------------- reading

    def evictions(self, client_id: str) -> int:
        """The client's evictions since the daemon started."""
        return self._evictions.get(client_id, 0)

    def gpu_evictions(self, gpu_uuid: str) -> int:
        """Evictions from a GPU since the daemon started."""
        return self._gpu_evictions.get(gpu_uuid, 0)

    def step_histogram(self, gpu_uuid: str) -> HistogramSnapshot | None:
        """Controller step durations of a GPU; ``None`` before its first step."""
        hist = self._steps.get(gpu_uuid)
        return None if hist is None else hist.snapshot()

    def last_action(self, gpu_uuid: str) -> LastAction | None:
        """The GPU's last effective controller action."""
        return self._last.get(gpu_uuid)

    def eviction_counts(self) -> Mapping[str, int]:
        """Every known client's evictions (absent: none): a mapping no later eviction changes."""
        return self._evictions

    def queue_figures(self, now_wall_s: float) -> QueueFigures:
        """The admission queue as of now, for :meth:`QueueFigures.admission` at a later scrape."""
        oldest = min(self._queued_since.values(), default=None)
        return QueueFigures(oldest, self._wait.snapshot(), now_wall_s)

    def admission(self, queued: int, now_wall_s: float) -> AdmissionStats:
        """Queue length, the oldest queued job's wait, and the waits of admitted jobs."""
        return self.queue_figures(now_wall_s).admission(queued)

    def offline_fields(self, client_id: str, state: ClientState, now: float) -> dict[str, Any]:
        """The ``offline`` object of a client in ``status``/``list``.

        Thawed figures exist for live clients only; an ended client's evictions are no longer
        kept (``null``), a queued one keeps those of its earlier runs.
        """
        with self._thaw_lock:
            now = self._clamp(now)
            ratio = self.thaw.fraction(client_id, now) if state.is_live else None
            total = self.thaw.total_s(client_id, now) if state.is_live else None
        return {
            "thawed_ratio_1m": None if ratio is None else round(ratio, 4),
            "thawed_s": None if total is None else round(total, 3),
            "evictions": None if state.is_final else self._evictions.get(client_id, 0),
        }

    def thaw_figures(self, client_ids: Iterable[str], now: float) -> dict[str, ThawFigures]:
        """Each client's thawed seconds and last minute's fraction as of ``now``; any thread.

        The thaw lock is taken per client, as the freeze arbiter takes it per freeze: a scrape
        that asks for every client never makes a freeze wait for more than one client's figures.
        A time before the log's last change counts as that change's (the log never goes back).
        """
        out: dict[str, ThawFigures] = {}
        for cid in client_ids:
            with self._thaw_lock:
                at = self._clamp(now)
                out[cid] = (self.thaw.total_s(cid, at), self.thaw.fraction(cid, at))
        return out

    def client_stats(
        self, client_id: str, name: str | None, restarts: int, now: float
    ) -> ClientStats:
        """What ``/metrics`` shows of a live client beyond its observation."""
        thawed_s, thawed_ratio = self.thaw_figures((client_id,), now)[client_id]
        return ClientStats(
            name=name,
            thawed_s=thawed_s,
            thawed_ratio=thawed_ratio,
            restarts=restarts,
            evictions=self._evictions.get(client_id, 0),
        )


def latency_status(
    p99: LatencyP99 | None,
    slo_p99_ms: float | None,
    probe_ratio: float | None,
    probe_slo_ratio: float,
) -> dict[str, Any]:
    """The ``latency`` object of an online client in ``status``.

    ``ratio`` is how close the client is to its limit, 1 at the limit: its p99 over its SLO when it
    reports latency; otherwise, with ``source`` ``"probe"``, the GPU's probe ratio over
    ``control.probe_slo_ratio``, which is what the controller then protects it by.
    """
    value = p99.p99_ms if p99 is not None else None
    out: dict[str, Any] = {
        "p99_ms": p99.p99_ms if p99 is not None else None,
        "samples": p99.samples if p99 is not None else 0,
        "reason": p99.reason if p99 is not None else "no latency reports",
        # May quote what the client's own URL returned: the view of another user drops it.
        "error_detail_owner_only": p99.error_detail_owner_only if p99 is not None else None,
        "slo_p99_ms": slo_p99_ms,
        "ratio": None,
        "source": None,
    }
    if p99 is not None and value is not None:
        out["source"] = p99.source or "app"
        if slo_p99_ms:
            out["ratio"] = value / slo_p99_ms
    elif probe_ratio is not None and probe_slo_ratio > 0:
        out["source"] = "probe"
        out["ratio"] = probe_ratio / probe_slo_ratio
    return out


def token_status(
    p99: LatencyP99 | None, slo_p99_ms: float | None, window_s: float
) -> dict[str, Any] | None:
    """The ``latency.ttft`` or ``latency.tpot`` object of an LLM server in ``status``.

    ``None`` when the client neither declares that SLO nor reports that timing.
    """
    if p99 is None and slo_p99_ms is None:
        return None
    value = p99.p99_ms if p99 is not None else None
    return {
        "p99_ms": value,
        "samples": p99.samples if p99 is not None else 0,
        "reason": p99.reason if p99 is not None else "no reports",
        "slo_p99_ms": slo_p99_ms,
        "ratio": value / slo_p99_ms if value is not None and slo_p99_ms else None,
        "window_s": window_s,
    }


def gate_status(duty: float, last: LastAction | None, now_mono_s: float) -> Mapping[str, Any]:
    """The ``gate`` object of a GPU in ``status``: what offline work may do there, and why."""
    state = "open" if duty >= 1.0 else "closed" if duty <= 0.0 else "cycling"
    action = None
    if last is not None:
        action = {
            "kind": last.kind,
            "reason": last.reason,
            "client_id": last.client_id,
            "at": last.at_wall_s,
            "age_s": round(max(0.0, now_mono_s - last.at_mono_s), 3),
        }
    return {"state": state, "duty": duty, "last_action": action}
