"""One client's p99 over a sliding window of reported latencies, the answer every source gives.

:class:`LatencyP99` is the answer (a p99 in milliseconds, or ``None`` and why); :class:`P99Tracker`
keeps each client's reports from :mod:`gpushare.latency.receiver` and ranks them (nearest rank).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

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
