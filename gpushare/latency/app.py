"""Both latency sources together: :class:`AppLatency`, the per-client p99s each tick reads.

Datagrams land in its :class:`~gpushare.latency.p99.P99Tracker` (through
:mod:`gpushare.latency.receiver`); each histogram is scraped on a supervised thread of its own
(:mod:`gpushare.latency.endpoints`, :mod:`gpushare.latency.prometheus`), so one slow endpoint
delays no other client's scrape, and a forgotten client's connection is cut at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import structlog

from gpushare.latency.endpoints import EndpointWorkers
from gpushare.latency.p99 import LatencyP99, P99Tracker, TokenTrackers
from gpushare.latency.prometheus import (
    Cancel,
    PrometheusScraper,
    PrometheusSource,
    parse_latency_from,
)
from gpushare.latency.threads import Supervisor

log = structlog.get_logger(__name__)


class AppLatency:
    """Both sources together: per-client p99 for :func:`gpushare.daemon.observe.build_observation`.

    The scrapes run on threads of their own (``start``), one per endpoint, so a slow endpoint
    never delays a tick or another client's scrape.
    """

    def __init__(
        self,
        window_s: float,
        min_samples: int,
        scrape_period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch: Callable[[PrometheusSource, float], str] | None = None,
        threads: Supervisor | None = None,
        tokens: TokenTrackers | None = None,
    ) -> None:
        self.tracker = P99Tracker(window_s, min_samples)
        #: An LLM server's TTFT and TPOT reports (``client.report_ttft`` / ``report_tpot``).
        self.tokens = tokens if tokens is not None else TokenTrackers(min_samples)
        self.window_s = window_s
        self.min_samples = min_samples
        self.scrape_period_s = scrape_period_s
        self._clock = clock
        self._fetch = fetch
        self._lock = threading.Lock()
        self._scrapers: dict[str, PrometheusScraper] = {}
        self._workers = EndpointWorkers(
            "latency-scrape", scrape_period_s, self._scrape_one, threads or Supervisor()
        )

    def add_prometheus(self, client_id: str, spec: str) -> PrometheusSource:
        """Scrape a client's histogram from now on.

        Raises:
            ValueError: a malformed or non-local ``--latency-from`` spec, or too many endpoints.
        """
        source = parse_latency_from(spec)
        scraper = PrometheusScraper(
            source,
            self.window_s,
            self.min_samples,
            timeout_s=min(1.0, self.scrape_period_s),
            fetch=self._fetch,
            token_windows_s=(self.tokens.ttft.window_s, self.tokens.tpot.window_s),
        )
        with self._lock:
            self._scrapers[client_id] = scraper
        try:
            self._workers.add(client_id)
        except ValueError:
            with self._lock:
                self._scrapers.pop(client_id, None)
            raise
        return source

    def check_spec(self, spec: str) -> PrometheusSource:
        """Parse a ``--latency-from`` spec and check there is room to scrape one more.

        Raises:
            ValueError: a malformed or non-local spec, or too many endpoints.
        """
        source = parse_latency_from(spec)
        self._workers.check_room("")
        return source

    def forget(self, client_id: str) -> None:
        """Stop tracking a client (it exited); a scrape under way is cut off."""
        self.tracker.forget(client_id)
        self.tokens.forget(client_id)
        self._workers.forget(client_id)
        with self._lock:
            self._scrapers.pop(client_id, None)

    def scrape_all(self) -> None:
        """Scrape every registered endpoint once, in turn (tests; the workers scrape alone)."""
        with self._lock:
            client_ids = list(self._scrapers)
        for client_id in client_ids:
            self._scrape_one(client_id, Cancel())

    def _scrape_one(self, client_id: str, cancel: Cancel) -> None:
        with self._lock:
            scraper = self._scrapers.get(client_id)
        if scraper is not None and not scraper.scrape(self._clock(), cancel):
            log.debug("latency_scrape_failed", client_id=client_id, error=scraper.last_error)

    def start(self) -> None:
        """Start scraping: a worker per endpoint, now and as they are added."""
        self._workers.start()

    def scrapers_alive(self) -> int:
        """Endpoint workers whose thread runs."""
        return self._workers.alive()

    def close(self) -> None:
        """Stop every scrape (those under way are cut off)."""
        self._workers.close()

    def p99s(self, now: float | None = None) -> dict[str, LatencyP99]:
        """Every known client's p99; a scraped client's histogram wins over its datagrams.

        An LLM server's TTFT and TPOT p99s ride along (``ttft``, ``tpot``); a client that reports
        only token timings has ``p99_ms`` ``None`` with the reason.
        """
        now = self._clock() if now is None else now
        reporting = self.tracker.clients()
        reporting += sorted(self.tokens.clients() - set(reporting))
        out = {
            cid: dataclasses.replace(self.tracker.p99(cid, now), source="app") for cid in reporting
        }
        with self._lock:
            scrapers = list(self._scrapers.items())
        for client_id, scraper in scrapers:
            out[client_id] = dataclasses.replace(scraper.p99(now), source="prometheus")
        for client_id, p99 in out.items():
            # A scraped histogram (vllm:URL) wins over datagrams here too.
            ttft, tpot = self.tokens.p99s(client_id, now)
            if (ttft is not None and p99.ttft is None) or (tpot is not None and p99.tpot is None):
                out[client_id] = dataclasses.replace(
                    p99, ttft=p99.ttft or ttft, tpot=p99.tpot or tpot
                )
        return out
