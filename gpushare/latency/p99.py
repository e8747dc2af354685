"""One client's p99 over a sliding window of reported latencies, the answer every source gives.

:class:`LatencyP99` is the answer (a p99 in milliseconds, or ``None`` and why); :class:`P99Tracker`
keeps each client's reports from :mod:`gpushare.latency.receiver` in a
:class:`gpushare.stats.SortedWindow` and ranks them (nearest rank).
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
