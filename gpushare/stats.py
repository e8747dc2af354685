"""Windowed statistics: percentiles and sliding windows of timestamped values, in one place.

Every latency figure gpushare reads goes through here: the probe's window
(:mod:`gpushare.node.probe_window`), each client's app-reported p99 (:mod:`gpushare.latency.p99`),
a scraped histogram's p99 (:mod:`gpushare.latency.prometheus`) and the simulator's probe and
results (:mod:`gpushare.sim.node`, :mod:`gpushare.sim.results`).

Two percentile methods, named, because the sources differ in what they hold:

* :func:`percentile` / :func:`percentile_sorted`: **nearest rank** over raw values (the probe, app
  reports, the simulator): the value at rank ``ceil(q/100 * n)``, never an interpolation.
* :func:`bucket_quantile`: **linear inside a histogram bucket**, PromQL's ``histogram_quantile``,
  for counts where raw values are not known.

Pure: no I/O, no clock (times are passed in), no threads (callers that share a window lock it).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` percentile (0-100] of ``values`` by the nearest-rank method; NaN for no values."""
    return percentile_sorted(sorted(values), q)


def percentile_sorted(ordered: Sequence[float], q: float) -> float:
    """:func:`percentile` of values already sorted in ascending order."""
    if not ordered:
        return math.nan
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """``histogram_quantile`` on cumulative counts: linear inside the bucket; ``None`` if empty.

    ``q`` is a fraction (0.99). A rank that falls in the ``+Inf`` bucket returns the largest finite
    bound, as PromQL does.
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


class SortedWindow:
    """Values with the time each was taken, kept sorted by value, the oldest dropped by time.

    What sorting the values taken since ``lo`` gives, kept incrementally so a percentile every
    tick costs no sort of the whole window. Values are added in time order and ``lo`` never goes
    back.

    Args:
        max_len: at most this many values; adding one more drops the oldest (bounded memory).
    """

    def __init__(self, max_len: int | None = None) -> None:
        self._by_time: deque[tuple[float, float]] = deque(maxlen=max_len)
        self._sorted: list[float] = []

    def add(self, at_s: float, value: float) -> None:
        """Add one value taken at ``at_s`` (no earlier than the last one added)."""
        by_time = self._by_time
        if len(by_time) == by_time.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, by_time[0][1])]
        by_time.append((at_s, value))
        bisect.insort(self._sorted, value)

    def drop_before(self, lo: float) -> None:
        """Forget the values taken before ``lo``."""
        by_time, ordered = self._by_time, self._sorted
        while by_time and by_time[0][0] < lo:
            del ordered[bisect.bisect_left(ordered, by_time.popleft()[1])]

    def since(self, lo: float) -> list[float]:
        """The values taken at or after ``lo``, sorted ascending (the window's own list)."""
        self.drop_before(lo)
        return self._sorted

    def percentile(self, q: float) -> float:
        """The nearest-rank ``q`` percentile of the values in the window; NaN when empty."""
        return percentile_sorted(self._sorted, q)

    def __len__(self) -> int:
        return len(self._sorted)
