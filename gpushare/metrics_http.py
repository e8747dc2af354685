"""The metrics exporter's HTTP server: each snapshot rendered once, and a bound on connections.

Any local user can reach the listener, and rendering the exposition is the costly part of a scrape
(about 1.7 MB of text, ~100 ms of CPU holding the GIL at 8 GPUs x 200 clients): a flood of scrapes
re-rendering it each time would stall the daemon's control loop. So the snapshot's families are
rendered once per snapshot and per exposition format (:class:`RenderCache`), every scraper of that
snapshot is served the same bytes, and only the few node-level series that change between
snapshots (build info, trust refusals, the process collector's ``process_*``) are rendered per
scrape. The format is chosen from ``Accept`` as prometheus_client chooses it (the text format, or
OpenMetrics); ``Accept-Encoding`` is ignored, as it was: the body is never compressed.

Each connection holds a server thread, so at most :data:`MAX_CONNECTIONS` are served at once; one
more is answered ``503`` at once from the accepting thread, which starts no thread for it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import parse_version

#: Connections served at once; Prometheus scrapes a target over one at a time.
MAX_CONNECTIONS = 16

_Encoder = Callable[[Collector], bytes]
#: A snapshot (:class:`gpushare.metrics.NodeMetrics`; this module needs only its identity).
S = TypeVar("S")
_EOF = b"# EOF\n"
_BUSY_BODY = b"busy: too many connections to the metrics endpoint, try again\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class Exposition(Protocol[S]):
    """What the server renders: the exporter (:class:`gpushare.metrics.Exporter`)."""

    #: Monotonic seconds, to time renders with.
    clock: Callable[[], float]

    def snapshot(self) -> S:
        """The snapshot a scrape renders (built now when due)."""

    def rendered(self, snapshot: S, seconds: float) -> None:
        """``snapshot`` was rendered in ``seconds`` (the source spaces its builds by that)."""

    def snapshot_families(self, snapshot: S) -> Collector:
        """The families that are a function of ``snapshot`` alone."""

    def live_families(self) -> Collector:
        """The few node-level families rendered on every scrape."""

    def health(self) -> tuple[bool, str]:
        """Whether the control loop ticks, and one line saying so."""


class RenderCache(Generic[S]):
    """The rendered bytes of the latest snapshot, per exposition format.

    One scrape renders while concurrent scrapes of the same snapshot wait for it and reuse it; a
    new snapshot drops the old one's bytes. Formats are keyed by what changes the bytes (encoder,
    escaping, and whether the OpenMetrics version is 2 or later), so however ``Accept`` is spelled
    a snapshot is rendered at most 16 times.
    """

    def __init__(self, source: Exposition[S]) -> None:
        self._source = source
        # Held while fetching the snapshot and rendering it: scrapes of one snapshot render once.
        self._lock = threading.Lock()
        # The snapshot itself is kept, not its id, so an id cannot be reused by a later one.
        self._snapshot: S | None = None
        self._bodies: dict[tuple[object, ...], bytes] = {}
        self.renders = 0  #: Snapshot renders so far (one per snapshot and format).

    def body(self, encoder: _Encoder) -> bytes:
        """The exposition for ``encoder``: the snapshot's cached part, then the live part."""
        key = _format_key(encoder)
        with self._lock:
            snap = self._source.snapshot()
            if snap is not self._snapshot:
                self._snapshot, self._bodies = snap, {}
            cached = self._bodies.get(key)
            if cached is None:
                start_s = self._source.clock()
                cached = encoder(self._source.snapshot_families(snap))
                self._source.rendered(snap, self._source.clock() - start_s)
                # OpenMetrics ends with "# EOF"; the live part that follows brings its own.
                cached = cached.removesuffix(_EOF)
                self._bodies[key] = cached
                self.renders += 1
        return cached + encoder(self._source.live_families())


def _format_key(encoder: _Encoder) -> tuple[object, ...]:
    """What of ``encoder`` changes the bytes: the version only drops native histograms below 2."""
    if not isinstance(encoder, partial):
        return (encoder,)
    keywords = dict(encoder.keywords)
    if "version" in keywords:
        keywords["version"] = parse_version(str(keywords["version"])) >= (2, 0, 0)
    return (encoder.func, *sorted(keywords.items()))


class Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; beyond, 503 at once.

    ``max_connections`` is :data:`MAX_CONNECTIONS` when ``None``.
    """

    daemon_threads = True
    # The listen backlog (socketserver's default is 5): a burst of connections waits in it to be
    # served or refused, instead of its SYNs being dropped and retried a second later.
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_connections: int | None = None,
    ) -> None:
        bound = MAX_CONNECTIONS if max_connections is None else max_connections
        self._slots = threading.BoundedSemaphore(bound)
        self.refused = 0  #: Connections answered 503 for want of a slot.
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start the connection's thread if a slot is free; else answer 503 from this thread."""
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started: it will not release its slot
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve the connection, then free its slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Server6(Server):
    """:class:`Server` on IPv6."""

    address_family = socket.AF_INET6


def _refuse(request: socket.socket) -> None:
    """Answer 503 without blocking the accepting thread (a fresh socket's buffer has room)."""
    try:
        request.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            request.recv(65536)  # what was sent already, so closing does not reset the reply
        request.send(_BUSY)
    except OSError:
        pass  # the client went away: nothing to answer


def server_class(host: str) -> type[Server]:
    """IPv6 for an IPv6 address (``::1``, ``[::1]``), else IPv4, as prometheus_client chose."""
    return Server6 if ":" in host else Server


def handler(
    cache: RenderCache[S], source: Exposition[S], timeout_s: float
) -> type[BaseHTTPRequestHandler]:
    """The request handler: ``/metrics`` from ``cache``, ``/healthz`` from ``source``."""

    class Handler(BaseHTTPRequestHandler):
        """``/metrics``, ``/healthz``, and 404 for anything else (no directory of pages)."""

        timeout = timeout_s

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                try:
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                except (TypeError, ValueError):  # a version prometheus_client cannot compare
                    body = b"bad Accept header: its version is not a dotted number\n"
                    self._reply(400, "text/plain; charset=utf-8", body)
                    return
                self._reply(200, content_type, cache.body(encoder))
            elif path == "/healthz":
                ok, line = source.health()
                self._reply(200 if ok else 503, "text/plain; charset=utf-8", (line + "\n").encode())
            else:
                body = b"not found: gpushare serves /metrics and /healthz\n"
                self._reply(404, "text/plain; charset=utf-8", body)

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes are not log events (every few seconds, forever)."""

    return Handler
