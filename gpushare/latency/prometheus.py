"""Latency from a Prometheus histogram (``gpushare submit --latency-from prometheus:URL#METRIC``).

:class:`PrometheusScraper` fetches the text exposition format from localhost only
(:func:`fetch_local`), sums the histogram's ``_bucket`` series over their label sets
(:func:`parse_histogram`), and :class:`HistogramWindow` derives the p99 over the window from
bucket increases, as PromQL's ``histogram_quantile(0.99, increase(METRIC_bucket[window]))`` would:
per-bucket counter resets are detected, buckets missing from some scrapes are dropped, and the
quantile is interpolated linearly inside its bucket (:func:`bucket_quantile`).
:mod:`gpushare.inflight` reuses the spec's parser and the fetch for its gauge of requests in flight.
"""

from __future__ import annotations

import http.client
import itertools
import math
import re
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gpushare.latency.p99 import P99, LatencyP99

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
MAX_SCRAPE_BYTES = 8 << 20


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
