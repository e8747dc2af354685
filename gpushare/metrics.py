"""The Prometheus exporter: what gpushare is doing to each GPU and client, for dashboards and alerts.

Names follow Prometheus style with units in the name (``_bytes``, ``_seconds``, ``_ratio``) and the
labels ``gpu``/``UUID`` exactly as dcgm-exporter spells them, so series join with DCGM's device
metrics. Device-level and client-level metrics are kept apart (dcgm-exporter#587: per-client series
repeating device values mislead). Every scrape renders the latest :class:`NodeMetrics` snapshot, so a
client that has gone away disappears from the output instead of lingering as a stale series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpushare.model import ClientClass, MpsState, Observation


@dataclass(frozen=True, slots=True)
class GpuControl:
    """Controller state of one GPU that the observation does not carry."""

    duty: float
    offline_sm_pct: float
    throttle_events: int = 0
    mps_restarts: int = 0


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    """One tick's worth of everything the exporter shows."""

    observations: Sequence[Observation] = ()
    control: Mapping[str, GpuControl] = field(default_factory=dict)
    user_names: Mapping[int, str] = field(default_factory=dict)


_GPU_LABELS = ["gpu", "UUID"]
_CLIENT_LABELS = ["gpu", "UUID", "client", "class", "uid"]


class Exporter(Collector):
    """A prometheus_client collector over the latest snapshot, plus its HTTP server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot = NodeMetrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: Any = None

    def update(self, snapshot: NodeMetrics) -> None:
        """Replace the snapshot the next scrape renders (called once per tick)."""
        with self._lock:
            self._snapshot = snapshot

    def serve(self, listen: str) -> tuple[str, int]:
        """Serve ``/metrics`` on ``HOST:PORT`` from a background thread; returns the bound address.

        Raises:
            OSError: the address cannot be bound (in use, or not a local address).
        """
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._server = server
        bound_host, bound_port = server.server_address[:2]
        return str(bound_host), int(bound_port)

    def close(self) -> None:
        """Stop the HTTP server, if one runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Render the latest snapshot (prometheus_client calls this on every scrape)."""
        with self._lock:
            snap = self._snapshot
        yield from _gpu_metrics(snap)
        yield from _client_metrics(snap)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _gpu_metrics(snap: NodeMetrics) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    up = _gauge(
        "gpushare_mps_daemon_up", "1 when the GPU's MPS control daemon answers", _GPU_LABELS
    )
    fault = _gauge("gpushare_mps_fault", "1 while the GPU's MPS server is in FAULT", _GPU_LABELS)
    duty = _gauge(
        "gpushare_offline_duty_ratio",
        "Fraction of each period offline clients may run",
        _GPU_LABELS,
    )
    share = _gauge(
        "gpushare_offline_sm_limit_ratio",
        "SM share new and restarted offline clients get",
        _GPU_LABELS,
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
    for obs in snap.observations:
        labels = [str(obs.gpu_index), obs.gpu_uuid]
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
            throttles.add_metric(labels, float(ctl.throttle_events))
            restarts.add_metric(labels, float(ctl.mps_restarts))
    yield from (up, fault, lost, duty, share, probe, probe_ratio, throttles, restarts)


def _client_metrics(snap: NodeMetrics) -> Iterator[GaugeMetricFamily]:
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
        "App-reported p99 of an online client",
        _CLIENT_LABELS,
    )
    slo = _gauge("gpushare_client_slo_p99_seconds", "Declared p99 SLO of a client", _CLIENT_LABELS)
    frozen = _gauge(
        "gpushare_client_held_frozen",
        "1 while the controller holds the client frozen",
        _CLIENT_LABELS,
    )
    for obs in snap.observations:
        for c in obs.clients:
            if not c.state.is_live:
                continue
            labels = [
                str(obs.gpu_index),
                obs.gpu_uuid,
                c.client_id,
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
    yield from (sm, mem_limit, mem_used, p99, slo, frozen)
