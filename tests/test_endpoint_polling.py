"""Polled URLs from different users: a slow endpoint delays no one else, and ends with its client.

Real local HTTP servers: a slowloris that answers one byte every 30 ms for ever, next to a
normal gauge. On b0c0ecb one thread polled every gauge in turn with a per-read timeout only, so
the slowloris held it for good: the other user's gauge-gated service was not polled again, and
the slow connection outlived ``forget`` (its client's end).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpushare.latency.app import AppLatency
from gpushare.latency.inflight import GaugePoller, Rejections

TRICKLE_S = 0.03


@dataclass
class Slowloris:
    """Accepts connections and trickles an endless reply; records when each one is closed."""

    sock: socket.socket
    stop: threading.Event = field(default_factory=threading.Event)
    accepted: int = 0
    closed_at: list[float] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        with conn:
            try:
                conn.recv(4096)  # the request
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                while not self.stop.is_set():
                    conn.sendall(b"#")
                    # The client's end of the connection: EOF (or a reset) on this side.
                    conn.setblocking(False)
                    try:
                        if conn.recv(1) == b"":
                            break
                    except BlockingIOError:
                        pass
                    conn.setblocking(True)
                    conn.settimeout(0.5)
                    time.sleep(TRICKLE_S)
            except OSError:
                pass
        self.closed_at.append(time.monotonic())


@pytest.fixture
def slowloris() -> Iterator[Slowloris]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = Slowloris(sock)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        thread.join(2.0)
        sock.close()


class _Gauge(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"inflight 2\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gauge_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gauge)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def spec(port: int, metric: str = "inflight") -> str:
    return f"prometheus:http://127.0.0.1:{port}/metrics#{metric}"


def test_a_slowloris_gauge_does_not_delay_another_users_gauge(
    slowloris: Slowloris, gauge_port: int
) -> None:
    polls: list[float] = []
    period_s = 0.05

    def on_count(client_id: str, count: int, _now: float) -> None:
        if client_id == "victim":
            polls.append(time.monotonic())

    poller = GaugePoller(period_s, on_count, Rejections())
    poller.add("attacker", spec(slowloris.port))
    poller.add("victim", spec(gauge_port))
    poller.start()
    try:
        time.sleep(1.5)
    finally:
        poller.close()
    assert slowloris.accepted >= 1, "the slow endpoint was never polled"
    # Every period on time: 30 periods in 1.5 s; a poller held by the slowloris manages ~0.
    assert len(polls) >= 15, f"the victim's gauge was polled {len(polls)} times in 1.5 s"
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    assert max(gaps) < 0.5, f"the victim's gauge waited {max(gaps):.2f} s between polls"


def test_the_slow_connection_is_closed_when_its_client_ends(slowloris: Slowloris) -> None:
    # A long total timeout (the period's, capped at 1 s), so only the client's end can cut it.
    poller = GaugePoller(5.0, lambda *_: None, Rejections())
    poller.add("attacker", spec(slowloris.port))
    poller.start()
    try:
        deadline = time.monotonic() + 3.0
        while slowloris.accepted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slowloris.accepted == 1
        time.sleep(0.1)  # the fetch is under way, reading the trickle
        assert slowloris.closed_at == []
        ended = time.monotonic()
        poller.forget("attacker")
        deadline = time.monotonic() + 0.5
        while not slowloris.closed_at and time.monotonic() < deadline:
            time.sleep(0.005)
        assert slowloris.closed_at, "the connection outlived its client"
        assert slowloris.closed_at[0] - ended < 0.2
    finally:
        poller.close()


def test_a_fetch_never_takes_longer_than_its_total_timeout(slowloris: Slowloris) -> None:
    rejections = Rejections()
    poller = GaugePoller(0.2, lambda *_: None, rejections)
    poller.add("attacker", spec(slowloris.port))
    t0 = time.monotonic()
    # On a thread, so a poll that never ends fails the test instead of hanging it.
    worker = threading.Thread(target=poller.poll_all, daemon=True)
    worker.start()
    worker.join(2.0)
    took = time.monotonic() - t0
    assert took < 0.2 + 0.15, f"one poll of a slowloris took {took:.2f} s"
    assert rejections.counts == {"bad gauge": 1}


def test_a_slowloris_histogram_does_not_delay_another_clients_scrape(
    slowloris: Slowloris, gauge_port: int
) -> None:
    app = AppLatency(window_s=30, min_samples=1, scrape_period_s=0.05)
    app.add_prometheus("attacker", spec(slowloris.port, "lat"))
    app.add_prometheus("victim", spec(gauge_port, "lat"))
    app.start()
    try:
        time.sleep(0.6)
        # The victim's endpoint has no such histogram: each scrape says so, at once.
        assert "no histogram 'lat'" in (app.p99s()["victim"].reason or "")
        assert slowloris.accepted >= 1
        app.forget("attacker")
        deadline = time.monotonic() + 0.5
        while not slowloris.closed_at and time.monotonic() < deadline:
            time.sleep(0.005)
        assert slowloris.closed_at, "the scrape's connection outlived its client"
    finally:
        app.close()


class _Leaky(BaseHTTPRequestHandler):
    """An endpoint whose reply is not the text format and starts with its owner's secret."""

    def do_GET(self) -> None:
        body = b"ROOT_DB_PASSWORD=hunter2\n"  # the parser quotes the line it cannot read
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_text_fetched_from_a_url_is_kept_out_of_the_public_reason() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Leaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        app = AppLatency(window_s=30, min_samples=1, scrape_period_s=1.0)
        app.add_prometheus("c1", spec(int(server.server_address[1]), "lat"))
        app.scrape_all()
        p99 = app.p99s()["c1"]
    finally:
        server.shutdown()
        server.server_close()
    # Every user's status shows the reason: no byte of the reply in it.
    assert p99.reason is not None and "did not answer in the Prometheus text format" in p99.reason
    assert "hunter2" not in p99.reason
    # The owner sees what went wrong, reply included (the API's view drops it for others).
    assert "hunter2" in (getattr(p99, "error_detail_owner_only", None) or "")


def test_the_number_of_polled_endpoints_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpushare.latency import endpoints

    monkeypatch.setattr(endpoints, "MAX_ENDPOINTS", 2)
    poller = GaugePoller(10.0, lambda *_: None, Rejections())
    poller.add("a", spec(9))
    poller.add("b", spec(9))
    poller.add("b", spec(9))  # the same client again: replaced, not one more
    with pytest.raises(ValueError, match="2 endpoints are polled already"):
        poller.check_spec(spec(9))
    with pytest.raises(ValueError, match="2 endpoints are polled already"):
        poller.add("c", spec(9))
    poller.forget("a")
    poller.add("c", spec(9))
    poller.close()
