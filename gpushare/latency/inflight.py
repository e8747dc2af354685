"""Requests in flight: the daemon side of request gating's signals.

The gate itself is :mod:`gpushare.control.gate`. Two sources say how many requests an online client has in flight:

* **Datagrams** from :func:`gpushare.client.request_started` / ``request_ended``, on the latency
  socket (:class:`gpushare.latency.receiver.LatencyReceiver` reads them and
  :func:`gpushare.latency.datagrams.decode_message` parses both kinds). Before parsing, a
  :class:`SenderLimiter` drops what one process sends beyond ``[gate] max_datagrams_per_s``, so
  a flood costs a counter, not the daemon's CPU.
* **A Prometheus gauge** (``gpushare submit --online --inflight-from prometheus:URL#METRIC``)
  polled every ``[gate] gauge_period`` by :class:`GaugePoller`, from localhost only, each on a
  supervised worker of its own (:mod:`gpushare.latency.endpoints`).

Every rejection (malformed, flood, not an online client, end without a start, bad gauge) is
counted by reason in a :class:`Rejections` and logged at most once per reason every few seconds
with the count since, so a flood cannot flood the log either.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import structlog

from gpushare.latency.datagrams import MAX_INFLIGHT_COUNT
from gpushare.latency.endpoints import EndpointWorkers
from gpushare.latency.prometheus import (
    METRIC_NAME_RE,
    Cancel,
    FetchError,
    PrometheusSource,
    fetch_with_timeouts,
    metric_families,
    parse_latency_from,
)
from gpushare.latency.threads import Supervisor

log = structlog.get_logger(__name__)

# Rejections of one reason are logged at most once per this long.
LOG_EVERY_S = 5.0


class Rejections:
    """Counted, rate-limited-logged rejections by reason (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}

    def reject(self, reason: str, **context: object) -> None:
        """Count one rejection; log it unless this reason was logged in the last few seconds."""
        now = self._clock()
        with self._lock:
            total = self.counts.get(reason, 0) + 1
            self.counts[reason] = total
            at, seen = self._logged.get(reason, (-math.inf, 0))
            if now - at < LOG_EVERY_S:
                return
            self._logged[reason] = (now, total)
        log.warning("inflight_rejected", reason=reason, since_last_log=total - seen, **context)

    def snapshot(self) -> dict[str, int]:
        """The counts by reason, copied."""
        with self._lock:
            return dict(self.counts)

    def total(self) -> int:
        """All rejections so far."""
        with self._lock:
            return sum(self.counts.values())


class SenderLimiter:
    """A token bucket per sending pid: at most ``rate`` datagrams a second, bursts of a tenth.

    Checked before a datagram is parsed, so a flood costs one dictionary lookup per datagram.
    """

    def __init__(self, rate_per_s: float, *, max_senders: int = 4096) -> None:
        self.rate = float(rate_per_s)
        self.burst = max(1.0, self.rate / 10.0)
        self.max_senders = max_senders
        self._buckets: dict[int | None, tuple[float, float]] = {}

    def allow(self, pid: int | None, now: float) -> bool:
        """Whether one more datagram from ``pid`` is accepted at ``now`` (one thread calls this)."""
        tokens, at = self._buckets.get(pid, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if len(self._buckets) >= self.max_senders and pid not in self._buckets:
            # Many short-lived senders: forget those that are full again (they sent nothing lately).
            self._buckets = {
                p: b
                for p, b in self._buckets.items()
                if b[0] + (now - b[1]) * self.rate < self.burst
            }
        if tokens < 1.0:
            self._buckets[pid] = (tokens, now)
            return False
        self._buckets[pid] = (tokens - 1.0, now)
        return True


# ------------------------------------------------------------------------------- the gauge


def parse_inflight_from(spec: str) -> PrometheusSource:
    """Validate ``prometheus:http://127.0.0.1:PORT/PATH#GAUGE`` (localhost only).

    Raises:
        ValueError: the spec is malformed; the message shows a valid example.
    """
    example = "prometheus:http://127.0.0.1:8000/metrics#requests_in_flight"
    if not spec.startswith("prometheus:"):
        # vllm:/sglang:/tgi: name an LLM server's histograms, not a gauge (parse_latency_from).
        raise ValueError(f"--inflight-from must start with 'prometheus:', e.g. {example}")
    if not spec.partition("#")[2]:
        raise ValueError(f"--inflight-from needs the gauge's name after '#', e.g. {example}")
    try:
        source = parse_latency_from(spec)
    except ValueError as exc:
        raise ValueError(
            str(exc).replace("--latency-from", "--inflight-from")
            + (f" (e.g. {example})" if "e.g." not in str(exc) else "")
        ) from None
    # parse_latency_from strips a histogram's _bucket; a gauge keeps its name as given.
    metric = spec.partition("#")[2]
    if not METRIC_NAME_RE.match(metric):
        raise ValueError(f"{metric!r} is not a Prometheus metric name, e.g. {example}")
    return PrometheusSource(source.url, source.host, source.port, source.path, metric)


def parse_gauge(text: str, metric: str) -> int:
    """Requests in flight from exposition text: the gauge summed over its label sets.

    Raises:
        ValueError: not the text format, the metric is absent, or a value is not a finite
            number >= 0.
    """
    total = 0.0
    seen = False
    for family in metric_families(text):
        for s in family.samples:
            if s.name != metric:
                continue
            value = float(s.value)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{metric} has the value {s.value!r}, not a count of requests")
            total += value
            seen = True
    if not seen:
        raise ValueError(f"no gauge {metric!r} in the exposition")
    if total > MAX_INFLIGHT_COUNT:
        raise ValueError(f"{metric} says {total:g} requests in flight, over {MAX_INFLIGHT_COUNT}")
    # Gauges are floats; a fractional count (an average) still says whether any is in flight.
    return math.ceil(total)


class GaugePoller:
    """Polls each registered client's in-flight gauge every ``period_s``, each on its own thread.

    One supervised worker per gauge (:class:`~gpushare.latency.endpoints.EndpointWorkers`), with
    its own connect, read and total timeouts: an endpoint that trickles its reply delays no other
    client's gauge, and :meth:`forget` closes its connection at once.

    Args:
        period_s: ``[gate] gauge_period``.
        on_count: called with ``(client_id, count, now)`` after each good poll.
        rejections: where a failed or malformed poll is counted (the count then holds no gate:
            the client's gauge source is simply not refreshed, and times out).
        fetch: how to GET the text (tests pass a fake); by default
            :func:`~gpushare.latency.prometheus.fetch_local`.
        threads: the supervisor of the workers (a private one by default).
    """

    def __init__(
        self,
        period_s: float,
        on_count: Callable[[str, int, float], None],
        rejections: Rejections,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch: Callable[[PrometheusSource, float], str] | None = None,
        threads: Supervisor | None = None,
    ) -> None:
        self.period_s = period_s
        self._on_count = on_count
        self._rejections = rejections
        self._clock = clock
        self._fetch = fetch
        self._lock = threading.Lock()
        self._sources: dict[str, PrometheusSource] = {}
        self._workers = EndpointWorkers(
            "inflight-gauge", period_s, self._poll_one, threads or Supervisor()
        )
        #: Why each client's last poll failed. Owner-only: it may quote the endpoint's reply.
        self.last_error: dict[str, str] = {}

    @property
    def wakeups(self) -> int:
        """Polls done by the workers (tests check an idle poller stays asleep)."""
        return self._workers.wakeups

    def add(self, client_id: str, spec: str) -> PrometheusSource:
        """Poll a client's gauge from now on.

        Raises:
            ValueError: a malformed or non-local spec, or too many endpoints polled.
        """
        source = parse_inflight_from(spec)
        with self._lock:
            self._sources[client_id] = source
        try:
            self._workers.add(client_id)
        except ValueError:
            with self._lock:
                self._sources.pop(client_id, None)
            raise
        return source

    def check_spec(self, spec: str) -> PrometheusSource:
        """Parse an ``--inflight-from`` spec and check there is room to poll one more.

        Raises:
            ValueError: a malformed or non-local spec, or too many endpoints.
        """
        source = parse_inflight_from(spec)
        self._workers.check_room("")
        return source

    def forget(self, client_id: str) -> None:
        """Stop polling a client (it exited); a poll under way is cut off."""
        self._workers.forget(client_id)
        with self._lock:
            self._sources.pop(client_id, None)
            self.last_error.pop(client_id, None)

    def poll_all(self) -> None:
        """Poll every gauge once, in turn (tests; the workers poll alone)."""
        with self._lock:
            client_ids = list(self._sources)
        for client_id in client_ids:
            self._poll_one(client_id, Cancel())

    def _poll_one(self, client_id: str, cancel: Cancel) -> None:
        with self._lock:
            source = self._sources.get(client_id)
        if source is None:
            return
        try:
            text = fetch_with_timeouts(source, min(1.0, self.period_s), self._fetch, cancel)
            count = parse_gauge(text, source.metric)
        except (OSError, ValueError) as exc:
            if cancel.cancelled:
                return  # its client ended: not the gauge's fault
            public = exc.public if isinstance(exc, FetchError) else "not a gauge of requests"
            with self._lock:
                if client_id in self._sources:
                    self.last_error[client_id] = str(exc)[:512]
            self._rejections.reject("bad gauge", client_id=client_id, error=public)
            return
        if cancel.cancelled:
            return
        with self._lock:
            self.last_error.pop(client_id, None)
        self._on_count(client_id, count, self._clock())

    def start(self) -> None:
        """Start polling: a worker per gauge, now and as they are added."""
        self._workers.start()

    def alive(self) -> int:
        """Gauge workers whose thread runs."""
        return self._workers.alive()

    def close(self) -> None:
        """Stop every worker (polls under way are cut off)."""
        self._workers.close()
