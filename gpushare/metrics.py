"""The Prometheus exporter: what gpushare is doing to each GPU and client, for dashboards and alerts.

Names follow Prometheus style with units in the name (``_bytes``, ``_seconds``, ``_ratio``) and the
labels ``gpu``, ``UUID``, ``Hostname`` and ``modelName`` exactly as dcgm-exporter spells them (its
series carry ``gpu="0"``, ``UUID="GPU-…"``, ``modelName="NVIDIA H200"`` and ``Hostname`` beside
``device``), so ``on(UUID)`` or ``on(Hostname, gpu)`` joins gpushare's series with DCGM's device
metrics. ``Hostname`` is ``$NODE_NAME`` when set, else the host name, as dcgm-exporter chooses it;
``modelName`` is NVML's device name, the one DCGM reports. Client series add ``client`` (the id),
``name`` (``--name``, or empty), ``class`` and ``user``. Device-level and client-level metrics are
kept apart (dcgm-exporter#587: per-client series repeating device values mislead). Beside them:
``gpushare_build_info``, ``gpushare_clients`` (live clients by class and state per GPU) and
prometheus_client's process collector (``process_*``: CPU, memory, open files of the daemon).

The HTTP server (:meth:`Exporter.serve`) answers ``/metrics`` with the exposition and ``/healthz``
with 200 while the control loop ticks (each tick calls :meth:`Exporter.ticked`) or 503 once no tick
came for :meth:`Exporter.stall_after_s`; every other path is a 404.

A tick only says it completed (:meth:`Exporter.ticked`); the snapshot, as of the last completed
tick, is built by the daemon's reporter (:meth:`Exporter.attach`) when a scrape needs it, a few
times a minute rather than ten times a second. Any local user can reach the listener, so a flood
of scrapes builds at most once per completed tick and per tick period, one scrape building while
the others wait, and renders each snapshot once per exposition format: every scraper of it gets
the same bytes (:mod:`gpushare.metrics_http`, which also bounds the connections served at once).

Cardinality is bounded: every scrape serves the latest :class:`NodeMetrics` snapshot, so a client
that has gone away disappears from the output instead of lingering as a stale series, and the
per-GPU and node series are a fixed set. Label values are written by prometheus_client, which
escapes quotes, backslashes and newlines; a user-chosen ``--name`` cannot break the exposition.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gpushare import __version__, metrics_http, trust
from gpushare.model import ClientClass, ClientState, MpsState, Observation

# Controller steps take microseconds to milliseconds; admission waits seconds to hours.
STEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
WAIT_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 86400.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A cumulative histogram: ``(upper bound, observations at or below it)`` per bucket."""

    buckets: tuple[tuple[float, int], ...]
    sum_s: float
    count: int


class DurationHistogram:
    """Durations in seconds counted into fixed buckets (bounded memory; one owner, no lock)."""

    def __init__(self, bounds_s: Sequence[float]) -> None:
        self._bounds = tuple(sorted(bounds_s))
        self._counts = [0] * len(self._bounds)
        self._sum_s = 0.0
        self._count = 0

    def observe(self, seconds: float) -> None:
        """Count one duration."""
        self._sum_s += seconds
        self._count += 1
        for i, bound in enumerate(self._bounds):
            if seconds <= bound:
                self._counts[i] += 1
                break

    def snapshot(self) -> HistogramSnapshot:
        """The cumulative counts so far (the ``+Inf`` bucket is ``count``)."""
        cumulative, running = [], 0
        for bound, n in zip(self._bounds, self._counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), self._sum_s, self._count)


@dataclass(frozen=True, slots=True)
class GpuControl:
    """Controller state of one GPU that the observation does not carry.

    ``evictions`` counts the GPU's evictions since the daemon started; ``step_s`` the durations of
    the controller's ``step`` for the GPU (``None``: not measured).
    """

    duty: float
    offline_sm_pct: float
    offline_mps_priority: int = 1
    throttle_events: int = 0
    mps_restarts: int = 0
    evictions: int = 0
    step_s: HistogramSnapshot | None = None


@dataclass(frozen=True, slots=True)
class ClientStats:
    """What the daemon keeps about one live client beyond its observation.

    ``thawed_s`` is the time it was thawed since the daemon began tracking it (a counter);
    ``thawed_ratio`` the fraction of the last minute it was thawed (``None``: not tracked).
    """

    name: str | None = None
    thawed_s: float | None = None
    thawed_ratio: float | None = None
    restarts: int = 0
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """The admission queue: its length, the oldest job's wait, and the waits of admitted jobs."""

    queued: int = 0
    oldest_wait_s: float | None = None
    wait_s: HistogramSnapshot | None = None


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    """One tick's worth of everything the exporter shows."""

    observations: Sequence[Observation] = ()
    control: Mapping[str, GpuControl] = field(default_factory=dict)
    user_names: Mapping[int, str] = field(default_factory=dict)
    clients: Mapping[str, ClientStats] = field(default_factory=dict)
    admission: AdmissionStats = AdmissionStats()
    #: Events of the daemon's log since it started, by (kind, severity, GPU UUID or "").
    events: Mapping[tuple[str, str, str], int] = field(default_factory=dict)


_GPU_LABELS = ["gpu", "UUID", "Hostname", "modelName"]
_CLIENT_LABELS = [*_GPU_LABELS, "client", "name", "class", "user"]
_Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
# A stalled loop is one that missed this many ticks, and never less than STALL_MIN_S: a GC pause
# or a slow NVML call must not flap the health check.
STALL_TICKS = 50
STALL_MIN_S = 5.0
# A connection that sends nothing is dropped after this long: any local user can connect, and
# each open connection holds a thread.
HTTP_TIMEOUT_S = 5.0
#: The control loop's default period (the least time between two builds until serve is told).
DEFAULT_TICK_S = 0.1
#: A snapshot is served for at least this many times what rendering it took, wall time (~0.14 s
#: at 8 GPUs x 200 clients: a snapshot up to ~3 s old), so a flood of scrapes spends at most 1/20
#: of a core rendering, holding the GIL the control loop needs, whatever the control period.
RENDER_SPACING = 20.0


def node_hostname() -> str:
    """The ``Hostname`` label: ``$NODE_NAME`` (Kubernetes' downward API), else the host name.

    dcgm-exporter makes the same choice, so the two exporters' series of one node agree.
    """
    return os.environ.get("NODE_NAME") or socket.gethostname()


class Exporter(Collector):
    """A prometheus_client collector over the latest snapshot, plus its HTTP server.

    Args:
        hostname: the ``Hostname`` label (:func:`node_hostname` when ``None``).
        clock: monotonic seconds, for the health check's stall detection.
    """

    def __init__(
        self, hostname: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._lock = threading.Lock()
        # Held by the one scrape building a snapshot: concurrent scrapes wait and reuse it.
        self._build_lock = threading.Lock()
        self._snapshot = NodeMetrics()
        self._source: Callable[[], NodeMetrics] | None = None
        self.clock = clock  #: Monotonic seconds (stalls, build spacing, render times).
        self._last_tick_s: float | None = None
        # Completed ticks; the tick and clock time the cached snapshot was built at.
        self._ticks, self._built_tick, self._built_at_s = 0, 0, float("-inf")
        #: The shortest time between two builds (:meth:`serve` sets it to the tick period).
        self.min_build_interval_s = DEFAULT_TICK_S
        # Seconds spent rendering the cached snapshot (every format): the next build waits
        # RENDER_SPACING times that, so a scrape flood keeps rendering to a small share of a core.
        self._rendered_s = 0.0
        self.builds = 0  #: Snapshots built from the attached source so far.
        self.hostname = hostname if hostname is not None else node_hostname()
        self.stall_after_s = STALL_MIN_S
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._process = ProcessCollector(registry=self.registry)
        #: The rendered bytes of the latest snapshot the HTTP server serves every scraper.
        self.render_cache: metrics_http.RenderCache[NodeMetrics] = metrics_http.RenderCache(self)
        self._server: ThreadingHTTPServer | None = None

    def attach(self, source: Callable[[], NodeMetrics]) -> None:
        """Have a scrape build its snapshot with ``source`` (from its thread; when due only)."""
        with self._lock:
            self._source = source

    def ticked(self) -> None:
        """A control-loop tick completed: the next scrape builds afresh (constant time)."""
        with self._lock:
            self._ticks += 1
            self._last_tick_s = self.clock()

    def update(self, snapshot: NodeMetrics) -> None:
        """Replace the snapshot the next scrape renders, as a completed tick's (no source needed)."""
        with self._lock:
            self._ticks += 1
            self._snapshot, self._built_tick = snapshot, self._ticks
            self._last_tick_s = self.clock()

    def snapshot(self) -> NodeMetrics:
        """The snapshot a scrape renders: the cached one, or one built now when it is due."""
        with self._lock:
            if not self._due():
                return self._snapshot
        with self._build_lock:
            with self._lock:
                # Another scrape may have built it while this one waited for the build lock.
                source, tick = self._source, self._ticks
                if source is None or not self._due():
                    return self._snapshot
            built = source()
            with self._lock:
                self._snapshot, self._built_tick, self._built_at_s = built, tick, self.clock()
                self._rendered_s = 0.0
                self.builds += 1
            return built

    def _due(self) -> bool:
        """Whether a build is due: a tick completed since the last, which is old enough."""
        if self._source is None or self._built_tick == self._ticks:
            return False
        spacing_s = max(self.min_build_interval_s, RENDER_SPACING * self._rendered_s)
        return self.clock() - self._built_at_s >= spacing_s

    def rendered(self, snapshot: NodeMetrics, seconds: float) -> None:
        """The HTTP server rendered ``snapshot`` in ``seconds`` (of :attr:`clock`)."""
        with self._lock:
            if snapshot is self._snapshot:
                self._rendered_s += seconds

    def health(self) -> tuple[bool, str]:
        """Whether the control loop ticks: ``(healthy, one line saying so)``."""
        with self._lock:
            last = self._last_tick_s
        if last is None:
            return False, "stalled: the control loop has not ticked yet"
        age_s = self.clock() - last
        if age_s > self.stall_after_s:
            return False, f"stalled: no control-loop tick for {age_s:.1f} s"
        return True, f"ok: last control-loop tick {age_s:.3f} s ago"

    def serve(self, listen: str, tick_period_s: float = DEFAULT_TICK_S) -> tuple[str, int]:
        """Serve ``/metrics`` and ``/healthz`` on ``HOST:PORT`` from a background thread.

        ``tick_period_s`` is the control loop's period: ``/healthz`` turns 503 after
        :data:`STALL_TICKS` missed ticks (at least :data:`STALL_MIN_S`), and scrapes build a
        snapshot at most once per period. Returns the bound address.

        Raises:
            OSError: the address cannot be bound (in use, or not a local address).
        """
        self.stall_after_s = max(STALL_MIN_S, STALL_TICKS * tick_period_s)
        self.min_build_interval_s = tick_period_s
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        handler = metrics_http.handler(self.render_cache, self, HTTP_TIMEOUT_S)
        server = metrics_http.server_class(host)((host, int(port)), handler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._server = server
        bound_host, bound_port = server.server_address[:2]
        return str(bound_host), int(bound_port)

    def close(self) -> None:
        """Stop the HTTP server, if one runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def collect(self) -> Iterator[_Family]:
        """Every family of the last tick's snapshot, for ``generate_latest(exporter.registry)``."""
        yield _build_info()
        yield from _snapshot_families(self.snapshot(), self.hostname)
        yield _trust_metrics()

    def snapshot_families(self, snapshot: NodeMetrics) -> Collector:
        """The families that are a function of ``snapshot`` alone (the server caches their bytes)."""
        return _Families(lambda: _snapshot_families(snapshot, self.hostname))

    def live_families(self) -> Collector:
        """Build info, trust refusals and ``process_*``: rendered on every scrape (a few lines)."""
        return _Families(lambda: (_build_info(), _trust_metrics(), *self._process.collect()))


class _Families(Collector):
    """Families from a function, as a collector an encoder renders."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        """The function's families."""
        return self._families()


def _snapshot_families(snap: NodeMetrics, hostname: str) -> Iterator[_Family]:
    yield from _gpu_metrics(snap, hostname)
    yield from _client_metrics(snap, hostname)
    yield from _admission_metrics(snap.admission)
    yield _event_metrics(snap)


def _build_info() -> GaugeMetricFamily:
    info = GaugeMetricFamily(
        "gpushare_build_info",
        "Always 1: the daemon's version and Python (join on instance to label other series)",
        labels=["version", "python"],
    )
    info.add_metric([__version__, platform.python_version()], 1.0)
    return info


def _gauge(name: str, doc: str, labels: list[str] = _GPU_LABELS) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _histogram(family: HistogramMetricFamily, labels: list[str], h: HistogramSnapshot) -> None:
    buckets = [(repr(float(b)), float(n)) for b, n in h.buckets]
    buckets.append(("+Inf", float(h.count)))
    family.add_metric(labels, buckets, h.sum_s)


def _gpu_labels(obs: Observation, hostname: str) -> list[str]:
    return [str(obs.gpu_index), obs.gpu_uuid, hostname, obs.sample.name or ""]


def _gpu_metrics(snap: NodeMetrics, hostname: str) -> Iterator[_Family]:
    up = _gauge(
        "gpushare_mps_daemon_up", "1 when the GPU's MPS control daemon answers", _GPU_LABELS
    )
    fault = _gauge("gpushare_mps_fault", "1 while the GPU's MPS server is in FAULT", _GPU_LABELS)
    duty = _gauge("gpushare_offline_duty_ratio", "Fraction of each period offline clients may run")
    share = _gauge(
        "gpushare_offline_sm_limit_ratio", "SM share new and restarted offline clients get"
    )
    prio = _gauge(
        "gpushare_offline_mps_priority", "MPS priority new offline clients get (0: online's)"
    )
    probe = _gauge(
        "gpushare_probe_latency_p99_seconds", "p99 wait+run time of the probe kernel", _GPU_LABELS
    )
    probe_ratio = _gauge(
        "gpushare_probe_latency_ratio", "Probe p99 over its learned baseline", _GPU_LABELS
    )
    lost = _gauge("gpushare_gpu_lost", "1 when NVML reports the GPU lost or hung", _GPU_LABELS)
    throttles = CounterMetricFamily(
        "gpushare_throttle_events",
        "Times offline work was throttled on the GPU",
        labels=_GPU_LABELS,
    )
    restarts = CounterMetricFamily(
        "gpushare_mps_server_restarts",
        "Restarts of the GPU's MPS control daemon",
        labels=_GPU_LABELS,
    )
    evictions = CounterMetricFamily(
        "gpushare_evictions", "Clients evicted from the GPU", labels=_GPU_LABELS
    )
    step = HistogramMetricFamily(
        "gpushare_controller_step_seconds",
        "Time the controller's step took for the GPU",
        labels=_GPU_LABELS,
    )
    for obs in snap.observations:
        labels = _gpu_labels(obs, hostname)
        up.add_metric(labels, 1.0 if obs.mps_state in (MpsState.UP, MpsState.FAULT) else 0.0)
        fault.add_metric(labels, 1.0 if obs.mps_state is MpsState.FAULT else 0.0)
        lost.add_metric(labels, 1.0 if obs.sample.lost else 0.0)
        # Missing readings are absent series, never zeros (conventions B3).
        if obs.probe.latency_ms is not None:
            probe.add_metric(labels, obs.probe.latency_ms / 1000.0)
        if obs.probe.ratio is not None:
            probe_ratio.add_metric(labels, obs.probe.ratio)
        ctl = snap.control.get(obs.gpu_uuid)
        if ctl is not None:
            duty.add_metric(labels, ctl.duty)
            share.add_metric(labels, ctl.offline_sm_pct / 100.0)
            prio.add_metric(labels, float(ctl.offline_mps_priority))
            throttles.add_metric(labels, float(ctl.throttle_events))
            restarts.add_metric(labels, float(ctl.mps_restarts))
            evictions.add_metric(labels, float(ctl.evictions))
            if ctl.step_s is not None:
                _histogram(step, labels, ctl.step_s)
    yield from (up, fault, lost, duty, share, prio, probe, probe_ratio, throttles, restarts)
    yield evictions
    yield step


def _client_state_metrics(snap: NodeMetrics, hostname: str) -> GaugeMetricFamily:
    # Every live state of both classes on every GPU, zeros included: bounded (10 per GPU), and a
    # query for frozen clients finds a 0 rather than nothing when none is frozen.
    family = _gauge(
        "gpushare_clients",
        "Live clients on the GPU by class and state",
        [*_GPU_LABELS, "class", "state"],
    )
    live = [st for st in ClientState if st.is_live]
    for obs in snap.observations:
        counts: dict[tuple[ClientClass, ClientState], int] = {}
        for c in obs.clients:
            if c.state.is_live:
                counts[(c.cls, c.state)] = counts.get((c.cls, c.state), 0) + 1
        for cls in ClientClass:
            for state in live:
                labels = [*_gpu_labels(obs, hostname), cls.value, state.value]
                family.add_metric(labels, float(counts.get((cls, state), 0)))
    return family


def _client_metrics(snap: NodeMetrics, hostname: str) -> Iterator[_Family]:
    sm = _gauge("gpushare_client_sm_limit_ratio", "The client's MPS SM share", _CLIENT_LABELS)
    mem_limit = _gauge(
        "gpushare_client_pinned_memory_limit_bytes", "The client's MPS memory cap", _CLIENT_LABELS
    )
    mem_used = _gauge(
        "gpushare_client_memory_used_bytes",
        "GPU memory NVML attributes to the client",
        _CLIENT_LABELS,
    )
    p99 = _gauge(
        "gpushare_client_latency_p99_seconds",
        "App-reported p99 of an online client over the latency window",
        _CLIENT_LABELS,
    )
    slo = _gauge("gpushare_client_slo_p99_seconds", "Declared p99 SLO of a client", _CLIENT_LABELS)
    frozen = _gauge(
        "gpushare_client_held_frozen",
        "1 while the controller holds the client frozen",
        _CLIENT_LABELS,
    )
    thawed = CounterMetricFamily(
        "gpushare_client_thawed_seconds",
        "Time an offline client was thawed (allowed to run)",
        labels=_CLIENT_LABELS,
    )
    thawed_ratio = _gauge(
        "gpushare_client_thawed_ratio",
        "Fraction of the last minute an offline client was thawed",
        _CLIENT_LABELS,
    )
    restarts = CounterMetricFamily(
        "gpushare_client_restarts",
        "Relaunches of the client (share changes, requeues)",
        labels=_CLIENT_LABELS,
    )
    evictions = CounterMetricFamily(
        "gpushare_client_evictions",
        "Evictions of the client since the daemon started",
        labels=_CLIENT_LABELS,
    )
    for obs in snap.observations:
        for c in obs.clients:
            if not c.state.is_live:
                continue
            stats = snap.clients.get(c.client_id, _NO_STATS)
            labels = [
                *_gpu_labels(obs, hostname),
                c.client_id,
                stats.name or "",
                c.cls.value,
                snap.user_names.get(c.uid, str(c.uid)),
            ]
            sm.add_metric(labels, c.limits.sm_pct / 100.0)
            frozen.add_metric(labels, 1.0 if c.held else 0.0)
            if c.limits.pinned_mem_bytes is not None:
                mem_limit.add_metric(labels, float(c.limits.pinned_mem_bytes))
            if c.mem_used_bytes is not None:
                mem_used.add_metric(labels, float(c.mem_used_bytes))
            if c.cls is ClientClass.ONLINE and c.p99_ms is not None:
                p99.add_metric(labels, c.p99_ms / 1000.0)
            if c.slo_p99_ms is not None:
                slo.add_metric(labels, c.slo_p99_ms / 1000.0)
            if c.cls is ClientClass.OFFLINE:
                if stats.thawed_s is not None:
                    thawed.add_metric(labels, stats.thawed_s)
                if stats.thawed_ratio is not None:
                    thawed_ratio.add_metric(labels, stats.thawed_ratio)
            if c.client_id in snap.clients:
                restarts.add_metric(labels, float(stats.restarts))
                evictions.add_metric(labels, float(stats.evictions))
    yield from (sm, mem_limit, mem_used, p99, slo, frozen, thawed, thawed_ratio, restarts)
    yield evictions
    yield from _token_metrics(snap, hostname)
    yield _client_state_metrics(snap, hostname)


def _token_metrics(snap: NodeMetrics, hostname: str) -> Iterator[_Family]:
    """An LLM server's TTFT and TPOT p99s and the SLOs they are held to (docs/metrics.md)."""
    families = {
        name: _gauge(name, text, _CLIENT_LABELS)
        for name, text in (
            ("gpushare_client_ttft_p99_seconds", "p99 time to first token of an LLM server"),
            ("gpushare_client_slo_ttft_p99_seconds", "Declared p99 time-to-first-token SLO"),
            ("gpushare_client_tpot_p99_seconds", "p99 time per output token of an LLM server"),
            ("gpushare_client_slo_tpot_p99_seconds", "Declared p99 time-per-output-token SLO"),
        )
    }
    for obs in snap.observations:
        for c in obs.clients:
            if not c.state.is_live or c.cls is not ClientClass.ONLINE:
                continue
            values = {
                "gpushare_client_ttft_p99_seconds": c.ttft_p99_ms,
                "gpushare_client_slo_ttft_p99_seconds": c.slo_ttft_p99_ms,
                "gpushare_client_tpot_p99_seconds": c.tpot_p99_ms,
                "gpushare_client_slo_tpot_p99_seconds": c.slo_tpot_p99_ms,
            }
            if all(v is None for v in values.values()):
                continue
            stats = snap.clients.get(c.client_id, _NO_STATS)
            labels = [
                *_gpu_labels(obs, hostname),
                c.client_id,
                stats.name or "",
                c.cls.value,
                snap.user_names.get(c.uid, str(c.uid)),
            ]
            for name, ms in values.items():
                if ms is not None:
                    families[name].add_metric(labels, ms / 1000.0)
    yield from families.values()


_NO_STATS = ClientStats()


def _admission_metrics(adm: AdmissionStats) -> Iterator[_Family]:
    queued = GaugeMetricFamily(
        "gpushare_admission_queue_length", "Offline jobs waiting for admission"
    )
    queued.add_metric([], float(adm.queued))
    oldest = GaugeMetricFamily(
        "gpushare_admission_queue_oldest_wait_seconds",
        "How long the longest-waiting queued job has waited (absent: queue empty)",
    )
    if adm.oldest_wait_s is not None:
        oldest.add_metric([], adm.oldest_wait_s)
    wait = HistogramMetricFamily(
        "gpushare_admission_wait_seconds", "Time admitted jobs waited in the queue"
    )
    if adm.wait_s is not None:
        _histogram(wait, [], adm.wait_s)
    yield from (queued, oldest, wait)


def _event_metrics(snap: NodeMetrics) -> CounterMetricFamily:
    # Event kinds are fixed strings of the daemon's code, so the label set stays bounded; the
    # dashboard turns increases into annotations (the event text is in `gpushare events`).
    events = CounterMetricFamily(
        "gpushare_events",
        "Entries of the daemon's event log (gpushare events) by kind and severity",
        labels=["gpu", "UUID", "kind", "severity"],
    )
    index = {obs.gpu_uuid: str(obs.gpu_index) for obs in snap.observations}
    for (kind, severity, uuid), n in sorted(snap.events.items()):
        events.add_metric([index.get(uuid, ""), uuid, kind, severity], float(n))
    return events


def _trust_metrics() -> CounterMetricFamily:
    # Read from the process's checker, not the tick's snapshot: a refusal happens at a launch or
    # an MPS command, between ticks. The roles are fixed strings of the daemon's code.
    refused = CounterMetricFamily(
        "gpushare_untrusted_file_refusals",
        "Uses of a file refused because a user other than root could change it (gpushare.trust)",
        labels=["file"],
    )
    for role, n in sorted(trust.refusals().items()):
        refused.add_metric([role], float(n))
    return refused
