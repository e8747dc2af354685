"""App-reported latency: report_latency (service side), the datagram receiver, the p99 tracker and
the Prometheus histogram scraper (daemon side), over real Unix sockets and a real HTTP server."""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpushare import client, paths
from gpushare.latency.app import AppLatency
from gpushare.latency.datagrams import decode_latency
from gpushare.latency.p99 import LatencyP99, P99Tracker
from gpushare.latency.prometheus import (
    HistogramWindow,
    PrometheusScraper,
    parse_histogram,
    parse_latency_from,
)
from gpushare.latency.receiver import LatencyReceiver, Sender, verified_identify

REPO = Path(__file__).resolve().parent.parent


def wait_for(pred, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest.fixture
def sock_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "latency.sock"
    monkeypatch.setenv(paths.ENV_LATENCY_SOCKET, str(path))
    monkeypatch.setenv(paths.ENV_CLIENT_ID, "svc-1")
    return path


# ---------------------------------------------------------------------------- service side


def run_bounded(fn, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Run fn in a thread; a blocking call would never finish, so the bound only catches that."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "report_latency blocked"


def test_report_latency_with_the_daemon_down_never_blocks_or_raises(sock_path: Path) -> None:
    before = client.latency_reports_dropped()
    run_bounded(lambda: [client.report_latency(0.01) for _ in range(1000)])
    client.flush_latency()
    assert client.latency_reports_dropped() - before == 1000


def test_report_latency_to_a_dead_socket_file(sock_path: Path) -> None:
    # The daemon died without removing its socket: sendto gets ECONNREFUSED.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(str(sock_path))
    dead.close()
    before = client.latency_reports_dropped()
    run_bounded(lambda: (client.report_latency(0.01), client.flush_latency()))
    assert client.latency_reports_dropped() - before == 1


def test_report_latency_when_the_daemon_queue_is_full(sock_path: Path) -> None:
    # A daemon that is alive but not reading: the kernel queue fills and sends would block.
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stuck.bind(str(sock_path))
    try:
        before = client.latency_reports_dropped()
        # Flushing after every report: one datagram each, far beyond the kernel's queue.
        run_bounded(
            lambda: [(client.report_latency(0.01), client.flush_latency()) for _ in range(200)]
        )
        assert client.latency_reports_dropped() - before > 0
    finally:
        stuck.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "fast", None])
def test_report_latency_drops_bad_values_without_raising(sock_path: Path, bad: object) -> None:
    before = client.latency_reports_dropped()
    client.report_latency(bad)  # type: ignore[arg-type]
    assert client.latency_reports_dropped() - before == 1


def test_default_socket_path_is_the_daemon_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(paths.ENV_LATENCY_SOCKET, raising=False)
    assert client.latency_socket_path() == "/run/gpushare/latency.sock"


# ---------------------------------------------------------------------------- daemon side


@pytest.fixture
def receiver(sock_path: Path) -> Iterator[tuple[LatencyReceiver, list[Sender]]]:
    senders: list[Sender] = []

    def identify(s: Sender) -> str | None:
        senders.append(s)
        return s.claimed_id or None

    r = LatencyReceiver(sock_path, P99Tracker(window_s=30, min_samples=20), identify=identify)
    r.start()
    yield r, senders
    r.close()


def test_reports_reach_the_tracker_with_kernel_credentials(
    receiver: tuple[LatencyReceiver, list[Sender]], sock_path: Path
) -> None:
    r, senders = receiver
    for ms in range(1, 101):
        client.report_latency(ms / 1000)
    client.flush_latency()
    wait_for(lambda: r.accepted == 100)
    assert senders[0] == Sender(
        pid=os.getpid(), uid=os.getuid(), gid=os.getgid(), claimed_id="svc-1"
    )
    p = r.tracker.p99("svc-1", time.monotonic())
    assert p.samples == 100
    assert p.p99_ms == pytest.approx(99.0)
    assert oct(sock_path.stat().st_mode & 0o777) == "0o666"


def test_reports_from_another_process_carry_its_pid(
    receiver: tuple[LatencyReceiver, list[Sender]], sock_path: Path
) -> None:
    r, senders = receiver
    code = "from gpushare.client import report_latency\nfor _ in range(50): report_latency(0.002)"
    env = {**os.environ, paths.ENV_CLIENT_ID: "svc-child", "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=True)
    assert child.returncode == 0
    # The last batch is sent at interpreter exit (atexit flush).
    wait_for(lambda: r.accepted == 50)
    assert {s.claimed_id for s in senders} == {"svc-child"}
    assert all(s.pid not in (None, os.getpid()) for s in senders)
    assert r.tracker.p99("svc-child", time.monotonic()).p99_ms == pytest.approx(2.0)


def test_unattributed_and_garbage_datagrams_are_rejected(
    receiver: tuple[LatencyReceiver, list[Sender]], sock_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r, _ = receiver
    monkeypatch.setenv(paths.ENV_CLIENT_ID, "")
    client.report_latency(0.01)  # no client id and identify() only trusts ids
    client.flush_latency()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.sendto(b"not json", str(sock_path))
    raw.sendto(b'{"v": 2, "id": "x", "s": 1}', str(sock_path))
    raw.close()
    wait_for(lambda: r.rejected == 3)
    assert r.accepted == 0
    assert r.tracker.clients() == []


def test_verified_identify_trusts_the_kernel_over_the_message() -> None:
    ident = verified_identify(
        client_of_pid={4242: "web"}.get, uid_of_client={"web": 1000, "batch": 2000}.get
    )
    # The pid belongs to a client: that client, whatever the message claims.
    assert ident(Sender(pid=4242, uid=1000, gid=1000, claimed_id="batch")) == "web"
    # Unknown pid: the claim holds only for the client's own uid or root.
    assert ident(Sender(pid=7, uid=2000, gid=2000, claimed_id="batch")) == "batch"
    assert ident(Sender(pid=7, uid=0, gid=0, claimed_id="batch")) == "batch"
    assert ident(Sender(pid=7, uid=1000, gid=1000, claimed_id="batch")) is None
    assert ident(Sender(pid=7, uid=1000, gid=1000, claimed_id="nope")) is None
    assert ident(Sender(pid=7, uid=1000, gid=1000, claimed_id="")) is None
    assert ident(Sender(pid=None, uid=None, gid=None, claimed_id="web")) is None


def test_receiver_replaces_a_stale_socket_and_refuses_a_regular_file(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(stale))
    s.close()
    r = LatencyReceiver(stale, P99Tracker(30, 1))
    r.start()
    r.close()
    assert not stale.exists()
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(FileExistsError, match="not a socket"):
        LatencyReceiver(regular, P99Tracker(30, 1)).start()
    assert regular.read_text() == "x"


def test_decode_rejects_bad_reports() -> None:
    assert decode_latency(client.encode_latency("c", [0.25, 1])) == ("c", [0.25, 1.0])
    assert decode_latency(b'{"v":1,"id":"c","s":0.5}') == ("c", [0.5])
    for bad in (b"", b"[]", b'{"v":1,"id":"c","s":-1}', b'{"v":1,"id":3,"s":1}',
                b'{"v":1,"id":"c","s":true}', b'{"v":1,"id":"c","s":["1"]}',
                b'{"v":1,"id":"c","s":[1, NaN]}'):  # fmt: skip
        with pytest.raises(ValueError):  # noqa: PT011
            decode_latency(bad)


def test_tracker_window_and_min_samples() -> None:
    t = P99Tracker(window_s=10, min_samples=5)
    assert t.p99("c", 0) == LatencyP99(None, 0, "no latency reports")
    for i in range(4):
        t.add("c", 0.1, at_s=i)
    p = t.p99("c", 4)
    assert p.p99_ms is None
    assert p.reason == "only 4 reports in the last 10s (needs 5)"
    t.add("c", 0.5, at_s=4)
    assert t.p99("c", 4) == LatencyP99(500.0, 5)
    # At t=13.5 the reports at 0..3 have left the window.
    assert t.p99("c", 13.5).samples == 1
    t.forget("c")
    assert t.clients() == []


# ---------------------------------------------------------------------------- Prometheus

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# Exposition text as a Go service (client_golang) writes it, with unrelated metrics around.
GO_SERVICE_TEXT = """\
# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 42
# HELP http_request_duration_seconds Histogram of latencies for HTTP requests.
# TYPE http_request_duration_seconds histogram
http_request_duration_seconds_bucket{handler="/infer",method="post",le="0.005"} 0
http_request_duration_seconds_bucket{handler="/infer",method="post",le="0.01"} 12
http_request_duration_seconds_bucket{handler="/infer",method="post",le="0.025"} 80
http_request_duration_seconds_bucket{handler="/infer",method="post",le="0.05"} 95
http_request_duration_seconds_bucket{handler="/infer",method="post",le="+Inf"} 100
http_request_duration_seconds_sum{handler="/infer",method="post"} 1.9
http_request_duration_seconds_count{handler="/infer",method="post"} 100
http_request_duration_seconds_bucket{handler="/health",method="get",le="0.005"} 50
http_request_duration_seconds_bucket{handler="/health",method="get",le="0.01"} 50
http_request_duration_seconds_bucket{handler="/health",method="get",le="0.025"} 50
http_request_duration_seconds_bucket{handler="/health",method="get",le="0.05"} 50
http_request_duration_seconds_bucket{handler="/health",method="get",le="+Inf"} 50
http_request_duration_seconds_sum{handler="/health",method="get"} 0.1
http_request_duration_seconds_count{handler="/health",method="get"} 50
"""


def test_parse_latency_from_accepts_local_http_only() -> None:
    s = parse_latency_from("prometheus:http://127.0.0.1:8000/metrics#req_latency_seconds")
    assert (s.host, s.port, s.path, s.metric) == (
        "127.0.0.1",
        8000,
        "/metrics",
        "req_latency_seconds",
    )
    assert parse_latency_from("prometheus:http://localhost:9/#m_bucket").metric == "m"
    assert parse_latency_from("prometheus:http://[::1]:9/x?y=1#m").path == "/x?y=1"
    cases = {
        "http://127.0.0.1:8000/metrics#m": "must start with 'prometheus:'",
        "prometheus:http://127.0.0.1:8000/metrics": "needs the histogram name",
        "prometheus:http://10.0.0.5:8000/metrics#m": "must be on this host",
        "prometheus:https://127.0.0.1:8000/metrics#m": "only plain http",
        "prometheus:http://127.0.0.1:8000/metrics#1bad": "not a Prometheus metric name",
        "prometheus:http://127.0.0.1:99999/metrics#m": "bad port",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_latency_from(spec)


def test_parse_histogram_sums_label_sets_of_real_text() -> None:
    buckets, total = parse_histogram(GO_SERVICE_TEXT, "http_request_duration_seconds")
    assert buckets == {0.005: 50, 0.01: 62, 0.025: 130, 0.05: 145, math.inf: 150}
    assert total == 150
    assert parse_histogram(GO_SERVICE_TEXT, "absent") == ({}, None)


def test_parse_histogram_of_prometheus_client_output() -> None:
    reg = CollectorRegistry()
    h = Histogram("req_latency_seconds", "latency", ["route"], registry=reg, buckets=BUCKETS)
    h.labels("a").observe(0.02)
    h.labels("b").observe(0.4)
    buckets, total = parse_histogram(generate_latest(reg).decode(), "req_latency_seconds")
    assert total == 2
    assert buckets[0.025] == 1
    assert buckets[0.5] == 2
    assert buckets[math.inf] == 2


def test_window_p99_from_bucket_deltas_of_a_real_histogram() -> None:
    reg = CollectorRegistry()
    h = Histogram("req_latency_seconds", "latency", registry=reg, buckets=BUCKETS)
    w = HistogramWindow(window_s=30, min_samples=20)
    for _ in range(5000):  # old traffic, before the window: must not count
        h.observe(0.9)
    w.add(0.0, *parse_histogram(generate_latest(reg).decode(), "req_latency_seconds"))
    for _ in range(980):
        h.observe(0.02)
    for _ in range(20):
        h.observe(0.4)
    w.add(10.0, *parse_histogram(generate_latest(reg).decode(), "req_latency_seconds"))
    p = w.p99(10.0)
    assert p.samples == 1000
    assert p.p99_ms == pytest.approx(375.0)


def test_window_handles_counter_resets() -> None:
    w = HistogramWindow(window_s=60, min_samples=1)
    w.add(0, {0.1: 100, math.inf: 100})
    w.add(5, {0.1: 150, math.inf: 200})
    w.add(10, {0.1: 10, math.inf: 30})  # the service restarted: counters from zero
    w.add(15, {0.1: 20, math.inf: 40})
    assert w.increase(15) == {0.1: 50 + 10 + 10, math.inf: 100 + 30 + 10}
    p = w.p99(15)
    assert p.samples == 140
    assert p.p99_ms == pytest.approx(100.0)  # rank 138.6 > 70 under 0.1 s: +Inf bucket -> 0.1


def test_window_handles_missing_buckets() -> None:
    w = HistogramWindow(window_s=60, min_samples=1)
    w.add(0, {0.1: 0, 0.5: 0, math.inf: 0})
    w.add(5, {0.1: 40, math.inf: 50})  # a partial scrape lost the 0.5 bucket
    w.add(10, {0.1: 90, 0.5: 100, 0.9: 100, math.inf: 100})  # 0.9 appears for the first time
    inc = w.increase(10)
    assert inc == {0.1: 90, 0.5: 100, math.inf: 100}  # 0.9 seen once: dropped
    assert w.p99(10).p99_ms == pytest.approx((0.1 + 0.4 * (99 - 90) / 10) * 1000)
    # +Inf missing altogether: taken from _count.
    w2 = HistogramWindow(window_s=60, min_samples=1)
    w2.add(0, {0.1: 0}, total=0)
    w2.add(1, {0.1: 5}, total=10)
    assert w2.increase(1) == {0.1: 5, math.inf: 10}


def test_window_slides_and_needs_enough_requests() -> None:
    w = HistogramWindow(window_s=10, min_samples=20)
    assert w.p99(0).reason == "fewer than two scrapes in the window"
    w.add(0, {0.1: 0, math.inf: 0})
    w.add(5, {0.1: 10, math.inf: 10})
    p = w.p99(5)
    assert p.p99_ms is None
    assert p.reason == "only 10 requests in the last 10s (needs 20)"
    w.add(10, {0.1: 10, math.inf: 10})
    w.add(20, {0.1: 10, 1.0: 40, math.inf: 40})
    # Base is the scrape at t=10: 30 new requests, all in (0.1, 1.0].
    assert w.p99(20).samples == 30


class MetricsServer:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hist = Histogram(
            "req_latency_seconds", "latency", registry=self.registry, buckets=BUCKETS
        )
        self.redirect = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if outer.redirect:
                    self.send_response(302)
                    self.send_header("Location", "http://example.com/metrics")
                    self.end_headers()
                    return
                body = generate_latest(outer.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics_server() -> Iterator[MetricsServer]:
    s = MetricsServer()
    yield s
    s.close()


def test_app_latency_scrapes_a_live_endpoint(metrics_server: MetricsServer) -> None:
    now = [100.0]
    app = AppLatency(window_s=30, min_samples=20, scrape_period_s=1, clock=lambda: now[0])
    spec = f"prometheus:http://127.0.0.1:{metrics_server.port}/metrics#req_latency_seconds"
    app.add_prometheus("online-1", spec)
    app.scrape_all()
    for _ in range(99):
        metrics_server.hist.observe(0.03)
    metrics_server.hist.observe(0.2)
    now[0] = 101.0
    app.scrape_all()
    p = app.p99s()["online-1"]
    assert p.samples == 100
    # rank 99 of 100, all 99 in (0.025, 0.05]: 25 + 25 * 99/99 ms.
    assert p.p99_ms == pytest.approx(50.0)
    assert p.source == "prometheus"
    app.tracker.add("reporter", 0.004, now[0])
    assert set(app.p99s()) == {"online-1", "reporter"}
    assert app.p99s()["reporter"].source == "app"
    app.forget("online-1")
    assert set(app.p99s()) == {"reporter"}


def test_scrape_failures_say_why(metrics_server: MetricsServer) -> None:
    spec = f"prometheus:http://127.0.0.1:{metrics_server.port}/metrics#req_latency_seconds"
    scraper = PrometheusScraper(parse_latency_from(spec), 30, 1)
    metrics_server.redirect = True
    assert not scraper.scrape(0.0)
    assert scraper.p99(0.0).reason == (
        # The code only: the reason phrase is the endpoint's own text.
        f"scrape failed: GET http://127.0.0.1:{metrics_server.port}/metrics: HTTP 302"
    )
    metrics_server.redirect = False
    missing = PrometheusScraper(parse_latency_from(spec.replace("req_latency", "nope")), 30, 1)
    assert not missing.scrape(0.0)
    assert "no histogram 'nope_seconds'" in (missing.p99(0.0).reason or "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    down = PrometheusScraper(
        parse_latency_from(f"prometheus:http://127.0.0.1:{free_port}/metrics#m"), 30, 1
    )
    assert not down.scrape(0.0)
    assert (down.p99(0.0).reason or "").startswith("scrape failed:")


def test_scrape_thread_runs_and_stops(metrics_server: MetricsServer) -> None:
    app = AppLatency(window_s=30, min_samples=1, scrape_period_s=0.05)
    spec = f"prometheus:http://127.0.0.1:{metrics_server.port}/metrics#req_latency_seconds"
    app.add_prometheus("c", spec)
    metrics_server.hist.observe(0.01)
    app.start()
    try:
        wait_for(lambda: app.p99s()["c"].reason != "fewer than two scrapes in the window")
        metrics_server.hist.observe(0.01)
        wait_for(lambda: app.p99s()["c"].p99_ms is not None)
    finally:
        app.close()


def test_tracker_p99_matches_sorting_the_window_after_expiry_and_overflow() -> None:
    """The tracker keeps its window sorted as it goes; the answer is the sort-the-window one."""
    rng = random.Random(7)
    tracker = P99Tracker(window_s=1.0, min_samples=3, max_samples=50)
    kept: list[tuple[float, float]] = []
    now = 0.0
    for _ in range(400):
        now += rng.uniform(0.0, 0.05)
        seconds = rng.choice([rng.uniform(0.001, 0.1), 0.05])  # ties included
        tracker.add("a", seconds, now)
        kept = [*kept, (now, seconds)][-50:]
        if rng.random() < 0.3:
            window = sorted(v for at, v in kept if at >= now - 1.0)
            got = tracker.p99("a", now)
            if len(window) < 3:
                assert got.p99_ms is None
            else:
                assert got.p99_ms == window[max(1, math.ceil(0.99 * len(window))) - 1] * 1000.0
            assert got.samples == len(window)
            kept = [(at, v) for at, v in kept if at >= now - 1.0]
