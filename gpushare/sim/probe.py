"""The simulated latency probe: a tiny kernel every period, and what the daemon reads of it.

:class:`ProbeClient` launches one kernel of ``kernel_s`` every probe period at MPS priority 0 and
records how long it waited and ran, like gpushare's cuda-python probe
(:mod:`gpushare.node.probe`); :meth:`ProbeClient.reading` reads its samples with the rules of the
real probe's window (:mod:`gpushare.node.probe_window`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from gpushare.model import ProbeReading
from gpushare.node.probe_window import BASELINE_MIN_SAMPLES, probe_reading, stalled_ms
from gpushare.sim.gpu import EventLoop, Gpu, Stream
from gpushare.sim.workloads import StreamView
from gpushare.stats import SortedWindow, percentile


class ProbeClient(StreamView):
    """gpushare's latency probe: a tiny kernel every period at priority 0, synchronously."""

    cid = "probe"

    def __init__(
        self, gpu: Gpu, *, period_s: float, kernel_s: float = 15e-6, width: int = 1
    ) -> None:
        self.gpu = gpu
        self.stream = Stream(self, self.cid, 0, gpu.sm_count)
        self.period_s = period_s
        self.kernel_s = kernel_s
        self.width = width
        self._pending = False
        self._launched = 0.0
        #: (launch_s, latency_s, offline_running) per probe kernel.
        self.samples: list[tuple[float, float, bool]] = []
        self.offline_running = False
        self.baseline_ms: float | None = None
        self.baseline_at_s: float | None = None
        self.quiet = QuietSamples()

    @property
    def pending_since(self) -> float | None:
        """Launch time of the probe kernel not yet back, if any."""
        return self._launched if self._pending else None

    def start(self, loop: EventLoop) -> None:
        """Attach to the GPU and launch the first probe now."""
        self._loop = loop
        self.gpu.attach(self)
        loop.at(loop.now, self._launch)

    def _launch(self, _: object) -> None:
        loop = self._loop
        if not self._pending:
            self._pending = True
            st = self.stream
            st.nxt = (self.kernel_s, self.width, 0.0, self.kernel_s, 1.0)
            self._launched = loop.now
            st.eligible_since = loop.now
            self.gpu.wake()
        loop.at(loop.now + self.period_s, self._launch)

    def on_kernel_done(self, now: float) -> None:
        """Record wait + run time."""
        self._pending = False
        self.stream.nxt = None
        self.samples.append((self._launched, now - self._launched, self.offline_running))

    def reading(self, now: float, window_s: float, baseline_window_s: float) -> ProbeReading:
        """The probe's reading, with the rules of :mod:`gpushare.node.probe_window`.

        Latency is the p99 over the probe window (a launch not yet back counts as stalled,
        :func:`~gpushare.node.probe_window.stalled_ms`); the baseline is the p99 of the samples
        taken while no offline work ran, over the baseline window ending at the last such sample,
        once there are at least :data:`~gpushare.node.probe_window.BASELINE_MIN_SAMPLES`; when
        offline work runs throughout, the last learned baseline is kept. Unlike the real window,
        samples are stamped at launch, the baseline is learned when read (not at each sample) and
        the run time is the probe kernel's fixed length.
        """
        samples = self.samples
        window = [lat for t, lat, _ in _tail(samples, now - window_s)]
        if not window:
            return ProbeReading(reason="no probe samples yet")
        quiet = self.quiet
        quiet.take(samples)
        quiet_end = quiet.last_s
        if quiet_end is not None and quiet_end != self.baseline_at_s:
            ordered = quiet.since(quiet_end - baseline_window_s)
            if len(ordered) >= BASELINE_MIN_SAMPLES:
                self.baseline_ms = quiet.percentile(99.0) * 1e3
                self.baseline_at_s = quiet_end
        lat_ms = percentile(window, 99.0) * 1e3
        if self.pending_since is not None:
            lat_ms = stalled_ms(lat_ms, now, samples[-1][0], self.period_s)
        return probe_reading(lat_ms, self.kernel_s * 1e3, self.baseline_ms, len(window))

    def forget_before(self, lo: float) -> None:
        """Drop the samples launched before ``lo`` that the quiet window has already taken in."""
        samples, quiet = self.samples, self.quiet
        n = min(bisect.bisect_left(samples, lo, key=lambda s: s[0]), quiet.seen)
        if n:
            del samples[:n]
            quiet.seen -= n


class QuietSamples(SortedWindow):
    """A probe's samples taken without offline work, by launch time, kept sorted by latency.

    The probe appends its samples in launch order; :meth:`take` brings in those not seen yet.
    """

    def __init__(self) -> None:
        super().__init__()
        #: How many of the probe's samples have been taken in (an index into its list).
        self.seen = 0
        self.last_s: float | None = None

    def take(self, samples: list[tuple[float, float, bool]]) -> None:
        """Add the quiet ones among the samples not seen yet."""
        for k in range(self.seen, len(samples)):
            t, lat, offline = samples[k]
            if not offline:
                self.add(t, lat)
                self.last_s = t
        self.seen = len(samples)


def _tail(
    samples: list[tuple[float, float, bool]], lo: float
) -> Iterator[tuple[float, float, bool]]:
    """Samples launched at or after ``lo`` (they are in launch order)."""
    i = len(samples)
    while i > 0 and samples[i - 1][0] >= lo:
        i -= 1
    return iter(samples[i:])
