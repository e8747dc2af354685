"""Latency from a Prometheus histogram (``gpushare submit --latency-from prometheus:URL#METRIC``).

:class:`PrometheusScraper` fetches the text exposition format from localhost only
(:func:`fetch_local`), sums the histogram's ``_bucket`` series over their label sets
(:func:`parse_histogram`), and :class:`HistogramWindow` derives the p99 over the window from
bucket increases, as PromQL's ``histogram_quantile(0.99, increase(METRIC_bucket[window]))`` would:
per-bucket counter resets are detected, buckets missing from some scrapes are dropped, and the
quantile is interpolated linearly inside its bucket (:func:`gpushare.stats.bucket_quantile`).
:mod:`gpushare.latency.inflight` reuses the spec's parser and the fetch for its gauge of requests
in flight. ``vllm:URL``, ``sglang:URL`` and ``tgi:URL`` read an LLM server's own TTFT and TPOT
histograms by the names in :data:`LLM_SERVERS`, through the same parser and windows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpushare.latency.p99 import P99, LatencyP99
from gpushare.stats import bucket_quantile

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
MAX_SCRAPE_BYTES = 8 << 20
#: The largest bucket count taken: float's exact integers (a real server never gets near it).
MAX_COUNT = float(2**53)
_MAX_HEAD_BYTES = 64 << 10
#: A localhost endpoint accepts at once or not at all.
CONNECT_TIMEOUT_S = 0.25
#: The longest wait for the next bytes of a reply (the total is the caller's ``timeout_s``).
READ_TIMEOUT_S = 0.5
# An owner-only error detail is cut to this (it may quote the endpoint's reply).
_MAX_DETAIL_CHARS = 512


@dataclass(frozen=True, slots=True)
class PrometheusSource:
    """A parsed ``--latency-from prometheus:URL#METRIC``."""

    url: str
    host: str
    port: int
    path: str
    metric: str
    server: str = ""
    """``vllm:``, ``sglang:`` or ``tgi:`` URL: the key of :data:`LLM_SERVERS` whose own TTFT and
    TPOT histograms are read (empty for ``prometheus:URL#METRIC``)."""


@dataclass(frozen=True, slots=True)
class LlmServer:
    """An LLM server's own TTFT and TPOT histograms, by the names one cited version exports.

    Each tuple lists the names to try, newest first; the first present in a scrape is read. An
    empty ``ttft`` means the server exports no TTFT histogram (TGI): the TTFT then comes from
    datagrams (``report_ttft``) or is not known.
    """

    label: str
    ttft: tuple[str, ...]
    tpot: tuple[str, ...]
    tpot_per_request: frozenset[str] = frozenset()
    """The ``tpot`` names observed once per request (its mean TPOT), not per token interval: read
    over the TTFT's window (``ttft_window``), sized for one value per request."""


#: vLLM's TTFT histogram (``vllm/v1/metrics/loggers.py`` at vllm-project/vllm commit
#: 005a810bc40faa25b8870fbc8559c3462581eee3, as ``bench/llm_histograms.py`` cites).
VLLM_TTFT = "vllm:time_to_first_token_seconds"
#: vLLM's per-request TPOT histogram (vllm-project/vllm pull request 24015, "[V1][Metrics] Add
#: per-request TPOT histogram", merged 2025-09): observed once per finished request with its mean
#: time per output token, the TPOT a TPOT SLO is scored on; the ITL's buckets.
VLLM_TPOT_REQUEST = "vllm:request_time_per_output_token_seconds"
#: vLLM's TPOT histograms, the first present in a scrape read: the per-request one, else the
#: inter-token latency by its newer name, then by the one it replaced (both observed once per
#: output-token interval: a TPOT SLO on them must be declared on the gaps).
VLLM_TPOT = (VLLM_TPOT_REQUEST, "vllm:inter_token_latency_seconds",
             "vllm:time_per_output_token_seconds")  # fmt: skip
#: SGLang's (``python/sglang/srt/metrics/collector.py`` at sgl-project/sglang commit
#: 93d04878cfb9b08645fae7b11bd340ee33b34acf, ``TokenizerMetricsCollector``); the inter-token
#: histogram had the name ``sglang:time_per_output_token_seconds`` before (its
#: ``docs/references/production_metrics.md``).
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_TPOT = ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
#: TGI's (``router/src/server.rs`` at huggingface/text-generation-inference commit
#: db931fcf42da018a3657580c64bf2720f167f9ab, version 3.3.6-dev0): no TTFT histogram at all, and
#: one TPOT value per successful request, ``inference_time / generated_tokens`` (the prefill
#: included), not per token interval.
TGI_TPOT = "tgi_request_mean_time_per_token_duration"

#: ``--latency-from PREFIX:URL``: the servers whose own histograms are read (docs/controller.md).
LLM_SERVERS: Mapping[str, LlmServer] = {
    "vllm": LlmServer("vLLM", (VLLM_TTFT,), VLLM_TPOT, frozenset({VLLM_TPOT_REQUEST})),
    "sglang": LlmServer("SGLang", (SGLANG_TTFT,), SGLANG_TPOT),
    "tgi": LlmServer("TGI", (), (TGI_TPOT,), frozenset({TGI_TPOT})),
}


def parse_latency_from(spec: str) -> PrometheusSource:
    """Validate ``prometheus:http://127.0.0.1:PORT/PATH#METRIC`` (localhost only).

    Raises:
        ValueError: the spec is malformed; the message shows a valid example.
    """
    example = "prometheus:http://127.0.0.1:8000/metrics#request_latency_seconds"
    prefix = "prometheus:"
    server, colon, rest = spec.partition(":")
    if colon and server in LLM_SERVERS:
        # An LLM server's own TTFT and TPOT histograms, by its names (docs/controller.md).
        if "#" in rest:
            raise ValueError(f"{server}:URL reads the server's own histograms: give no '#METRIC'")
        base = parse_latency_from(f"prometheus:{rest}#{server}")
        return dataclasses.replace(base, metric="", server=server)
    if not spec.startswith(prefix):
        servers = ", ".join(f"{k}:" for k in LLM_SERVERS)
        raise ValueError(
            f"--latency-from must start with {prefix!r} (or {servers} for an LLM server's own"
            f" histograms), e.g. {example}"
        )
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
    for family in metric_families(text):
        for s in family.samples:
            if s.name == metric + "_bucket" and "le" in s.labels:
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
            elif s.name == metric + "_count":
                total = (total or 0.0) + float(s.value)
    counts = [*buckets.values(), *([] if total is None else [total])]
    if any(math.isnan(le) for le in buckets) or not all(0 <= c <= MAX_COUNT for c in counts):
        # The endpoint is the submitting user's: such counts would make up a p99 (a NaN or
        # negative count, or one past float's exact integers, read as an increase).
        raise ValueError(f"histogram {metric!r} has a NaN bound or a count outside [0, 2**53]")
    return buckets, total


def first_histogram(
    text: str, names: tuple[str, ...]
) -> tuple[str, dict[float, float], float | None] | None:
    """The first of ``names`` present in the text: its name and :func:`parse_histogram`'s result.

    Raises:
        ValueError: the text is not the Prometheus text format.
    """
    for name in names:
        buckets, total = parse_histogram(text, name)
        if buckets or total is not None:
            return name, buckets, total
    return None


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


class Cancel:
    """Ends a fetch under way from another thread: its connection is shut down at once.

    One per endpoint worker (:mod:`gpushare.latency.endpoints`); once cancelled, every later
    fetch with it fails before connecting, so a forgotten client's endpoint is not reached again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cancelled = False

    def hold(self, sock: socket.socket) -> None:
        """Remember the connection of the fetch under way.

        Raises:
            OSError: already cancelled.
        """
        with self._lock:
            if self.cancelled:
                raise OSError("the poll was cancelled")
            self._sock = sock

    def release(self) -> None:
        """The fetch under way ended."""
        with self._lock:
            self._sock = None

    def cancel(self) -> None:
        """Shut the connection under way down (its blocked read returns) and refuse later ones."""
        with self._lock:
            self.cancelled = True
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class FetchError(OSError):
    """A fetch that failed.

    ``public`` is safe for every user to see; ``str()`` may quote the endpoint's own reply, which
    only its client's owner (and root) may see.
    """

    def __init__(self, public: str, detail: str | None = None) -> None:
        super().__init__(detail or public)
        self.public = public


def fetch_local(
    source: PrometheusSource,
    timeout_s: float,
    *,
    connect_timeout_s: float | None = None,
    read_timeout_s: float | None = None,
    cancel: Cancel | None = None,
) -> str:
    """GET the exposition text within ``timeout_s`` in all; no redirects are followed.

    HTTP/1.0 with ``Connection: close``: the reply ends at the connection's end (no chunked
    encoding to decode), and ``Content-Length`` is honoured where sent. Each read waits at most
    ``read_timeout_s`` and the whole fetch ``timeout_s``, so an endpoint that trickles a byte at
    a time (slowloris) holds its own worker for ``timeout_s`` at most, and a ``cancel`` ends it
    at once.

    Raises:
        FetchError: connection failure, a timeout, a non-200 status, or a body over the size
            limit.
    """
    deadline = time.monotonic() + timeout_s
    connect_s = min(connect_timeout_s or timeout_s, timeout_s)
    read_s = min(read_timeout_s or timeout_s, timeout_s)
    try:
        sock = socket.create_connection((source.host, source.port), timeout=connect_s)
    except OSError as exc:
        raise FetchError(f"GET {source.url}: cannot connect ({_why(exc)})") from None
    try:
        if cancel is not None:
            cancel.hold(sock)
        request = (
            f"GET {source.path} HTTP/1.0\r\nHost: {source.host}:{source.port}\r\n"
            "Accept: text/plain\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(request.encode("ascii", "replace"))
        raw = _read_reply(sock, source, deadline, read_s, timeout_s)
    except OSError as exc:
        if isinstance(exc, FetchError):
            raise
        raise FetchError(f"GET {source.url}: {_why(exc)}") from None
    finally:
        if cancel is not None:
            cancel.release()
        sock.close()
    return _body(raw, source)


def fetch_with_timeouts(
    source: PrometheusSource,
    timeout_s: float,
    fetch: Callable[[PrometheusSource, float], str] | None,
    cancel: Cancel | None,
) -> str:
    """``fetch`` (tests pass one) or :func:`fetch_local` with its connect and read timeouts.

    Raises:
        OSError: the fetch failed (:class:`FetchError` from :func:`fetch_local`).
    """
    if fetch is not None:
        return fetch(source, timeout_s)
    return fetch_local(
        source,
        timeout_s,
        connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout_s),
        read_timeout_s=min(READ_TIMEOUT_S, timeout_s),
        cancel=cancel,
    )


def metric_families(text: str) -> list[Any]:
    """The exposition's metric families, parsed.

    Raises:
        ValueError: not the text format (the message may quote the text: owner-only).
    """
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a third-party parser reading a user's text
        raise ValueError(f"not the Prometheus text format ({type(exc).__name__})") from None


def _why(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return exc.strerror or type(exc).__name__


def _read_reply(
    sock: socket.socket, source: PrometheusSource, deadline: float, read_s: float, total_s: float
) -> bytes:
    chunks: list[bytes] = []
    size = 0
    limit = MAX_SCRAPE_BYTES + _MAX_HEAD_BYTES
    want: int | None = None  # the reply's length once its head says it
    while want is None or size < want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchError(f"GET {source.url}: no full reply within {total_s:g} s")
        sock.settimeout(min(read_s, left))
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise FetchError(f"GET {source.url}: body larger than {MAX_SCRAPE_BYTES} bytes")
        if want is None:
            want = _reply_length(b"".join(chunks))
    return b"".join(chunks)


def _reply_length(head_so_far: bytes) -> int | None:
    head, sep, _ = head_so_far.partition(b"\r\n\r\n")
    if not sep:
        return None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(head) + len(sep) + int(value.strip()[:12])
    return None


def _body(raw: bytes, source: PrometheusSource) -> str:
    head, sep, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/"):
        raise FetchError(f"GET {source.url}: not an HTTP reply")
    code = status[1][:3].decode("ascii", "replace")
    if code != "200":
        # Only the code: the reason phrase is the endpoint's text.
        raise FetchError(f"GET {source.url}: HTTP {code}")
    if len(body) > MAX_SCRAPE_BYTES:
        raise FetchError(f"GET {source.url}: body larger than {MAX_SCRAPE_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


class PrometheusScraper:
    """One online client's Prometheus histogram, scraped into a :class:`HistogramWindow`.

    A failure leaves two texts: ``last_error``, generic and safe for every user's ``status``, and
    ``last_error_detail``, which may quote what the endpoint sent (a parse error copies the
    offending line) and is for the client's owner only (``LatencyP99.error_detail_owner_only``).
    """

    def __init__(
        self,
        source: PrometheusSource,
        window_s: float,
        min_samples: int,
        *,
        timeout_s: float = 1.0,
        fetch: Callable[[PrometheusSource, float], str] | None = None,
        token_windows_s: tuple[float, float] = (120.0, 10.0),
    ) -> None:
        self.source = source
        self.window = HistogramWindow(window_s, min_samples)
        #: An LLM server's TTFT and TPOT, over ``[latency] ttft_window`` and ``tpot_window`` (the
        #: TTFT's for a TPOT histogram observed once per request); :meth:`_tpot_window` sizes the
        #: TPOT's by the name the server exports.
        self.ttft = HistogramWindow(token_windows_s[0], min_samples)
        self.tpot = HistogramWindow(token_windows_s[1], min_samples)
        self._token_windows_s = token_windows_s
        self._min_samples = min_samples
        self._tpot_name: str | None = None
        self.timeout_s = timeout_s
        self._fetch = fetch
        self.last_error: str | None = None
        self.last_error_detail: str | None = None

    def scrape(self, now: float, cancel: Cancel | None = None) -> bool:
        """Fetch and record one scrape; on failure keep ``last_error`` and return False.

        ``cancel`` cuts the fetch off from another thread (:class:`Cancel`).
        """
        try:
            text = fetch_with_timeouts(self.source, self.timeout_s, self._fetch, cancel)
        except OSError as exc:
            public = exc.public if isinstance(exc, FetchError) else f"GET {self.source.url} failed"
            return self._failed(f"scrape failed: {public}", f"scrape failed: {exc}")
        if self.source.server:
            return self._record_llm(text, now)
        try:
            buckets, total = parse_histogram(text, self.source.metric)
        except ValueError as exc:
            return self._failed(
                f"scrape failed: {self.source.url} did not answer in the Prometheus text format",
                f"scrape failed: {exc}",
            )
        if not buckets and total is None:
            why = f"no histogram {self.source.metric!r} at {self.source.url}"
            return self._failed(why, why)
        self.window.add(now, buckets, total)
        self.last_error = self.last_error_detail = None
        return True

    def _record_llm(self, text: str, now: float) -> bool:
        server = LLM_SERVERS[self.source.server]
        try:
            ttft, tpot = (first_histogram(text, names) for names in (server.ttft, server.tpot))
        except ValueError as exc:
            return self._failed(
                f"scrape failed: {self.source.url} did not answer in the Prometheus text format",
                f"scrape failed: {exc}",
            )
        if ttft is None and tpot is None:
            names = ", ".join((*server.ttft[:1], server.tpot[0]))
            why = f"no {server.label} histograms ({names}) at {self.source.url}"
            return self._failed(why, why)
        if tpot is not None:
            self._tpot_window(server, tpot[0])
        for window, hist in ((self.ttft, ttft), (self.tpot, tpot)):
            if hist is not None:
                window.add(now, *hist[1:])
        self.last_error = self.last_error_detail = None
        return True

    def _tpot_window(self, server: LlmServer, name: str) -> None:
        """Size the TPOT window for the histogram the server exports, anew when its name changes.

        Counts of another histogram are no deltas of this one: a server upgraded to a newer name
        starts a new window.
        """
        if name == self._tpot_name:
            return
        per_request = name in server.tpot_per_request
        window_s = self._token_windows_s[0 if per_request else 1]
        self.tpot = HistogramWindow(window_s, self._min_samples)
        self._tpot_name = name

    def _failed(self, public: str, detail: str) -> bool:
        self.last_error, self.last_error_detail = public, detail[:_MAX_DETAIL_CHARS]
        return False

    def p99(self, now: float) -> LatencyP99:
        """The p99 over the window; a failing endpoint says why."""
        if self.source.server:
            server = LLM_SERVERS[self.source.server]
            # A server without a TTFT histogram (TGI) leaves the TTFT to datagrams, if any.
            ttft = self.ttft.p99(now) if server.ttft else None
            tpot = self.tpot.p99(now)
            why = self.last_error or (
                f"{server.label}'s histograms give TTFT and TPOT, not request latency"
            )
            detail = self.last_error_detail
            return LatencyP99(None, 0, why, error_detail_owner_only=detail, ttft=ttft, tpot=tpot)
        result = self.window.p99(now)
        if result.p99_ms is None and self.last_error is not None:
            return LatencyP99(
                None,
                result.samples,
                self.last_error,
                error_detail_owner_only=self.last_error_detail,
            )
        return result
