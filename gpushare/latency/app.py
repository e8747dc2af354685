"""Both latency sources together: :class:`AppLatency`, the per-client p99s each tick reads.

Datagrams land in its :class:`~gpushare.latency.p99.P99Tracker` (through
:mod:`gpushare.latency.receiver`); histograms are scraped on a thread of its own
(:mod:`gpushare.latency.prometheus`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import structlog

from gpushare.latency.p99 import LatencyP99, P99Tracker
from gpushare.latency.prometheus import (
    PrometheusScraper,
    PrometheusSource,
    fetch_local,
    parse_latency_from,
)

log = structlog.get_logger(__name__)


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
