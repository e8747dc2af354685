"""App-reported latency, the daemon side: per-client p99 over a sliding window.

Two sources feed the same answer, a :class:`LatencyP99` per online client:

* **Datagrams** from :func:`gpushare.client.report_latency`: :class:`LatencyReceiver` reads them
  from a ``SOCK_DGRAM`` Unix socket with ``SO_PASSCRED`` on, so every datagram carries the sender's
  kernel-verified pid/uid/gid (``SCM_CREDENTIALS``); an ``identify`` callback maps sender and the
  client id in the message to a client (or rejects it). :class:`P99Tracker` keeps the values.
* **Prometheus histograms** (``gpushare submit --latency-from prometheus:URL#METRIC``):
  :class:`PrometheusScraper` fetches the text exposition format from localhost only, sums the
  histogram's ``_bucket`` series over their label sets, and :class:`HistogramWindow` derives the p99
  over the window from bucket increases, as PromQL's
  ``histogram_quantile(0.99, increase(METRIC_bucket[window]))`` would: per-bucket counter resets
  are detected, buckets missing from some scrapes are dropped, and the quantile is interpolated
  linearly inside its bucket.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import dataclasses
import http.client
import itertools
import json
import math
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger(__name__)

P99 = 0.99
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
MAX_SCRAPE_BYTES = 8 << 20
_UCRED = array.array("i", [0, 0, 0])
# A count above this is not a number of requests one process has in flight.
MAX_INFLIGHT_COUNT = 1_000_000


@dataclass(frozen=True, slots=True)
class LatencyP99:
    """One client's app-reported p99 over the window; ``None`` with ``reason`` when unknown.

    ``source`` is where it came from: ``"app"`` (datagrams of ``report_latency``) or
    ``"prometheus"`` (a ``--latency-from`` histogram); :meth:`AppLatency.p99s` sets it.
    """

    p99_ms: float | None
    samples: int
    reason: str | None = None
    source: str | None = None


# ------------------------------------------------------------------------------- datagrams


class P99Tracker:
    """Per-client sliding windows of reported latencies.

    Args:
        window_s: the p99 covers reports of this long (``[latency] window``).
        min_samples: fewer reports than this in the window give no p99 (``[latency] min_samples``).
        max_samples: per client, the oldest reports beyond this are dropped (bounded memory; at
            very high request rates the window then covers less than ``window_s``).
    """

    def __init__(self, window_s: float, min_samples: int, max_samples: int = 50_000) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self._values: dict[str, deque[tuple[float, float]]] = {}
        # The same values kept sorted, so a p99 every tick costs no sort of the whole window.
        self._sorted: dict[str, list[float]] = {}

    def add(self, client_id: str, seconds: float, at_s: float) -> None:
        """Record one report."""
        self.add_many(client_id, ((at_s, seconds),))

    def add_many(self, client_id: str, reports: Iterable[tuple[float, float]]) -> None:
        """Record ``(at_s, seconds)`` reports of one client, in the order they were made."""
        with self._lock:
            q = self._values.get(client_id)
            if q is None:
                q = self._values[client_id] = deque(maxlen=self.max_samples)
                self._sorted[client_id] = []
            ordered = self._sorted[client_id]
            for report in reports:
                if len(q) == q.maxlen:
                    del ordered[bisect.bisect_left(ordered, q[0][1])]  # append drops the oldest
                q.append(report)
                bisect.insort(ordered, report[1])

    def forget(self, client_id: str) -> None:
        """Drop a client's reports (it exited)."""
        with self._lock:
            self._values.pop(client_id, None)
            self._sorted.pop(client_id, None)

    def clients(self) -> list[str]:
        """Clients that reported at least once and were not forgotten."""
        with self._lock:
            return list(self._values)

    def p99(self, client_id: str, now: float) -> LatencyP99:
        """The client's p99 over the window ending at ``now``."""
        with self._lock:
            q = self._values.get(client_id)
            if q is None:
                return LatencyP99(None, 0, "no latency reports")
            ordered = self._sorted[client_id]
            while q and q[0][0] < now - self.window_s:
                del ordered[bisect.bisect_left(ordered, q.popleft()[1])]
            n = len(ordered)
            if n < self.min_samples:
                return LatencyP99(
                    None,
                    n,
                    f"only {n} reports in the last {self.window_s:g}s (needs {self.min_samples})",
                )
            rank = max(1, math.ceil(P99 * n))
            return LatencyP99(ordered[rank - 1] * 1000.0, n)


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent a latency datagram: kernel-verified credentials plus the id the message claims."""

    pid: int | None
    uid: int | None
    gid: int | None
    claimed_id: str


@dataclass(frozen=True, slots=True)
class Message:
    """One datagram of the latency socket: latency reports and/or an in-flight count."""

    claimed_id: str
    latencies_s: tuple[float, ...]
    inflight: int | None


def decode_message(data: bytes) -> Message:
    """Parse a datagram of :func:`gpushare.client.encode_latency` or ``encode_inflight``.

    Raises:
        ValueError: not a version-1 message, or a bad value in it.
    """
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("v") != 1:
        raise ValueError("not a version 1 gpushare datagram")
    client_id = msg.get("id", "")
    if not isinstance(client_id, str):
        raise ValueError("the client id must be a string")
    if "s" not in msg and "n" not in msg:
        raise ValueError('neither latency ("s") nor requests in flight ("n")')
    values = msg.get("s", [])
    if not isinstance(values, list):
        values = [values]
    for v in values:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if not ok:
            raise ValueError(f"latency must be a finite number >= 0, got {v!r}")
    count = msg.get("n")
    if count is not None and (
        not isinstance(count, int)
        or isinstance(count, bool)
        or not 0 <= count <= MAX_INFLIGHT_COUNT
    ):
        raise ValueError(
            f"requests in flight must be an integer in [0, {MAX_INFLIGHT_COUNT}], got {count!r}"
        )
    return Message(client_id, tuple(float(v) for v in values), count)


def decode_latency(data: bytes) -> tuple[str, list[float]]:
    """Parse one datagram of :func:`gpushare.client.encode_latency` (a batch of reports).

    Raises:
        ValueError: not a version-1 latency report.
    """
    msg = decode_message(data)
    if msg.inflight is not None and not msg.latencies_s:
        raise ValueError("not a latency report (requests in flight only)")
    return msg.claimed_id, list(msg.latencies_s)


def claimed_id(sender: Sender) -> str | None:
    """The default ``identify``: trust the id in the message (empty means unknown)."""
    return sender.claimed_id or None


def verified_identify(
    client_of_pid: Callable[[int], str | None], uid_of_client: Callable[[str], int | None]
) -> Callable[[Sender], str | None]:
    """An ``identify`` for the daemon: kernel-verified credentials first, the claimed id second.

    Args:
        client_of_pid: the client a pid belongs to (the daemon's registry and cgroups).
        uid_of_client: the uid a client runs as; ``None`` for an unknown client.

    Returns:
        A function crediting a report to the client owning the sending pid; failing that, to the
        claimed client if the sender runs as that client's uid (or as root). Anything else is
        rejected, so no process can report latency for another user's client.
    """

    def identify(sender: Sender) -> str | None:
        if sender.pid is not None:
            owner = client_of_pid(sender.pid)
            if owner is not None:
                return owner
        if not sender.claimed_id or sender.uid is None:
            return None
        uid = uid_of_client(sender.claimed_id)
        if uid is None:
            return None
        return sender.claimed_id if sender.uid in (uid, 0) else None

    return identify


class LatencyReceiver:
    """Receives latency datagrams on a Unix socket and feeds a :class:`P99Tracker`.

    Args:
        path: the socket path (``paths.latency_socket``); a stale socket there is replaced.
        tracker: where accepted reports go.
        identify: maps a :class:`Sender` to a client id, or ``None`` to reject. The daemon passes
            one that checks the kernel-verified pid/uid against its registry, so a process cannot
            report for another user's client.
        clock: monotonic clock used to stamp reports.
        mode: permissions of the socket file (services of every user report).
        on_inflight: called with ``(client_id, pid, count, now)`` for a request-boundary datagram
            (``gpushare.client.request_started``); returns ``None`` when accepted, else the reason
            it was rejected. Without it such datagrams are rejected ("gating not served here").
        allow: called with ``(pid, now)`` before a datagram is parsed; ``False`` rejects it
            unread (the daemon passes a per-sender rate limit, ``inflight.SenderLimiter``).
        reject: called with a reason for every rejected datagram (the daemon counts and logs them,
            ``inflight.Rejections``); the ``rejected`` counter counts them in any case.
        thread_nice: the receiving thread's nice value (:func:`renice_thread`), so a request
            start is read at once even when offline processes keep every CPU busy.
        thread_realtime: ``SCHED_FIFO`` for it instead, where allowed (:func:`renice_thread`).
    """

    def __init__(
        self,
        path: Path | str,
        tracker: P99Tracker,
        *,
        identify: Callable[[Sender], str | None] = claimed_id,
        clock: Callable[[], float] = time.monotonic,
        mode: int = 0o666,
        on_inflight: Callable[[str, int | None, int, float], str | None] | None = None,
        allow: Callable[[int | None, float], bool] | None = None,
        reject: Callable[..., None] | None = None,
        thread_nice: int | None = None,
        thread_realtime: bool = False,
    ) -> None:
        self.path = Path(path)
        self.tracker = tracker
        self.identify = identify
        self._clock = clock
        self._mode = mode
        self._on_inflight = on_inflight
        self._allow = allow
        self._reject = reject
        self._thread_nice = thread_nice
        self._thread_realtime = thread_realtime
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.accepted = 0  # reports (values), not datagrams
        self.rejected = 0  # datagrams

    def start(self) -> None:
        """Bind the socket and start the receiving thread.

        Raises:
            OSError: the socket cannot be bound (the message names the path).
            FileExistsError: something that is not a socket occupies the path.
        """
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(
                    f"{self.path} exists and is not a socket; remove it or set paths.latency_socket"
                )
            self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(str(self.path))
            os.chmod(self.path, self._mode)
            # The timeout lets the thread notice close() without a wake-up datagram.
            sock.settimeout(0.2)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot bind the latency socket {self.path}: {exc}") from exc
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="latency-receiver", daemon=True)
        self._thread.start()
        log.info("latency_socket_listening", path=str(self.path))

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        if self._thread_nice is not None:
            got = renice_thread(self._thread_nice, realtime=self._thread_realtime)
            log.info("latency_receiver_priority", priority=got)
        cmsg_space = socket.CMSG_SPACE(_UCRED.itemsize * 3)
        while not self._stop.is_set():
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(65536, cmsg_space)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            self.handle(data, _credentials(ancdata))

    def handle(self, data: bytes, creds: tuple[int, int, int] | None) -> str | None:
        """Process one datagram; returns the client it was credited to, or ``None``."""
        pid, uid, gid = creds if creds is not None else (None, None, None)
        now = self._clock()
        if self._allow is not None and not self._allow(pid, now):
            self._rejected("flood: over the per-sender datagram rate", pid=pid)
            return None
        try:
            msg = decode_message(data)
        except ValueError as exc:
            self._rejected("malformed datagram", error=str(exc), pid=pid)
            return None
        client = self.identify(Sender(pid=pid, uid=uid, gid=gid, claimed_id=msg.claimed_id))
        if client is None:
            self._rejected(
                "sender is not a client of gpushare", pid=pid, uid=uid, claimed=msg.claimed_id
            )
            return None
        for seconds in msg.latencies_s:
            self.tracker.add(client, seconds, now)
        self.accepted += len(msg.latencies_s)
        if msg.inflight is not None:
            why = (
                "gating not served here"
                if self._on_inflight is None
                else self._on_inflight(client, pid, msg.inflight, now)
            )
            if why is not None:
                self._rejected(why, client_id=client, pid=pid)
                return client if msg.latencies_s else None
        return client

    def _rejected(self, reason: str, **context: object) -> None:
        self.rejected += 1
        if self._reject is not None:
            self._reject(reason, **context)
        log.debug("latency_datagram_rejected", reason=reason, **context)

    def close(self) -> None:
        """Stop the thread, close and remove the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def renice_thread(nice: int, *, realtime: bool = False) -> str:
    """Raise the calling thread's (not its process's) CPU priority; says what it got.

    With ``realtime``, ``SCHED_FIFO`` at the lowest real-time priority (1): the thread then runs
    as soon as it wakes, ahead of every normal task. Otherwise, or where that is refused, the
    nice value ``nice`` (Linux keeps one per thread). For threads that sleep in a receive or a
    timer and do little when they wake: ``bench/gating_latency.py`` measured a request start to
    the freeze written at a p99 of about 1 ms with 50 spinning offline processes on 2 CPUs under
    ``SCHED_FIFO``, and tens of ms to over 100 ms at nice -10 or 0 (the kernel's fair scheduler
    let the woken thread wait behind them).

    Returns:
        ``"SCHED_FIFO 1"``, ``"nice N"`` or ``"unchanged"`` (not root).
    """
    tid = threading.get_native_id()
    if realtime:
        try:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
        except OSError as exc:
            log.debug("realtime_thread_refused", error=str(exc))
        else:
            return "SCHED_FIFO 1"
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.debug("renice_thread_refused", nice=nice, error=str(exc))
        return "unchanged"
    return f"nice {nice}"


def _credentials(ancdata: Iterable[tuple[int, int, bytes]]) -> tuple[int, int, int] | None:
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            creds = array.array("i")
            creds.frombytes(payload[: _UCRED.itemsize * 3])
            pid, uid, gid = creds
            return pid, uid, gid
    return None


# ------------------------------------------------------------------------------- Prometheus


@dataclass(frozen=True, slots=True)
class PrometheusSource:
    """A parsed ``--latency-from prometheus:URL#METRIC``."""

    url: str
    host: str
    port: int
    path: str
    metric: str


def parse_latency_from(spec: str) -> PrometheusSource:
    """Validate ``prometheus:http://127.0.0.1:PORT/PATH#METRIC`` (localhost only).

    Raises:
        ValueError: the spec is malformed; the message shows a valid example.
    """
    example = "prometheus:http://127.0.0.1:8000/metrics#request_latency_seconds"
    prefix = "prometheus:"
    if not spec.startswith(prefix):
        raise ValueError(f"--latency-from must start with {prefix!r}, e.g. {example}")
    url, sep, metric = spec[len(prefix) :].partition("#")
    if not sep or not metric:
        raise ValueError(f"--latency-from needs the histogram name after '#', e.g. {example}")
    metric = metric.removesuffix("_bucket")
    if not METRIC_NAME_RE.match(metric):
        raise ValueError(f"{metric!r} is not a Prometheus metric name, e.g. {example}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only plain http on localhost is scraped, got {url!r}; e.g. {example}")
    host = (parts.hostname or "").lower()
    if host not in LOCAL_HOSTS:
        raise ValueError(
            f"the endpoint must be on this host (localhost, 127.0.0.1 or ::1), got {host!r}"
        )
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}: {exc}") from None
    path = parts.path or "/metrics"
    if parts.query:
        path += "?" + parts.query
    return PrometheusSource(url=url, host=host, port=port, path=path, metric=metric)


def parse_histogram(text: str, metric: str) -> tuple[dict[float, float], float | None]:
    """Cumulative bucket counts of a histogram from exposition text, summed over label sets.

    Returns:
        ``({le: count}, total)``; ``total`` is ``METRIC_count`` (``None`` if absent).

    Raises:
        ValueError: the text is not the Prometheus text format.
    """
    buckets: dict[float, float] = {}
    total: float | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric + "_bucket" and "le" in s.labels:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
            elif s.name == metric + "_count":
                total = (total or 0.0) + float(s.value)
    return buckets, total


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """``histogram_quantile`` on cumulative counts: linear inside the bucket; ``None`` if empty.

    A rank that falls in the ``+Inf`` bucket returns the largest finite bound, as PromQL does.
    """
    bounds = sorted(buckets)
    if not bounds:
        return None
    counts: list[float] = []
    running = 0.0
    for le in bounds:
        # Buckets are cumulative; scraping races can make them non-monotonic, which PromQL fixes
        # the same way.
        running = max(running, buckets[le])
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    for i, le in enumerate(bounds):
        if counts[i] >= rank:
            if math.isinf(le):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            lower = bounds[i - 1] if i > 0 else (0.0 if le > 0 else le)
            below = counts[i - 1] if i > 0 else 0.0
            inside = counts[i] - below
            if inside <= 0:
                return le
            return lower + (le - lower) * (rank - below) / inside
    return None  # pragma: no cover - counts[-1] == total >= rank


class HistogramWindow:
    """Scrapes of one histogram, and its p99 over a sliding window from bucket increases."""

    def __init__(self, window_s: float, min_samples: int) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        self._scrapes: deque[tuple[float, dict[float, float]]] = deque()

    def add(self, at_s: float, buckets: Mapping[float, float], total: float | None = None) -> None:
        """Record one scrape. A missing ``+Inf`` bucket is taken from ``_count`` when present."""
        snap = dict(buckets)
        if math.inf not in snap and total is not None:
            snap[math.inf] = total
        self._scrapes.append((at_s, snap))
        # Keep one scrape at or before the window's start, as the base of the increase.
        while len(self._scrapes) >= 2 and self._scrapes[1][0] <= at_s - self.window_s:
            self._scrapes.popleft()

    def increase(self, now: float) -> dict[float, float]:
        """Per-bucket increase over the window, counter resets handled per bucket series."""
        scrapes = [s for s in self._scrapes if s[0] <= now]
        while len(scrapes) >= 2 and scrapes[1][0] <= now - self.window_s:
            scrapes.pop(0)
        if len(scrapes) < 2:
            return {}
        latest = scrapes[-1][1]
        out: dict[float, float] = {}
        for le in latest:
            series = [snap[le] for _, snap in scrapes if le in snap]
            if len(series) < 2:
                continue  # a bucket seen once in the window has no increase to speak of
            inc = 0.0
            for prev, cur in itertools.pairwise(series):
                # A counter that went down was reset (the service restarted): it counts from 0.
                inc += cur - prev if cur >= prev else cur
            out[le] = inc
        return out

    def p99(self, now: float) -> LatencyP99:
        """The window's p99 in milliseconds (the histogram is in seconds, Prometheus' base unit)."""
        inc = self.increase(now)
        if not inc:
            return LatencyP99(None, 0, "fewer than two scrapes in the window")
        total = max(inc.values())
        n = int(total)
        if n < self.min_samples:
            return LatencyP99(
                None,
                n,
                f"only {n} requests in the last {self.window_s:g}s (needs {self.min_samples})",
            )
        value = bucket_quantile(P99, inc)
        if value is None:
            return LatencyP99(None, n, "histogram has no finite buckets")
        return LatencyP99(value * 1000.0, n)


def fetch_local(source: PrometheusSource, timeout_s: float) -> str:
    """GET the exposition text; no redirects are followed (they could leave localhost).

    Raises:
        OSError: connection failure, a non-200 status, or a body over the size limit.
    """
    conn = http.client.HTTPConnection(source.host, source.port, timeout=timeout_s)
    try:
        conn.request("GET", source.path, headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"GET {source.url}: HTTP {resp.status} {resp.reason}")
        body = resp.read(MAX_SCRAPE_BYTES + 1)
        if len(body) > MAX_SCRAPE_BYTES:
            raise OSError(f"GET {source.url}: body larger than {MAX_SCRAPE_BYTES} bytes")
        return body.decode("utf-8", errors="replace")
    except http.client.HTTPException as exc:
        raise OSError(f"GET {source.url}: {exc}") from exc
    finally:
        conn.close()


class PrometheusScraper:
    """One online client's Prometheus histogram, scraped into a :class:`HistogramWindow`."""

    def __init__(
        self,
        source: PrometheusSource,
        window_s: float,
        min_samples: int,
        *,
        timeout_s: float = 1.0,
        fetch: Callable[[PrometheusSource, float], str] = fetch_local,
    ) -> None:
        self.source = source
        self.window = HistogramWindow(window_s, min_samples)
        self.timeout_s = timeout_s
        self._fetch = fetch
        self.last_error: str | None = None

    def scrape(self, now: float) -> bool:
        """Fetch and record one scrape; on failure keep ``last_error`` and return False."""
        try:
            text = self._fetch(self.source, self.timeout_s)
            buckets, total = parse_histogram(text, self.source.metric)
        except (OSError, ValueError) as exc:
            self.last_error = f"scrape failed: {exc}"
            return False
        if not buckets and total is None:
            self.last_error = f"no histogram {self.source.metric!r} at {self.source.url}"
            return False
        self.window.add(now, buckets, total)
        self.last_error = None
        return True

    def p99(self, now: float) -> LatencyP99:
        """The p99 over the window; a failing endpoint says why."""
        result = self.window.p99(now)
        if result.p99_ms is None and self.last_error is not None:
            return LatencyP99(None, result.samples, self.last_error)
        return result


class AppLatency:
    """Both sources together: per-client p99 for :func:`gpushare.observe.build_observations`.

    The scrapes run on a thread of their own (``start``), so a slow endpoint never delays a tick.
    """

    def __init__(
        self,
        window_s: float,
        min_samples: int,
        scrape_period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch: Callable[[PrometheusSource, float], str] = fetch_local,
    ) -> None:
        self.tracker = P99Tracker(window_s, min_samples)
        self.window_s = window_s
        self.min_samples = min_samples
        self.scrape_period_s = scrape_period_s
        self._clock = clock
        self._fetch = fetch
        self._lock = threading.Lock()
        self._scrapers: dict[str, PrometheusScraper] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_prometheus(self, client_id: str, spec: str) -> PrometheusSource:
        """Scrape a client's histogram from now on.

        Raises:
            ValueError: a malformed or non-local ``--latency-from`` spec.
        """
        source = parse_latency_from(spec)
        scraper = PrometheusScraper(
            source,
            self.window_s,
            self.min_samples,
            timeout_s=min(1.0, self.scrape_period_s),
            fetch=self._fetch,
        )
        with self._lock:
            self._scrapers[client_id] = scraper
        return source

    def forget(self, client_id: str) -> None:
        """Stop tracking a client (it exited)."""
        self.tracker.forget(client_id)
        with self._lock:
            self._scrapers.pop(client_id, None)

    def scrape_all(self) -> None:
        """Scrape every registered endpoint once (the thread calls this every period)."""
        with self._lock:
            scrapers = list(self._scrapers.items())
        for client_id, scraper in scrapers:
            if not scraper.scrape(self._clock()):
                log.debug("latency_scrape_failed", client_id=client_id, error=scraper.last_error)

    def start(self) -> None:
        """Start the scraping thread."""
        self._thread = threading.Thread(target=self._run, name="latency-scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.wait(max(0.0, deadline - time.monotonic())):
            self.scrape_all()
            deadline = max(deadline + self.scrape_period_s, time.monotonic())

    def close(self) -> None:
        """Stop the scraping thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def p99s(self, now: float | None = None) -> dict[str, LatencyP99]:
        """Every known client's p99; a scraped client's histogram wins over its datagrams."""
        now = self._clock() if now is None else now
        out = {
            cid: dataclasses.replace(self.tracker.p99(cid, now), source="app")
            for cid in self.tracker.clients()
        }
        with self._lock:
            scrapers = list(self._scrapers.items())
        for client_id, scraper in scrapers:
            out[client_id] = dataclasses.replace(scraper.p99(now), source="prometheus")
        return out
