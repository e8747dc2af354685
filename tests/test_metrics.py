"""The Prometheus exporter over a real HTTP server on loopback."""

import socket
import threading
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpushare.metrics import (
    AdmissionStats,
    ClientStats,
    DurationHistogram,
    Exporter,
    GpuControl,
    NodeMetrics,
)
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
HOST = (("Hostname", "node-a"), ("modelName", "NVIDIA H200"))
GPU = (("UUID", "GPU-aaaa"), ("gpu", "0"), *HOST)


def _labels(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Labels as _scrape keys them: sorted by name."""
    return tuple(sorted(pairs))


def _obs(clients, *, probe=PROBE, state=MpsState.UP, uuid="GPU-aaaa"):
    return Observation(
        gpu_uuid=uuid,
        gpu_index=0,
        sample=GpuSample(index=0, uuid=uuid, name="NVIDIA H200"),
        probe=probe,
        clients=tuple(clients),
        mps_state=state,
    )


def _client(cid, cls, *, state=ClientState.RUNNING, p99=None, held=False, uid=1000):
    return ClientView(
        client_id=cid,
        cls=cls,
        state=state,
        limits=Limits(sm_pct=40.0, pinned_mem_bytes=8 << 30, priority=cls.mps_priority),
        uid=uid,
        mem_used_bytes=3 << 30,
        slo_p99_ms=40.0 if cls is ClientClass.ONLINE else None,
        p99_ms=p99,
        held=held,
    )


@pytest.fixture
def exporter():
    exp = Exporter(hostname="node-a")
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
            control={
                "GPU-aaaa": GpuControl(
                    duty=0.35, offline_sm_pct=50.0, offline_mps_priority=0, throttle_events=4
                )
            },
            user_names={1000: "alice"},
        )
    )
    m = _scrape(exporter)
    gpu = _labels(*GPU)
    assert m[("gpushare_evictions_total", gpu)] == 0
    assert m[("gpushare_offline_duty_ratio", gpu)] == 0.35
    assert m[("gpushare_offline_sm_limit_ratio", gpu)] == 0.5
    assert m[("gpushare_offline_mps_priority", gpu)] == 0
    assert m[("gpushare_probe_latency_p99_seconds", gpu)] == 0.0025
    assert m[("gpushare_throttle_events_total", gpu)] == 4
    assert m[("gpushare_mps_daemon_up", gpu)] == 1
    on = _labels(
        *GPU,
        ("class", "online"),
        ("client", "on1"),
        ("name", ""),
        ("user", "alice"),
    )
    assert m[("gpushare_client_latency_p99_seconds", on)] == 0.031
    assert m[("gpushare_client_slo_p99_seconds", on)] == 0.04
    assert m[("gpushare_client_pinned_memory_limit_bytes", on)] == 8 << 30
    off = _labels(
        *GPU,
        ("class", "offline"),
        ("client", "off1"),
        ("name", ""),
        ("user", "alice"),
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
    assert m[("gpushare_mps_daemon_up", _labels(*GPU))] == 0


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


def _full_snapshot(*, name="train", user="alice", uuid="GPU-aaaa"):
    """A snapshot that fills every family: the controller, the queue and both client classes."""
    step = DurationHistogram([0.001, 0.01])
    for v in (0.0004, 0.002, 0.5):
        step.observe(v)
    wait = DurationHistogram([1.0, 60.0])
    wait.observe(30.0)
    return NodeMetrics(
        observations=[
            _obs(
                [
                    _client("on1", ClientClass.ONLINE, p99=31.0),
                    _client("off1", ClientClass.OFFLINE),
                ],
                uuid=uuid,
            )
        ],
        control={
            uuid: GpuControl(duty=0.5, offline_sm_pct=50.0, evictions=2, step_s=step.snapshot())
        },
        user_names={1000: user},
        clients={
            "on1": ClientStats(name="web"),
            "off1": ClientStats(
                name=name, thawed_s=42.5, thawed_ratio=0.25, restarts=3, evictions=1
            ),
        },
        admission=AdmissionStats(queued=4, oldest_wait_s=12.0, wait_s=wait.snapshot()),
    )


def test_controller_queue_and_offline_progress_series(exporter):
    exporter.update(_full_snapshot())
    m = _scrape(exporter)
    gpu = _labels(*GPU)
    assert m[("gpushare_evictions_total", gpu)] == 2
    assert m[("gpushare_controller_step_seconds_bucket", _labels(*GPU, ("le", "0.001")))] == 1
    assert m[("gpushare_controller_step_seconds_bucket", _labels(*GPU, ("le", "0.01")))] == 2
    assert m[("gpushare_controller_step_seconds_bucket", _labels(*GPU, ("le", "+Inf")))] == 3
    assert m[("gpushare_controller_step_seconds_count", gpu)] == 3
    assert m[("gpushare_controller_step_seconds_sum", gpu)] == pytest.approx(0.5024)
    assert m[("gpushare_admission_queue_length", ())] == 4
    assert m[("gpushare_admission_queue_oldest_wait_seconds", ())] == 12
    assert m[("gpushare_admission_wait_seconds_bucket", (("le", "1.0"),))] == 0
    assert m[("gpushare_admission_wait_seconds_bucket", (("le", "60.0"),))] == 1
    off = _labels(*GPU, ("class", "offline"), ("client", "off1"), ("name", "train"),
                  ("user", "alice"))  # fmt: skip
    assert m[("gpushare_client_thawed_seconds_total", off)] == 42.5
    assert m[("gpushare_client_thawed_ratio", off)] == 0.25
    assert m[("gpushare_client_restarts_total", off)] == 3
    assert m[("gpushare_client_evictions_total", off)] == 1
    on = _labels(*GPU, ("class", "online"), ("client", "on1"), ("name", "web"),
                 ("user", "alice"))  # fmt: skip
    assert m[("gpushare_client_latency_p99_seconds", on)] == 0.031
    # Thawed time is an offline notion: online clients are never duty-cycled.
    assert ("gpushare_client_thawed_seconds_total", on) not in m


def test_empty_queue_has_no_oldest_wait(exporter):
    exporter.update(NodeMetrics(admission=AdmissionStats(queued=0)))
    m = _scrape(exporter)
    assert m[("gpushare_admission_queue_length", ())] == 0
    assert not any(name == "gpushare_admission_queue_oldest_wait_seconds" for name, _ in m)


def test_ended_clients_leave_no_series_in_any_family(exporter):
    snap = _full_snapshot()
    exporter.update(snap)
    before = _client_ids(generate_latest(exporter.registry).decode())
    assert before == {"on1", "off1"}
    obs = snap.observations[0]
    ended = [
        _client(c.client_id, c.cls, state=ClientState.EXITED) if c.client_id == "off1" else c
        for c in obs.clients
    ]
    exporter.update(
        NodeMetrics(
            observations=[_obs(ended)],
            control=snap.control,
            user_names=snap.user_names,
            clients=snap.clients,  # stale stats must not resurrect the series
        )
    )
    assert _client_ids(generate_latest(exporter.registry).decode()) == {"on1"}


def _client_ids(text: str) -> set[str]:
    return {
        s.labels["client"]
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if "client" in s.labels
    }


HOSTILE = [
    'say "hi"',
    "back\\slash\\",
    "new\nline\n",
    "\\n literal",
    'brace} {x="1"} 5\n# TYPE evil gauge',
    "ünïcödé 名前 🚀",
    "",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_label_values_round_trip(value):
    exp = Exporter()
    exp.update(_full_snapshot(name=value, user=value, uuid="GPU-" + value))
    text = generate_latest(exp.registry).decode()
    families = list(text_string_to_metric_families(text))
    off = [
        s
        for fam in families
        for s in fam.samples
        if s.labels.get("client") == "off1" and s.name == "gpushare_client_thawed_ratio"
    ]
    assert len(off) == 1
    assert off[0].labels["name"] == value
    assert off[0].labels["user"] == value
    assert off[0].labels["UUID"] == "GPU-" + value
    # Nothing was injected: the same families and series as with tame values.
    tame = generate_latest(_registry(_full_snapshot())).decode()
    assert _shape(families) == _shape(text_string_to_metric_families(tame))


def _registry(snap):
    exp = Exporter()
    exp.update(snap)
    return exp.registry


def _shape(families):
    return sorted((f.name, f.type, len(f.samples)) for f in families)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40))
def test_any_name_or_user_round_trips(name, user):
    exp = Exporter()
    exp.update(_full_snapshot(name=name, user=user))
    text = generate_latest(exp.registry).decode()
    labels = [
        s.labels
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.labels.get("client") == "off1"
    ]
    assert labels
    assert all(lab["name"] == name and lab["user"] == user for lab in labels)


def test_event_counts_by_kind_and_gpu(exporter):
    snap = _full_snapshot()
    exporter.update(
        NodeMetrics(
            observations=snap.observations,
            events={
                ("offline_throttled", "info", "GPU-aaaa"): 3,
                ("daemon_started", "info", ""): 1,
            },
        )
    )
    m = _scrape(exporter)
    gpu = (("UUID", "GPU-aaaa"), ("gpu", "0"))
    assert (
        m[("gpushare_events_total", (*gpu, ("kind", "offline_throttled"), ("severity", "info")))]
        == 3
    )
    node = (("UUID", ""), ("gpu", ""), ("kind", "daemon_started"), ("severity", "info"))
    assert m[("gpushare_events_total", node)] == 1


def _get(host: str, port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_healthz_follows_the_control_loop_and_other_paths_are_404():
    now = [100.0]
    exp = Exporter(hostname="node-a", clock=lambda: now[0])
    try:
        host, port = exp.serve("127.0.0.1:0", tick_period_s=0.1)
        assert exp.stall_after_s == 5.0  # 50 ticks of 100 ms, but never under 5 s
        code, body = _get(host, port, "/healthz")
        assert (code, body) == (503, "stalled: the control loop has not ticked yet\n")
        exp.update(NodeMetrics())
        now[0] += 4.0
        assert _get(host, port, "/healthz")[0] == 200
        now[0] += 2.0  # 6 s without a tick
        assert _get(host, port, "/healthz") == (503, "stalled: no control-loop tick for 6.0 s\n")
        exp.update(NodeMetrics())
        assert _get(host, port, "/healthz")[0] == 200
        for path in ("/", "/metricsx", "/metrics/x", "/favicon.ico", "/healthz/x"):
            code, body = _get(host, port, path)
            assert code == 404 and "gpushare_" not in body, path
        code, body = _get(host, port, "/metrics?x=1")
        assert code == 200 and "gpushare_build_info" in body
    finally:
        exp.close()


def test_build_info_client_states_and_the_process_collector(exporter, monkeypatch):
    exporter.update(
        NodeMetrics(
            observations=[
                _obs(
                    [
                        _client("on1", ClientClass.ONLINE),
                        _client("off1", ClientClass.OFFLINE, state=ClientState.FROZEN),
                        _client("off2", ClientClass.OFFLINE, state=ClientState.FROZEN),
                        _client("gone", ClientClass.OFFLINE, state=ClientState.EXITED),
                    ]
                )
            ]
        )
    )
    m = _scrape(exporter)
    from gpushare import __version__

    build = [labels for name, labels in m if name == "gpushare_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0]
    states = {
        (dict(labels)["class"], dict(labels)["state"]): v
        for (name, labels), v in m.items()
        if name == "gpushare_clients"
    }
    assert states[("offline", "frozen")] == 2
    assert states[("online", "running")] == 1
    assert states[("offline", "running")] == 0  # zeros are series: a query finds 0, not nothing
    assert len(states) == 10 and ("offline", "exited") not in states
    assert m[("gpushare_clients", _labels(*GPU, ("class", "online"), ("state", "frozen")))] == 0
    assert m[("process_resident_memory_bytes", ())] > 0
    assert ("process_cpu_seconds_total", ()) in m
    # Hostname is chosen as dcgm-exporter chooses it.
    monkeypatch.setenv("NODE_NAME", "k8s-node-7")
    assert Exporter().hostname == "k8s-node-7"
    monkeypatch.delenv("NODE_NAME")
    assert Exporter().hostname == socket.gethostname()


def test_a_connection_that_sends_nothing_is_dropped(monkeypatch):
    """Any local user can connect; an idle connection must not hold a server thread forever."""
    import gpushare.metrics as metrics

    monkeypatch.setattr(metrics, "HTTP_TIMEOUT_S", 0.5)
    exp = Exporter(hostname="node-a")
    try:
        host, port = exp.serve("127.0.0.1:0")
        with socket.create_connection((host, port), timeout=10) as idle:
            idle.settimeout(10)
            assert idle.recv(1) == b""  # closed by the server after 0.5 s, not by our timeout
        assert _get(host, port, "/metrics")[0] == 200
    finally:
        exp.close()


@pytest.mark.parametrize("listen", ["::1:0", "[::1]:0"])
def test_an_ipv6_listen_address(listen):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    exp = Exporter(hostname="node-a")
    try:
        try:
            host, port = exp.serve(listen)
        except OSError as exc:
            pytest.skip(f"::1 cannot be bound here: {exc}")
        assert host == "::1"
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        exp.close()


class _CountingSource:
    """The reporter's part for the exporter: counts the builds, each slow enough to overlap."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls = 0
        self.delay_s = delay_s

    def __call__(self) -> NodeMetrics:
        self.calls += 1
        threading.Event().wait(self.delay_s)  # widens the window concurrent scrapes arrive in
        return NodeMetrics(observations=[_obs([_client(f"c{self.calls}", ClientClass.OFFLINE)])])


def _flood(host: str, port: int, n: int) -> list[str]:
    """``n`` scrapes at once, each on its own connection and thread; their bodies."""
    bodies: list[str] = [""] * n

    def one(i: int) -> None:
        bodies[i] = _get(host, port, "/metrics")[1]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return bodies


def test_concurrent_scrapes_within_one_tick_build_the_snapshot_once():
    source = _CountingSource(delay_s=0.2)
    exp = Exporter(hostname="node-a")
    exp.attach(source)
    try:
        host, port = exp.serve("127.0.0.1:0")
        exp.ticked()
        bodies = _flood(host, port, 12)
        assert source.calls == exp.builds == 1
        # Every scrape rendered that one build (its only client is c1).
        assert all('client="c1"' in b and 'client="c2"' not in b for b in bodies)
    finally:
        exp.close()


def test_a_scrape_flood_builds_at_most_once_per_tick_and_per_tick_period():
    """docs/security.md: any local user can scrape; a flood buys no more builds than the ticks."""
    now = [100.0]
    source = _CountingSource()
    exp = Exporter(hostname="node-a", clock=lambda: now[0])
    exp.attach(source)
    try:
        # Times exact in binary: the period's comparison is not at the mercy of rounding.
        host, port = exp.serve("127.0.0.1:0", tick_period_s=0.25)
        _flood(host, port, 8)
        assert source.calls == 0  # no tick yet: nothing to build, the empty snapshot is served
        exp.ticked()
        _flood(host, port, 8)
        assert source.calls == 1
        now[0] += 1.0
        _flood(host, port, 8)
        assert source.calls == 1  # time passed but no tick completed: the same snapshot
        exp.ticked()
        exp.ticked()
        now[0] += 0.5
        _flood(host, port, 8)
        assert source.calls == 2  # two ticks since: one build
        exp.ticked()
        now[0] += 0.125
        _flood(host, port, 8)
        assert source.calls == 2  # a tick, but less than a period since the last build
        now[0] += 0.125
        _flood(host, port, 8)
        assert source.calls == 3
    finally:
        exp.close()
