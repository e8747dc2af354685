"""The GPU model: a virtual clock, an event queue, and SMs shared by MPS clients.

A GPU has ``sm_count`` SMs. Every client owns one stream (a PyTorch process issues its kernels in
order on its default stream), so at most one of its kernels runs at a time. A kernel can use up to
``width`` SMs; under MPS a client also never holds more than its cap (its active-thread percentage of
the SMs). When SMs are free they go to the kernels that want them in order of (MPS priority, the time
the kernel became eligible): a kernel that is running with fewer SMs than it wants grows into SMs as
they free up (the hardware block scheduler dispatches remaining blocks to any SM with room), a
kernel that started is never preempted, and it keeps its SMs until it ends.

A kernel of duration ``d`` (alone, at its full width ``w``) that holds ``g < w`` SMs runs at the rate
``1 / ((1 - f) + f * w / g)``: an Amdahl-style law whose parallel fraction ``f`` is calibrated on the
iGniter V100 curves. Co-running kernels of other clients slow it further by a memory-bandwidth
factor ``1 + beta * e_self * sum_j(g_j / N * e_j)`` with ``e = 0.25 + 0.75 * memory_boundness``.
Both are evaluated when a kernel starts or grows (see ``docs/simulator.md`` for sources and limits).

``mode = "time_slice"`` models the default compute mode without MPS: one client (context) at a
time owns the GPU, for ``slice_s`` at least, switching at a kernel boundary after its slice ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

GpuMode = Literal["mps", "time_slice"]

#: Parallel fraction of the run-time law; iGniter V100 large-batch curves (docs/simulator.md).
DEFAULT_PARALLEL_FRACTION = 0.95
#: Memory-bandwidth interference coefficient (docs/simulator.md).
DEFAULT_BW_BETA = 0.6
#: Time slice of the default (time-sliced) compute mode; NVIDIA does not document it.
DEFAULT_SLICE_S = 0.002


class EventLoop:
    """A virtual clock and a heap of timed callbacks; deterministic for equal inputs."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self.events = 0
        self.end_s = 0.0

    def at(self, time_s: float, callback: Callable[[Any], None], arg: object = None) -> None:
        """Run ``callback(arg)`` at virtual time ``time_s`` (never earlier than now)."""
        heapq.heappush(self._heap, (max(time_s, self.now), next(self._seq), callback, arg))

    def run_until(self, end_s: float) -> None:
        """Process every event up to ``end_s``, then set the clock to ``end_s``."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        self.end_s = end_s
        while heap and heap[0][0] <= end_s:
            t, _, callback, arg = pop(heap)
            self.now = t
            callback(arg)
            n += 1
        self.events += n
        self.now = max(self.now, end_s)


class Stream(Protocol):
    """A client as the GPU sees it: one in-order stream of kernels."""

    cid: str
    priority: int
    cap_sms: int
    run: Run | None
    #: The stream's :class:`Run` record, reused for each of its kernels (None before the first).
    spare: Run | None
    #: What :meth:`head` returns, as an attribute: the scheduler reads it on every event.
    nxt: tuple[float, int, float] | None
    eligible_since: float
    held_max: int

    def head(self) -> tuple[float, int, float] | None:
        """The next kernel ``(dur_s, width, memory_boundness)`` if one is issued, else None."""
        ...

    def on_kernel_done(self, now: float) -> None:
        """The running kernel completed at ``now``."""
        ...


@dataclass(slots=True, eq=False)
class Run:
    """A kernel on the GPU: SMs held, remaining work (fraction of the kernel), progress rate."""

    stream: Stream
    dur_s: float
    width: int
    mem_e: float
    want: int
    since: float
    g: int = 0
    remaining: float = 1.0
    rate: float = 0.0
    last_s: float = 0.0
    version: int = 0
    #: ``g * mem_e``: this kernel's term of the bandwidth sum (G8), kept with ``g``.
    bw: float = 0.0


@dataclass(slots=True)
class GpuStats:
    """Integrals since the last reset, for busy fraction and SM activity."""

    busy_s: float = 0.0
    sm_s: float = 0.0
    since_s: float = 0.0
    kernels_started: int = 0
    kernels_done: int = 0
    kernels_killed: int = 0


class Gpu:
    """One simulated GPU: SM allocation, kernel progress and accounting."""

    def __init__(
        self,
        loop: EventLoop,
        *,
        uuid: str,
        index: int,
        sm_count: int = 80,
        mem_total_bytes: int = 16 << 30,
        parallel_fraction: float = DEFAULT_PARALLEL_FRACTION,
        bw_beta: float = DEFAULT_BW_BETA,
        mode: GpuMode = "mps",
        slice_s: float = DEFAULT_SLICE_S,
    ) -> None:
        self.loop = loop
        self.uuid = uuid
        self.index = index
        self.sm_count = sm_count
        self.mem_total_bytes = mem_total_bytes
        self.f = parallel_fraction
        self.beta = bw_beta
        self.mode: GpuMode = mode
        self.slice_s = slice_s
        self.streams: list[Stream] = []
        self.free = sm_count
        self.runs: list[Run] = []
        self.stats = GpuStats()
        self._last_change = 0.0
        self._dispatch_pending = False
        self._active: Stream | None = None
        self._active_since = 0.0
        self._slice_timer_for = -1.0
        self._cum_busy_s = 0.0
        self._cum_sm_s = 0.0
        self._serial = 1.0 - parallel_fraction
        #: Run uncontended stretches inline (exact; False only to test that it is).
        self.fast_path = True
        self._beta_per_sm = bw_beta / sm_count

    # --- clients -------------------------------------------------------------------------------

    def attach(self, stream: Stream) -> None:
        """Connect a client; it may issue kernels from now on."""
        if stream not in self.streams:
            self.streams.append(stream)
        self.wake()

    def detach(self, stream: Stream) -> int:
        """Disconnect a client, killing its running kernel. Returns kernels killed (0 or 1)."""
        killed = self.kill_running(stream)
        if stream in self.streams:
            self.streams.remove(stream)
        if self._active is stream:
            self._active = None
        self.wake()
        return killed

    def kill_running(self, stream: Stream) -> int:
        """Kill the client's running kernel (``terminate_client``); its SMs free at once."""
        run = stream.run
        if run is None:
            return 0
        self._account()
        run.version += 1
        self.free += run.g
        self.runs.remove(run)
        stream.run = None
        self.stats.kernels_killed += 1
        self.wake()
        return 1

    def wake(self) -> None:
        """A kernel may have become eligible: allocate SMs at the current time."""
        if not self._dispatch_pending:
            self._dispatch_pending = True
            self.loop.at(self.loop.now, self._dispatch_event)

    # --- accounting ----------------------------------------------------------------------------

    def _account(self) -> None:
        now = self.loop.now
        dt = now - self._last_change
        if dt > 0.0:
            held = self.sm_count - self.free
            if held:
                self.stats.busy_s += dt
                self.stats.sm_s += held * dt
            self._last_change = now

    def take_stats(self) -> GpuStats:
        """Return the integrals since the last call and start new ones."""
        self._account()
        stats = self.stats
        self._cum_busy_s += stats.busy_s
        self._cum_sm_s += stats.sm_s
        self.stats = GpuStats(since_s=self.loop.now)
        return stats

    def totals(self) -> tuple[float, float]:
        """Busy seconds and SM-seconds since the GPU was created (for NVML-like readings)."""
        self._account()
        return self._cum_busy_s + self.stats.busy_s, self._cum_sm_s + self.stats.sm_s

    @property
    def held_sms(self) -> int:
        """SMs held by running kernels now."""
        return self.sm_count - self.free

    # --- scheduling ----------------------------------------------------------------------------

    def _set_alloc(self, run: Run, g: int, now: float) -> None:
        if run.g:
            run.remaining -= (now - run.last_s) * run.rate
        run.g = g
        run.bw = g * run.mem_e
        run.last_s = now
        # The rate law (G7, G8 in docs/simulator.md), inlined: this is the hot path.
        w = run.width
        slow = 1.0 if g >= w else self._serial + self.f * w / g
        runs = self.runs
        if len(runs) > 1 and self.beta > 0.0:
            other = 0.0
            for r in runs:
                if r is not run:
                    other += r.bw
            slow *= 1.0 + self._beta_per_sm * run.mem_e * other
        rate = 1.0 / (run.dur_s * slow)
        run.rate = rate
        run.version += 1
        stream = run.stream
        if g > stream.held_max:
            stream.held_max = g
        remaining = run.remaining if run.remaining > 0.0 else 0.0
        loop = self.loop
        heapq.heappush(
            loop._heap,
            (now + remaining / rate, next(loop._seq), self._complete, (run, run.version)),
        )

    def _complete(self, arg: tuple[Run, int]) -> None:
        run, version = arg
        if run.version != version:
            return
        now = self.loop.now
        stats = self.stats
        # Accounting (see _account), inlined.
        dt = now - self._last_change
        if dt > 0.0:
            held = self.sm_count - self.free
            if held:
                stats.busy_s += dt
                stats.sm_s += held * dt
            self._last_change = now
        self.free += run.g
        self.runs.remove(run)
        stream = run.stream
        stream.run = None
        stats.kernels_done += 1
        stream.on_kernel_done(now)
        self._dispatch(stream)

    def _run_on(self, stream: Stream) -> None:
        """Fast path: run a stream's next kernels inline while nothing else can change.

        Called only when no other stream waits for SMs (none has an issued kernel not yet started,
        none runs below its width): then the kernels the completing stream starts next take the SMs it just freed,
        and every other kernel keeps its SMs and rate (G8 evaluates bandwidth when a kernel starts
        or grows). So each next kernel's end time is known exactly, and the loop runs them without
        the event queue until one would end at or after the next pending event (a completion of
        another stream, an arrival, a probe, a duty edge, the end of the period).
        """
        runs = self.runs
        loop = self.loop
        heap = loop._heap
        limit = min(heap[0][0], loop.end_s) if heap else loop.end_s
        now = loop.now
        cap = stream.cap_sms
        f = self.f
        serial = self._serial
        free = self.free
        held_others = self.sm_count - free
        other_bw = 0.0
        if runs and self.beta > 0.0:
            other_bw = sum(r.bw for r in runs)
        beta_per_sm = self._beta_per_sm
        stats = self.stats
        while True:
            head = stream.nxt
            if head is None:
                break
            dur, width, mem = head
            g = width if width < cap else cap
            if g > free:
                g = free
            if g <= 0:
                break
            slow = 1.0 if g >= width else serial + f * width / g
            if other_bw:
                slow *= 1.0 + beta_per_sm * (0.25 + 0.75 * mem) * other_bw
            # The arithmetic of a kernel started through the event queue, to the last bit.
            t_end = now + 1.0 / (1.0 / (dur * slow))
            if t_end >= limit:
                break
            dt = t_end - now
            stats.busy_s += dt
            stats.sm_s += (held_others + g) * dt
            stats.kernels_started += 1
            stats.kernels_done += 1
            if g > stream.held_max:
                stream.held_max = g
            now = t_end
            loop.now = now
            self._last_change = now
            stream.on_kernel_done(now)

    def _dispatch_event(self, _: object) -> None:
        self._dispatch_pending = False
        self._dispatch()

    def _dispatch(self, completing: Stream | None = None) -> None:
        """Give free SMs to the kernels that want them, most urgent first.

        One scan collects every stream that wants SMs (an issued kernel not started, or a kernel
        running below its width); they are served in order of (MPS priority, eligible time).
        When the only one is the stream whose kernel just completed, its uncontended stretch runs
        inline first (:meth:`_run_on`). This is the simulator's hot path: the start of a kernel
        (:meth:`_set_alloc` for a fresh run) is inlined with the same arithmetic, in the same order.
        """
        if self.free <= 0:
            return
        loop = self.loop
        now = loop.now
        if self.mode == "time_slice":
            allowed = self._time_slice_owner(now)
            if allowed is None:
                return
            streams: list[Stream] = [allowed]
            full = self.sm_count
        else:
            streams = self.streams
            full = 0
        cands: list[tuple[int, float, int, Stream, tuple[float, int, float] | None]] = []
        for i, s in enumerate(streams):
            run = s.run
            if run is None:
                head = s.nxt
                if head is not None:
                    cands.append((s.priority, s.eligible_since, i, s, head))
            elif run.g < run.want:
                cands.append((s.priority, run.since, i, s, None))
        if not cands:
            return
        if len(cands) > 1:
            cands.sort()
        elif completing is not None and cands[0][3] is completing and self.fast_path and not full:
            self._run_on(completing)
            head = completing.nxt
            if head is None:
                return
            cands = [(completing.priority, completing.eligible_since, 0, completing, head)]
            now = loop.now
        if now != self._last_change:
            self._account()
        runs = self.runs
        stats = self.stats
        heap = loop._heap
        seq = loop._seq
        complete = self._complete
        beta_per_sm = self._beta_per_sm if self.beta > 0.0 else 0.0
        for _, since, _, s, head in cands:
            free = self.free
            if free <= 0:
                break
            run = s.run
            if run is not None:
                g = run.g + free
                if g > run.want:
                    g = run.want
                self.free = free - (g - run.g)
                self._set_alloc(run, g, now)
                continue
            assert head is not None
            dur, width, mem = head
            cap = full or s.cap_sms
            want = width if width < cap else cap
            mem_e = 0.25 + 0.75 * mem
            g = want if want < free else free
            self.free = free - g
            # A fresh run (g was 0, remaining 1): _set_alloc inlined, with the same arithmetic.
            # The stream's Run record is reused; its version keeps growing, so an event left
            # over from an earlier kernel never matches.
            run = s.spare
            if run is None:
                run = s.spare = Run(s, dur, width, mem_e, want, since)
            else:
                run.dur_s = dur
                run.width = width
                run.mem_e = mem_e
                run.want = want
                run.since = since
                run.remaining = 1.0
            s.run = run
            stats.kernels_started += 1
            run.g = g
            run.bw = g * mem_e
            run.last_s = now
            slow = 1.0 if g >= width else self._serial + self.f * width / g
            if runs and beta_per_sm:
                other = 0.0
                for r in runs:
                    other += r.bw
                slow *= 1.0 + beta_per_sm * mem_e * other
            runs.append(run)
            rate = 1.0 / (dur * slow)
            run.rate = rate
            version = run.version + 1
            run.version = version
            if g > s.held_max:
                s.held_max = g
            heapq.heappush(heap, (now + 1.0 / rate, next(seq), complete, (run, version)))

    def _time_slice_owner(self, now: float) -> Stream | None:
        """The context that may issue to the GPU now under time-slicing (None: wait)."""
        active = self._active
        others = [s for s in self.streams if s is not active and s.head() is not None]
        if active is not None and active in self.streams:
            busy = active.run is not None or active.head() is not None
            if busy and (not others or now - self._active_since < self.slice_s):
                if others:
                    self._arm_slice_timer(self._active_since + self.slice_s)
                return active
            if active.run is not None:
                return None  # slice over: switch once the running kernel ends
        if not others:
            return active if active is not None and active.head() is not None else None
        # Round robin: the next context after the active one in attach order.
        order = self.streams
        start = order.index(active) + 1 if active in order else 0
        for k in range(len(order)):
            s = order[(start + k) % len(order)]
            if s is not active and s.head() is not None:
                self._active = s
                self._active_since = now
                self._arm_slice_timer(now + self.slice_s)
                return s
        return None  # pragma: no cover - others is non-empty

    def _arm_slice_timer(self, at_s: float) -> None:
        if at_s > self._slice_timer_for:
            self._slice_timer_for = at_s
            self.loop.at(at_s, self._dispatch_event_slice)

    def _dispatch_event_slice(self, _: object) -> None:
        self._dispatch()
