"""One client's p99 over a sliding window of reported latencies, the answer every source gives.

:class:`LatencyP99` is the answer (a p99 in milliseconds, or ``None`` and why); :class:`P99Tracker`
keeps each client's reports from :mod:`gpushare.latency.receiver` in a
:class:`gpushare.stats.SortedWindow` and ranks them (nearest rank). :class:`TokenTrackers` holds
an LLM server's two token timings (TTFT, TPOT) in trackers of the same kind, with windows sized
for the rates those come at (docs/controller.md, "LLM servers: TTFT and TPOT").
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from gpushare.stats import SortedWindow

P99 = 0.99


@dataclass(frozen=True, slots=True)
class LatencyP99:
    """One client's app-reported p99 over the window; ``None`` with ``reason`` when unknown.

    ``source`` is where it came from: ``"app"`` (datagrams of ``report_latency``) or
    ``"prometheus"`` (a ``--latency-from`` histogram);
    :meth:`gpushare.latency.app.AppLatency.p99s` sets it. ``reason`` is shown to every user;
    ``error_detail_owner_only`` may quote text fetched from the client's own URL and must be
    shown to that client's owner (and root) only.
    """

    p99_ms: float | None
    samples: int
    reason: str | None = None
    source: str | None = None
    error_detail_owner_only: str | None = None
    ttft: LatencyP99 | None = None
    """An LLM server's p99 time to first token; ``None`` when it reports none."""
    tpot: LatencyP99 | None = None
    """An LLM server's p99 time per output token; ``None`` when it reports none."""


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
        self._values: dict[str, SortedWindow] = {}

    def add(self, client_id: str, seconds: float, at_s: float) -> None:
        """Record one report."""
        self.add_many(client_id, ((at_s, seconds),))

    def add_many(self, client_id: str, reports: Iterable[tuple[float, float]]) -> None:
        """Record ``(at_s, seconds)`` reports of one client, in the order they were made."""
        with self._lock:
            window = self._values.get(client_id)
            if window is None:
                window = self._values[client_id] = SortedWindow(self.max_samples)
            for at_s, seconds in reports:
                window.add(at_s, seconds)

    def forget(self, client_id: str) -> None:
        """Drop a client's reports (it exited)."""
        with self._lock:
            self._values.pop(client_id, None)

    def has(self, client_id: str) -> bool:
        """Whether the client reported at least once and was not forgotten."""
        with self._lock:
            return client_id in self._values

    def clients(self) -> list[str]:
        """Clients that reported at least once and were not forgotten."""
        with self._lock:
            return list(self._values)

    def p99(self, client_id: str, now: float) -> LatencyP99:
        """The client's p99 over the window ending at ``now``."""
        with self._lock:
            window = self._values.get(client_id)
            if window is None:
                return LatencyP99(None, 0, "no latency reports")
            window.drop_before(now - self.window_s)
            n = len(window)
            if n < self.min_samples:
                return LatencyP99(
                    None,
                    n,
                    f"only {n} reports in the last {self.window_s:g}s (needs {self.min_samples})",
                )
            return LatencyP99(window.percentile(99.0) * 1000.0, n)


class TokenTrackers:
    """An LLM server's token timings: time to first token (TTFT) and per output token (TPOT).

    A TTFT comes once per request, and an LLM server finishes a few requests a second or fewer,
    so the request window (``[latency] window``, 2 s) would never hold ``min_samples`` of them.
    Its window is therefore sized by count: the last ``ttft_max_samples`` first tokens, but none
    older than ``ttft_window_s`` (at 0.2 requests/s, 120 s holds 24). A TPOT comes once per
    further token (or once per request, as the service reports it), tens to hundreds a second, so
    its window is shorter.

    Args:
        min_samples: fewer reports than this in a window give no p99 (``[latency] min_samples``).
        ttft_window_s: the oldest TTFT the p99 covers (``[latency] ttft_window``).
        ttft_max_samples: the most recent TTFTs kept (``[latency] ttft_max_samples``).
        tpot_window_s: the oldest TPOT the p99 covers (``[latency] tpot_window``).
        tpot_max_samples: the most recent TPOTs kept (``[latency] tpot_max_samples``).
    """

    def __init__(
        self,
        min_samples: int,
        *,
        ttft_window_s: float = 120.0,
        ttft_max_samples: int = 200,
        tpot_window_s: float = 120.0,
        tpot_max_samples: int = 5000,
    ) -> None:
        self.ttft = P99Tracker(ttft_window_s, min_samples, ttft_max_samples)
        self.tpot = P99Tracker(tpot_window_s, min_samples, tpot_max_samples)

    def forget(self, client_id: str) -> None:
        """Drop a client's token timings (it exited)."""
        self.ttft.forget(client_id)
        self.tpot.forget(client_id)

    def clients(self) -> set[str]:
        """Clients that reported a token timing and were not forgotten."""
        return set(self.ttft.clients()) | set(self.tpot.clients())

    def p99s(self, client_id: str, now: float) -> tuple[LatencyP99 | None, LatencyP99 | None]:
        """The client's TTFT and TPOT p99s; ``None`` for a timing it never reported."""
        ttft = self.ttft.p99(client_id, now) if self.ttft.has(client_id) else None
        tpot = self.tpot.p99(client_id, now) if self.tpot.has(client_id) else None
        return ttft, tpot
