"""The probe's sliding window: p99 over the last ``window_s`` and a baseline learned when quiet.

:class:`gpushare.node.probe_manager.ProbeManager` keeps one :class:`ProbeWindow` per GPU. The
simulated node (:mod:`gpushare.sim.node`) reads its probe with the same rules, which live here:
the nearest-rank p99 (:func:`gpushare.stats.percentile`), :data:`BASELINE_MIN_SAMPLES`, a stalled
launch counting as at least its stall (:func:`stalled_ms`), and how a reading is made of them
(:func:`probe_reading`).
"""

from __future__ import annotations

from collections import deque

from gpushare.model import ProbeReading
from gpushare.stats import SortedWindow, percentile

# Baseline: at least this many probe samples taken without offline work.
BASELINE_MIN_SAMPLES = 20
NO_BASELINE = "no baseline yet: needs quiet samples"


def stalled_ms(latency_ms: float, now: float, last_at_s: float, period_s: float) -> float:
    """The window's latency, raised to the stall of a launch that has not come back.

    A probe launch that has not come back is waiting for SMs right now: its latency is at least
    the time since the last sample, less one period.
    """
    return max(latency_ms, (now - last_at_s - period_s) * 1000)


def probe_reading(
    latency_ms: float, run_ms: float, baseline_ms: float | None, samples: int
) -> ProbeReading:
    """The reading of a window with samples: its ratio to the baseline, or why there is none."""
    ratio = latency_ms / baseline_ms if baseline_ms else None
    return ProbeReading(
        latency_ms=latency_ms,
        run_ms=run_ms,
        baseline_ms=baseline_ms,
        ratio=ratio,
        samples=samples,
        reason=None if ratio is not None else NO_BASELINE,
    )


class ProbeWindow:
    """Sliding window of one GPU's probe samples, with a baseline learned without offline work.

    Pure bookkeeping (time is passed in), so it is tested without processes.

    Args:
        window_s: the p99 is taken over the samples of this long.
        baseline_window_s: the baseline is the p99 of quiet samples over this long. When offline
            work runs throughout, the last learned baseline is kept (and its age reported).
        period_s: the probe period, to tell a stalled probe from a slow one.
    """

    def __init__(self, window_s: float, baseline_window_s: float, period_s: float) -> None:
        self.window_s = window_s
        self.baseline_window_s = baseline_window_s
        self.period_s = period_s
        self._samples: deque[tuple[float, float, float]] = deque()
        self._quiet = SortedWindow()
        self.offline_running = True  # until told otherwise, assume the worst: no baseline
        self.baseline_ms: float | None = None
        self.baseline_at_s: float | None = None
        self.last_at_s: float | None = None

    def add(self, at_s: float, latency_ms: float, run_ms: float) -> None:
        """Record one probe sample taken at ``at_s``."""
        self._samples.append((at_s, latency_ms, run_ms))
        self.last_at_s = at_s
        if not self.offline_running:
            self._quiet.add(at_s, latency_ms)
        self._prune(at_s)
        if len(self._quiet) >= BASELINE_MIN_SAMPLES and not self.offline_running:
            self.baseline_ms = self._quiet.percentile(99)
            self.baseline_at_s = at_s

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        self._quiet.drop_before(now - self.baseline_window_s)

    def clear(self) -> None:
        """Forget the samples (not the baseline), e.g. after the worker restarted."""
        self._samples.clear()
        self.last_at_s = None

    def reading(self, now: float, reason_if_empty: str = "no samples yet") -> ProbeReading:
        """The window's p99 at ``now``; a stalled probe counts as at least its stall time."""
        self._prune(now)
        if not self._samples:
            return ProbeReading(baseline_ms=self.baseline_ms, reason=reason_if_empty)
        latency = percentile([s[1] for s in self._samples], 99)
        run = percentile([s[2] for s in self._samples], 99)
        if self.last_at_s is not None:
            latency = stalled_ms(latency, now, self.last_at_s, self.period_s)
        return probe_reading(latency, run, self.baseline_ms, len(self._samples))
