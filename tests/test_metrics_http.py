"""The exporter's HTTP server over a real loopback listener: renders once per snapshot, bounded.

docs/security.md: any local user can scrape, so a flood of scrapes must not re-render the
exposition (the GIL the control loop needs) nor spawn a thread per connection without bound.
Renders are counted where the snapshot's families are made (``metrics._client_metrics``), so
these tests count the same thing on code that renders on every scrape.
"""

import os
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

import gpushare.metrics as metrics
import gpushare.metrics_http as metrics_http
from bench.support.daemon_helpers import python_for_others
from gpushare.metrics import Exporter, NodeMetrics
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

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _snapshot(client_id: str) -> NodeMetrics:
    client = ClientView(
        client_id=client_id,
        cls=ClientClass.OFFLINE,
        state=ClientState.RUNNING,
        limits=Limits(sm_pct=40.0, pinned_mem_bytes=8 << 30, priority=1),
        uid=1000,
    )
    sample = GpuSample(index=0, uuid="GPU-aaaa", name="NVIDIA H200")
    obs = Observation(
        gpu_uuid="GPU-aaaa",
        gpu_index=0,
        sample=sample,
        probe=ProbeReading(latency_ms=2.5, baseline_ms=2.0, ratio=1.25),
        clients=(client,),
        mps_state=MpsState.UP,
    )
    return NodeMetrics(observations=[obs])


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts renders of a snapshot's client families: one a render, on old code and new."""
    count = [0]
    real = metrics._client_metrics

    def counted(snap: NodeMetrics, hostname: str) -> Iterator[object]:
        count[0] += 1
        return real(snap, hostname)

    monkeypatch.setattr(metrics, "_client_metrics", counted)
    return count


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    exp = Exporter(hostname="node-a")
    yield exp
    exp.close()


def _get(host: str, port: int, accept: str = "") -> tuple[int, str, str]:
    """A scrape of /metrics: status, Content-Type, body."""
    request = urllib.request.Request(f"http://{host}:{port}/metrics", headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_concurrent_scrapes_of_one_snapshot_render_it_once(exporter, renders):
    exporter.update(_snapshot("c1"))
    host, port = exporter.serve("127.0.0.1:0")
    results: list[tuple[int, str, str]] = []
    threads = [threading.Thread(target=lambda: results.append(_get(host, port))) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 12 and {r[0] for r in results} == {200}
    assert renders[0] == 1 and exporter.render_cache.renders == 1
    for _, _, body in results:
        names = {f.name for f in text_string_to_metric_families(body)}
        # The cached snapshot part and the per-scrape part, each once.
        assert {"gpushare_client_sm_limit_ratio", "gpushare_build_info"} <= names
        assert "process_cpu_seconds" in names and 'client="c1"' in body


def test_a_flood_of_sequential_scrapes_within_one_tick_renders_once_per_format(renders):
    now = [100.0]
    source_calls = [0]

    def source() -> NodeMetrics:
        source_calls[0] += 1
        return _snapshot(f"c{source_calls[0]}")

    exp = Exporter(hostname="node-a", clock=lambda: now[0])
    exp.attach(source)
    try:
        host, port = exp.serve("127.0.0.1:0", tick_period_s=0.25)
        exp.ticked()
        texts = [_get(host, port) for _ in range(20)]
        assert renders[0] == 1 and source_calls[0] == 1
        assert all(t[0] == 200 and 'client="c1"' in t[2] for t in texts)
        assert texts[0][1] == "text/plain; version=0.0.4; charset=utf-8"
        # OpenMetrics is its own rendering, cached as well, and ends with one "# EOF".
        oms = [_get(host, port, OPENMETRICS) for _ in range(5)]
        assert renders[0] == 2
        for code, content_type, body in oms:
            assert code == 200 and content_type.startswith("application/openmetrics-text")
            assert body.endswith("# EOF\n") and body.count("# EOF") == 1
            assert "gpushare_build_info" in {f.name for f in om_families(body)}
        # Another spelling of the same format, a different version tag: no further render.
        assert _get(host, port, "application/openmetrics-text; version=1.0.1")[0] == 200
        assert renders[0] == 2
        # The next tick's snapshot, a period later, is rendered once again.
        exp.ticked()
        now[0] += 0.25
        after = [_get(host, port) for _ in range(10)]
        assert renders[0] == 3 and all('client="c2"' in t[2] for t in after)
    finally:
        exp.close()


def test_connections_beyond_the_bound_are_answered_503_at_once(exporter, monkeypatch):
    """A flood of connections spawns no more than MAX_CONNECTIONS server threads."""
    monkeypatch.setattr(metrics, "HTTP_TIMEOUT_S", 60.0)  # the held ones stay held throughout
    exporter.update(_snapshot("c1"))
    host, port = exporter.serve("127.0.0.1:0")
    held = [socket.create_connection((host, port), timeout=10) for _ in range(16)]
    try:
        # Accepted in order: the 16 hold every slot, so this one gets no thread.
        with socket.create_connection((host, port), timeout=10) as extra:
            reply = b"".join(iter(lambda: extra.recv(4096), b""))
        assert reply.startswith(b"HTTP/1.0 503 ") and b"too many connections" in reply
        # A client that sends its request first is refused the same way, with one clear line.
        code, _, body = _get(host, port)
        assert (
            code == 503
            and body == "busy: too many connections to the metrics endpoint, try again\n"
        )
        # The held connections were not dropped to make room: each is served when it asks.
        held[0].sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b"".join(iter(lambda: held[0].recv(65536), b""))
        assert answer.startswith(b"HTTP/1.0 200 ") and b'client="c1"' in answer
    finally:
        for s in held:
            s.close()
    # Closed connections free their slots (their threads end when they see the close).
    for _ in range(200):
        if _get(host, port)[0] == 200:
            break
        threading.Event().wait(0.05)
    else:
        pytest.fail("the slots of closed connections were never freed")


def test_a_server_bound_to_two_serves_two(monkeypatch):
    """The bound is the module's constant, read when the server starts."""
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(metrics, "HTTP_TIMEOUT_S", 60.0)
    exp = Exporter(hostname="node-a")
    try:
        host, port = exp.serve("127.0.0.1:0")
        held = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        try:
            assert _get(host, port)[0] == 503
        finally:
            for s in held:
                s.close()
    finally:
        exp.close()


def test_a_costly_render_spaces_the_next_build_by_twenty_times_its_cost(monkeypatch):
    """A tick every period and a scrape flood must not buy a render every period."""
    now = [100.0]
    real = metrics._client_metrics

    def slow(snap: NodeMetrics, hostname: str) -> Iterator[object]:
        now[0] += 0.5  # this render takes half a second of the exporter's clock
        return real(snap, hostname)

    monkeypatch.setattr(metrics, "_client_metrics", slow)
    builds = [0]

    def source() -> NodeMetrics:
        builds[0] += 1
        return _snapshot(f"c{builds[0]}")

    exp = Exporter(hostname="node-a", clock=lambda: now[0])
    exp.attach(source)
    try:
        host, port = exp.serve("127.0.0.1:0", tick_period_s=0.25)
        exp.ticked()
        assert 'client="c1"' in _get(host, port)[2] and builds == [1]
        # Built at 100.0, rendered by 100.5: the next build is due at 100 + 20 x 0.5 = 110.
        for _ in range(5):
            exp.ticked()
            now[0] += 1.0
            assert 'client="c1"' in _get(host, port)[2]
        assert builds == [1] and exp.render_cache.renders == 1
        now[0] = 110.0
        assert 'client="c2"' in _get(host, port)[2] and builds == [2]
    finally:
        exp.close()


def test_an_accept_header_with_a_bad_version_gets_one_line_400(exporter, capfd):
    """prometheus_client cannot compare ``version=abc``: one line, not a traceback on stderr."""
    exporter.update(_snapshot("c1"))
    host, port = exporter.serve("127.0.0.1:0")
    code, _, body = _get(host, port, "application/openmetrics-text; version=abc")
    assert code == 400 and body == "bad Accept header: its version is not a dotted number\n"
    assert "Traceback" not in capfd.readouterr().err
    assert _get(host, port, OPENMETRICS)[0] == 200


FLOOD = """
import sys, urllib.request
url = sys.argv[1]
codes = []
for _ in range(int(sys.argv[2])):
    with urllib.request.urlopen(url, timeout=10) as r:
        codes.append(r.status)
print(sum(c == 200 for c in codes))
"""


def test_a_flood_from_another_unprivileged_user_renders_once(renders):
    # The listener is on loopback: any local account can scrape. Here a real second uid (nobody)
    # floods it within one tick, and the daemon's process renders the snapshot once for all.
    python = python_for_others()
    if python is None or os.geteuid() != 0:
        pytest.skip("needs root and an interpreter another uid may execute")
    exp = Exporter(hostname="node-a", clock=lambda: 100.0)
    exp.attach(lambda: _snapshot("c1"))
    try:
        host, port = exp.serve("127.0.0.1:0", tick_period_s=0.25)
        exp.ticked()
        out = subprocess.run(
            [python, "-c", FLOOD, f"http://{host}:{port}/metrics", "30"],
            cwd="/", user=65534, group=65534, extra_groups=[],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        assert out.stdout.strip() == "30"
        assert renders[0] == 1
    finally:
        exp.close()
