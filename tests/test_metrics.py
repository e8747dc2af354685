"""The Prometheus exporter over a real HTTP server on loopback."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpushare.metrics import Exporter, GpuControl, NodeMetrics
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    GpuSample,
    Limits,
    MpsState,
    Observation,
    ProbeReading,
)

PROBE = ProbeReading(latency_ms=2.5, baseline_ms=2.0, ratio=1.25)


def _obs(clients, *, probe=PROBE, state=MpsState.UP):
    return Observation(
        gpu_uuid="GPU-aaaa",
        gpu_index=0,
        sample=GpuSample(index=0, uuid="GPU-aaaa"),
        probe=probe,
        clients=tuple(clients),
        mps_state=state,
    )


def _client(cid, cls, *, state=ClientState.RUNNING, p99=None, held=False):
    return ClientView(
        client_id=cid,
        cls=cls,
        state=state,
        limits=Limits(sm_pct=40.0, pinned_mem_bytes=8 << 30, priority=cls.mps_priority),
        uid=1000,
        mem_used_bytes=3 << 30,
        slo_p99_ms=40.0 if cls is ClientClass.ONLINE else None,
        p99_ms=p99,
        held=held,
    )


@pytest.fixture
def exporter():
    exp = Exporter()
    yield exp
    exp.close()


def _scrape(exporter) -> dict[tuple[str, tuple], float]:
    host, port = exporter.serve("127.0.0.1:0")
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gpu_and_client_series(exporter):
    exporter.update(
        NodeMetrics(
            observations=[
                _obs(
                    [
                        _client("on1", ClientClass.ONLINE, p99=31.0),
                        _client("off1", ClientClass.OFFLINE, held=True),
                        _client("gone", ClientClass.OFFLINE, state=ClientState.EXITED),
                    ]
                )
            ],
            control={"GPU-aaaa": GpuControl(duty=0.35, offline_sm_pct=50.0, throttle_events=4)},
            user_names={1000: "alice"},
        )
    )
    m = _scrape(exporter)
    gpu = (("UUID", "GPU-aaaa"), ("gpu", "0"))
    assert m[("gpushare_offline_duty_ratio", gpu)] == 0.35
    assert m[("gpushare_offline_sm_limit_ratio", gpu)] == 0.5
    assert m[("gpushare_probe_latency_p99_seconds", gpu)] == 0.0025
    assert m[("gpushare_throttle_events_total", gpu)] == 4
    assert m[("gpushare_mps_daemon_up", gpu)] == 1
    on = (
        ("UUID", "GPU-aaaa"),
        ("class", "online"),
        ("client", "on1"),
        ("gpu", "0"),
        ("uid", "alice"),
    )
    assert m[("gpushare_client_latency_p99_seconds", on)] == 0.031
    assert m[("gpushare_client_slo_p99_seconds", on)] == 0.04
    assert m[("gpushare_client_pinned_memory_limit_bytes", on)] == 8 << 30
    off = (
        ("UUID", "GPU-aaaa"),
        ("class", "offline"),
        ("client", "off1"),
        ("gpu", "0"),
        ("uid", "alice"),
    )
    assert m[("gpushare_client_held_frozen", off)] == 1
    assert not any(dict(labels).get("client") == "gone" for _, labels in m)


def test_missing_readings_are_absent_not_zero(exporter):
    exporter.update(
        NodeMetrics(
            observations=[
                _obs([], probe=ProbeReading(reason="unavailable: no driver"), state=MpsState.DOWN)
            ]
        )
    )
    m = _scrape(exporter)
    assert not any(name == "gpushare_probe_latency_p99_seconds" for name, _ in m)
    assert m[("gpushare_mps_daemon_up", (("UUID", "GPU-aaaa"), ("gpu", "0")))] == 0


def test_snapshot_replacement_drops_departed_clients(exporter):
    exporter.update(NodeMetrics(observations=[_obs([_client("a", ClientClass.OFFLINE)])]))
    first = list(exporter.collect())
    exporter.update(NodeMetrics(observations=[_obs([])]))
    second = list(exporter.collect())
    assert _client_series(first) == 1
    assert _client_series(second) == 0


def _client_series(families) -> int:
    return sum(len(f.samples) for f in families if f.name == "gpushare_client_sm_limit_ratio")


def test_bind_failure_raises(exporter):
    with pytest.raises(OSError, match="assign"):
        exporter.serve("203.0.113.1:1")  # TEST-NET address: not local, cannot be bound
