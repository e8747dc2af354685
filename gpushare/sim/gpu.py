"""The GPU model: a virtual clock, an event queue, and SM slots shared by MPS clients.

A GPU has ``sm_count`` SM slots: one slot is one SM's worth of the resource that limits a kernel's
occupancy (threads, registers or shared memory). A kernel of width ``w`` (Orion's ``SM_usage``
capped at the GPU) holds up to ``w`` slots; blocks are spread over every SM, so a narrow kernel
leaves room on each SM for the blocks of other clients (co-residency), which cost each other
bandwidth and issue slots (the contention factor below). Every client owns one in-order stream,
so at most one of its kernels runs at a time; under MPS a client also never holds more than its
cap (its active-thread percentage of the slots).

A kernel runs as waves of blocks (``wave_s`` long each, from :func:`gpushare.sim.data.wave_s`).
Slots are handed out at dispatch points: when a kernel starts, when one ends, at the end of a
wave of a kernel that someone of higher priority waits for, and when the partial last wave of a
kernel that someone of its own priority waits for starts. There the slots go first to the waiting
work of the highest MPS priority; within one priority the earliest grid's blocks go first and
later grids get what is left (``share = "fifo"``, the model), or the slots are shared max-min
fairly (``share = "fair"``, the alternative kept for the sensitivity table). The next kernel of a
stream whose kernel just ended is served after the others (its dependency resolves while the
block scheduler refills the slots). A running wave is never preempted; a kernel with a single
wave keeps its slots until it ends.

A kernel of duration ``d`` (alone, at its full width ``w``) that holds ``g < w`` slots runs at the
rate ``1 / ((1 - f) + f * w / g)``: an Amdahl-style law whose parallel fraction ``f`` is calibrated
on the iGniter V100 curves. Co-running kernels of other clients slow it further by a contention
factor ``1 + beta * e_self * sum_j(g_j / N * e_j)`` with ``e = 0.25 + 0.75 * memory_boundness``.
Both are evaluated when a kernel starts or its slots change (``docs/simulator.md``: sources,
limits).

``mode = "time_slice"`` models the default compute mode without MPS: one client (context) at a
time owns the GPU for ``slice_s``; when the slice ends and another context has work, the running
kernel is preempted mid-flight (compute preemption, Pascal and later), the GPU idles ``switch_s``
(context save and restore) and the next context resumes where it was stopped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

GpuMode = Literal["mps", "time_slice"]

# The heap functions bound once: compiled, ``heapq.heappush`` is a module attribute look-up per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop

#: Parallel fraction of the run-time law; iGniter V100 large-batch curves (docs/simulator.md).
DEFAULT_PARALLEL_FRACTION = 0.95
#: Memory-bandwidth interference coefficient (docs/simulator.md).
DEFAULT_BW_BETA = 0.6
#: Time slice of the default (time-sliced) compute mode (docs/simulator.md G9): the driver's
#: default TSG timeslice, 1024 us (NVIDIA open-gpu-kernel-modules,
#: ``kfifoChannelGroupGetDefaultTimeslice_GV100``: ``TIMEOUT_128 << SCALE_3``; nvgpu's
#: ``NVGPU_TSG_TIMESLICE_DEFAULT_US`` is the same ``128 << 3``).
DEFAULT_SLICE_S = 1.024e-3
#: Cost of a context switch under time-slicing (G9): calibrated on three published A100
#: time-slicing points (3, 5 and 7 saturated clients take 1.108-1.110 x N their time alone, an
#: 11 % overhead per slice whatever N; gpushare/data/validation/): ``slice x mean(ratio/N - 1)``.
#: Saving and restoring a V100's register files and shared memory alone (27.5 MiB at ~900 GB/s)
#: would take ~64 us.
DEFAULT_SWITCH_S = 112e-6

#: A kernel as a stream exposes it: ``(dur_s, width, memory_boundness, wave_s, tail)``; ``tail``
#: is the fraction of its slots the last of several waves fills (1.0: full, or a single wave).
Kernel = tuple[float, int, float, float, float]
#: Sort key of a kernel served after every other candidate at a dispatch point (see _dispatch).
DEFERRED = 1 << 30
#: How slots are shared among kernels of one MPS priority (docs/simulator.md G5).
ShareRule = Literal["fifo", "fair"]
#: What a :class:`Timer` is for: a kernel's completion, or the end of one of its waves.
TIMER_DONE: Final = 0
TIMER_WAVE_END: Final = 1


class EventLoop:
    """A virtual clock, a heap of timed callbacks and the kernels' completions; deterministic.

    Events run in the order of ``(time, sequence number)``, the number counting every event
    scheduled. A kernel's completion and its next wave end are not heap entries: each
    :class:`Run` keeps one :class:`Timer` for each, moved or cancelled in place when the kernel's
    slots or rate change (a heap entry could not be moved, only left to pop and be ignored: those
    stale entries were most of the heap and of the events popped), and they run in the same
    order as heap entries would.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        #: The kernels' pending timers (a timer's ``slot`` is its index here).
        self._due: list[Timer] = []
        #: The earliest of them (by time, then sequence number), or None.
        self._first: Timer | None = None
        self.events = 0
        self.end_s = 0.0

    def at(self, time_s: float, callback: Callable[[Any], None], arg: object = None) -> None:
        """Run ``callback(arg)`` at virtual time ``time_s`` (never earlier than now)."""
        seq = self._seq
        self._seq = seq + 1
        _heappush(self._heap, (max(time_s, self.now), seq, callback, arg))

    def arm(self, timer: Timer, time_s: float) -> None:
        """Make the timer due at ``time_s``, replacing the time it had (if pending)."""
        seq = self._seq
        self._seq = seq + 1
        old_s = timer.due_s
        timer.due_s = time_s
        timer.due_seq = seq
        first = self._first
        if timer.slot < 0:
            timer.slot = len(self._due)
            self._due.append(timer)
        elif first is timer:
            if not time_s < old_s:
                self._find_first()  # moved later: another may now be first
            return
        # The newest sequence number loses every tie.
        if first is None or time_s < first.due_s:
            self._first = timer

    def disarm(self, timer: Timer) -> None:
        """Cancel the timer (not pending: nothing to do)."""
        k = timer.slot
        if k < 0:
            return
        due = self._due
        last = due.pop()
        if last is not timer:
            due[k] = last
            last.slot = k
        timer.slot = -1
        if self._first is timer:
            self._find_first()

    def _find_first(self) -> None:
        best: Timer | None = None
        for r in self._due:
            if (
                best is None
                or r.due_s < best.due_s
                or (r.due_s == best.due_s and r.due_seq < best.due_seq)
            ):
                best = r
        self._first = best

    def next_at(self, end_s: float) -> float:
        """The time of the next event, or ``end_s`` when none is due before it."""
        t = end_s
        heap = self._heap
        if heap:
            h = heap[0][0]
            if h < t:
                t = h
        first = self._first
        if first is not None and first.due_s < t:
            t = first.due_s
        return t

    def run_until(self, end_s: float) -> None:
        """Process every event up to ``end_s``, then set the clock to ``end_s``."""
        heap = self._heap
        pop = _heappop
        n = 0
        self.end_s = end_s
        while True:
            c = self._first
            if heap:
                h = heap[0]
                t = h[0]
                if c is None or t < c.due_s or (t == c.due_s and h[1] < c.due_seq):
                    if t > end_s:
                        break
                    _, _, callback, arg = pop(heap)
                    self.now = t
                    callback(arg)
                    n += 1
                    continue
            elif c is None:
                break
            t = c.due_s
            if t > end_s:
                break
            self.disarm(c)
            self.now = t
            run = c.run
            if c.kind == TIMER_DONE:
                run.gpu._complete(run)
            else:
                run.gpu._wave_end(c)
            n += 1
        self.events += n
        self.now = max(self.now, end_s)


class Timer:
    """A pending event of one kernel kept on its :class:`Run`: its completion or its wave end."""

    def __init__(self, run: Run, kind: int) -> None:
        self.run = run
        self.kind = kind
        self.due_s = 0.0
        self.due_seq = 0
        #: Index in the loop's pending timers, or -1 when not pending.
        self.slot = -1
        #: A wave end: the kernel (``Run.kseq``) it was armed for.
        self.kseq = 0


class Client(Protocol):
    """A simulated client as the GPU sees it: its :class:`Stream`, told when a kernel ends."""

    stream: Stream

    def on_kernel_done(self, now: float) -> None:
        """The running kernel completed at ``now``."""
        ...


class Stream:
    """One client's in-order stream of kernels: what the GPU model reads and writes of it.

    The client keeps its next kernel here (``nxt``) and the GPU its running one (``run``). It is a
    class of this module, not the client itself, so that the compiled engine reads these fields
    directly; on a client (a plain Python object) each was a generic attribute look-up, and the
    scheduler reads them on every event.
    """

    def __init__(self, client: Client, cid: str, priority: int, cap_sms: int) -> None:
        self.client = client
        self.cid = cid
        #: MPS client priority (0 high) and the SM slots it may hold (its MPS cap).
        self.priority = priority
        self.cap_sms = cap_sms
        #: The running kernel, or None.
        self.run: Run | None = None
        #: The stream's :class:`Run` record, reused for each of its kernels (None before the first).
        self.spare: Run | None = None
        #: The next kernel ``(dur_s, width, memory_boundness, wave_s, tail)`` if issued, else None.
        self.nxt: Kernel | None = None
        #: When ``nxt`` was issued (the order among waiting kernels of one priority).
        self.eligible_since = 0.0
        #: The most slots it ever held.
        self.held_max = 0
        # Gpu._dispatch's view of it as a candidate: sort key (priority, since, index), its next
        # kernel or its run, the slots it holds, wants and gets; and as a waiter left short, for
        # _arm_waves: its priority and the slots it holds. Fields of a native record, they cost
        # the compiled engine no tuple to build or unpack.
        self.c_prio = 0
        self.c_since = 0.0
        self.c_index = 0
        self.c_head: Kernel | None = None
        self.c_run: Run | None = None
        self.c_held = 0
        self.c_want = 0
        self.c_final = 0
        self.w_prio = 0
        self.w_has = 0


@dataclass(slots=True)
class GpuStats:
    """Integrals since the last reset, for busy fraction and SM activity."""

    busy_s: float = 0.0
    sm_s: float = 0.0
    since_s: float = 0.0
    kernels_started: int = 0
    kernels_done: int = 0
    kernels_killed: int = 0
    wave_yields: int = 0
    context_switches: int = 0


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
        switch_s: float = DEFAULT_SWITCH_S,
        wave_scale: float = 1.0,
        share: ShareRule = "fifo",
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
        self.switch_s = switch_s
        #: The wave rule's one parameter (docs/simulator.md G6); the clients read it when they
        #: compute their kernels' wave lengths.
        self.wave_scale = wave_scale
        self.share: ShareRule = share
        self._fair = share == "fair"
        self._ts = mode == "time_slice"
        self._switch_until = 0.0
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

    def attach(self, client: Client) -> None:
        """Connect a client; it may issue kernels from now on."""
        stream = client.stream
        if stream not in self.streams:
            self.streams.append(stream)
        self.wake()

    def detach(self, client: Client) -> int:
        """Disconnect a client, killing its running kernel. Returns kernels killed (0 or 1)."""
        killed = self.kill_running(client)
        stream = client.stream
        if stream in self.streams:
            self.streams.remove(stream)
        if self._active is stream:
            self._active = None
        self.wake()
        return killed

    def kill_running(self, client: Client) -> int:
        """Kill the client's running kernel (``terminate_client``); its SMs free at once."""
        stream = client.stream
        run = stream.run
        if run is None:
            return 0
        self._account()
        self.loop.disarm(run.done)
        if run.g > 0:
            self.free += run.g
            self.runs.remove(run)
            run.g = 0
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
        else:
            # Slots again after none (a yielded or preempted kernel): a new train of waves.
            self.runs.append(run)
            run.t0 = now
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
        stream = run.stream
        if g > stream.held_max:
            stream.held_max = g
        remaining = run.remaining if run.remaining > 0.0 else 0.0
        self.loop.arm(run.done, now + remaining / rate)

    def _release(self, run: Run) -> None:
        """Take every slot from a running kernel, keeping its progress (it stays the stream's)."""
        self._account()
        now = self.loop.now
        run.remaining -= (now - run.last_s) * run.rate
        run.last_s = now
        self.loop.disarm(run.done)  # its completion is cancelled
        run.wave_at = -1.0  # and its wave end no longer matches
        self.free += run.g
        run.g = 0
        run.bw = 0.0
        self.runs.remove(run)

    def _wave_end(self, timer: Timer) -> None:
        """A wave of a kernel someone waits for ends: its slots are dispatched again (G5, G6)."""
        run = timer.run
        if (
            run.kseq != timer.kseq
            or run.wave_at != timer.due_s
            or run.g == 0
            or run.stream.run is not run
        ):
            return
        run.wave_at = -1.0
        if not self._waiter_gains(run):
            return  # whoever waited was served meanwhile: the blocks go on as they were
        self._release(run)
        self.stats.wave_yields += 1
        self._dispatch()

    def _waiter_gains(self, run: Run) -> bool:
        """Whether some other stream now waits for slots this kernel would give up (G5)."""
        own = run.stream
        p = own.priority
        fair = self._fair
        for s in self.streams:
            if s is own:
                continue
            # Whether it waits first, its priority only then.
            r = s.run
            if r is None:
                if s.nxt is None:
                    continue
                has = 0
            elif r.g < r.want:
                has = r.g
            else:
                continue
            sp = s.priority
            if sp < p or (sp == p and fair and has + 1 < run.g):
                return True
        return False

    def _tail_start(self, arg: tuple[Run, int]) -> None:
        """A kernel's last, partial wave starts: the slots it leaves empty go to waiting work."""
        run, kseq = arg
        if run.kseq != kseq or run.g == 0 or run.stream.run is not run:
            return
        g = max(1, math.ceil(run.tail * run.g - 1e-9))
        if g >= run.g:
            return
        self._account()
        now = self.loop.now
        # Progress continues at the same rate: the last wave's blocks run as the others did.
        run.remaining -= (now - run.last_s) * run.rate
        run.last_s = now
        self.free += run.g - g
        run.g = g
        run.bw = g * run.mem_e
        run.want = g
        run.width = g
        self._dispatch()

    def _arm_waves(self, short: list[Stream]) -> None:
        """Arm the events at which a waiting kernel may get slots from a running one (G5, G6).

        ``short`` lists the streams left short of their want (``w_prio``: the priority they wait at,
        ``w_has``: the slots they hold). A running kernel gives slots at its next wave end to a
        waiter of higher priority (its pending blocks are dispatched first). To a waiter of its own
        priority it gives, under ``share = "fifo"``, only the slots its last, partial wave leaves
        empty (the earlier grid's blocks are all dispatched before a later grid's); under
        ``"fair"``, a max-min fair share at its next wave end. Only the earliest useful wave end is
        armed (the dispatch it triggers arms the next one if someone is still short); nothing is
        armed when no waiter would gain.
        """
        now = self.loop.now
        heap = self.loop._heap
        fair = self._fair
        best: Run | None = None
        best_t = 0.0
        for r in self.runs:
            p = r.stream.priority
            g = r.g
            higher = False
            equal = False
            for s in short:
                if s is r.stream:
                    continue
                prio = s.w_prio
                has = s.w_has
                if prio < p:
                    higher = True
                elif prio == p and (not fair or has + 1 < g):
                    equal = True
            if not higher and not equal:
                continue
            ws = r.wave_s
            multi = 0.0 < ws < r.dur_s
            if not multi:
                continue  # a single wave: its blocks hold their slots to the kernel's end
            left = r.remaining - (now - r.last_s) * r.rate
            end = now + left / r.rate
            if higher or fair:
                if r.wave_at >= 0.0:
                    if best is None or r.wave_at < best_t:
                        best, best_t = r, r.wave_at
                else:
                    t_b = r.t0 + ws * (math.floor((now - r.t0) / ws) + 1.0)
                    if t_b < end and (best is None or t_b < best_t):
                        best, best_t = r, t_b
            if equal and not fair and r.tail < 1.0 and not r.tail_armed:
                r.tail_armed = True
                t_tail = end - ws
                _heappush(
                    heap,
                    (
                        t_tail if t_tail > now else now,
                        self._next_seq(),
                        self._tail_start,
                        (r, r.kseq),
                    ),
                )
        if best is not None and best.wave_at < 0.0:
            best.wave_at = best_t
            w = best.wave
            # Still pending for this very wave end (armed, cancelled by a release, armed again
            # for the same time): it fires first, as the older of two heap entries would.
            if w.slot < 0 or w.kseq != best.kseq or w.due_s != best_t:
                w.kseq = best.kseq
                self.loop.arm(w, best_t)

    def _next_seq(self) -> int:
        loop = self.loop
        seq = loop._seq
        loop._seq = seq + 1
        return seq

    def _complete(self, run: Run) -> None:
        """The kernel of ``run`` completed (the loop calls this when its completion is due)."""
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
        stream.client.on_kernel_done(now)
        self._dispatch(stream)

    def _run_on(self, stream: Stream) -> None:
        """Fast path: run a stream's next kernels inline while nothing else can change.

        Called only when no other stream waits for SMs (none has an issued kernel not yet started,
        none runs below its width): then the kernels the completing stream starts next take the SMs
        it just freed, and every other kernel keeps its SMs and rate (G8 evaluates bandwidth when a
        kernel starts or grows). So each next kernel's end time is known exactly, and the loop runs
        them without the event queue until one would end at or after the next pending event (a
        completion of another stream, an arrival, a probe, a duty edge, the end of the period). That
        bound is read again after each kernel: the stream's ``on_kernel_done`` may schedule an event
        (a request's end sends a boundary to the gate) that the next kernel must not run past.
        """
        runs = self.runs
        loop = self.loop
        end = loop.end_s
        limit = loop.next_at(end)
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
        client = stream.client
        while True:
            head = stream.nxt
            if head is None:
                break
            dur, width, mem, _, _ = head
            g = width if width < cap else cap
            if g > free:
                # Short of slots, it would wait on other kernels' waves: the event path's case.
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
            client.on_kernel_done(now)
            limit = loop.next_at(end)

    def _dispatch_event(self, _: object) -> None:
        self._dispatch_pending = False
        self._dispatch()

    def _dispatch(self, completing: Stream | None = None) -> None:
        """Give free slots to the kernels that want them (G5).

        One scan collects every stream that wants slots (an issued kernel not started, or a kernel
        holding fewer than it wants). Priorities are served in order; within one priority, when the
        free slots do not cover every want, the earliest grid goes first (or, with
        ``share = "fair"``, they are shared max-min fairly, :meth:`_share`). Whoever is left short waits for
        the next wave end of a kernel it may take slots from (:meth:`_arm_waves`). When the only
        candidate is the stream whose kernel just completed, its uncontended stretch runs inline
        first (:meth:`_run_on`). This is the simulator's hot path: the start of a kernel
        (:meth:`_set_alloc` for a fresh run) is inlined with the same arithmetic, in the same order.
        """
        loop = self.loop
        now = loop.now
        if self._ts:
            allowed = self._time_slice_owner(now)
            if allowed is None or self.free <= 0:
                return
            streams: list[Stream] = [allowed]
            full = self.sm_count
        else:
            streams = self.streams
            full = 0
        # Each candidate is a stream with this dispatch's view of it in its c_* fields.
        cands: list[Stream] = []
        for i, s in enumerate(streams):
            run = s.run
            if run is None:
                head = s.nxt
                if head is not None:
                    s.c_prio = s.priority
                    s.c_since = s.eligible_since
                    s.c_index = i
                    s.c_head = head
                    s.c_run = None
                    cands.append(s)
            elif run.g < run.want:
                s.c_prio = s.priority
                s.c_since = run.since
                s.c_index = i
                s.c_head = None
                s.c_run = run
                cands.append(s)
        if not cands:
            return
        if self.free <= 0:
            if not full:
                for s in cands:
                    r = s.c_run
                    s.w_prio = s.c_prio
                    s.w_has = r.g if r is not None else 0
                self._arm_waves(cands)
            return
        if len(cands) > 1:
            # Insertion sort by (priority, since, index), compared field by field.
            for a in range(1, len(cands)):
                c = cands[a]
                pa = c.c_prio
                sa = c.c_since
                ia = c.c_index
                b = a - 1
                while b >= 0:
                    d = cands[b]
                    pb = d.c_prio
                    if pb < pa or (
                        pb == pa and (d.c_since < sa or (d.c_since == sa and d.c_index < ia))
                    ):
                        break
                    cands[b + 1] = d
                    b -= 1
                cands[b + 1] = c
            if completing is not None and completing.run is None:
                # The next kernel of the stream that just completed one is not dispatchable until
                # the stream's dependency resolves (microseconds); the block scheduler fills the
                # freed slots with other clients' pending blocks first, whatever the priorities.
                for k in range(len(cands)):
                    if cands[k] is completing:
                        c = cands.pop(k)
                        c.c_prio = DEFERRED
                        cands.append(c)
                        break
        elif completing is not None and cands[0] is completing and self.fast_path and not full:
            self._run_on(completing)
            head = completing.nxt
            if head is None:
                return
            completing.c_prio = completing.priority
            completing.c_since = completing.eligible_since
            completing.c_index = 0
            completing.c_head = head
            completing.c_run = None
            now = loop.now
        if now != self._last_change:
            self._account()
        # What each candidate holds and wants, then what it gets.
        n = len(cands)
        for s in cands:
            run = s.c_run
            if run is not None:
                s.c_held = run.g
                s.c_want = run.want
            else:
                head = s.c_head
                assert head is not None
                s.c_held = 0
                cap = full or s.cap_sms
                width = head[1]
                s.c_want = width if width < cap else cap
            s.c_final = s.c_held
        free = self.free
        if n == 1:
            s = cands[0]
            add = s.c_want - s.c_held
            s.c_final = s.c_held + (add if add < free else free)
            free = 0
        k = 0 if n > 1 else 1
        while k < n and free > 0:
            prio = cands[k].c_prio
            e = k + 1
            while e < n and cands[e].c_prio == prio:
                e += 1
            need = 0
            for m in range(k, e):
                s = cands[m]
                need += s.c_want - s.c_held
            if need <= free:
                for m in range(k, e):
                    s = cands[m]
                    s.c_final = s.c_want
                free -= need
            elif self._fair:
                self._share(cands, k, e, free)
                free = 0
            else:
                # Left-over rule: the earliest grid's blocks first, later grids what is left.
                for m in range(k, e):
                    s = cands[m]
                    add = s.c_want - s.c_held
                    if add > free:
                        add = free
                    s.c_final = s.c_held + add
                    free -= add
            k = e
        short: list[Stream] = []
        runs = self.runs
        stats = self.stats
        beta_per_sm = self._beta_per_sm if self.beta > 0.0 else 0.0
        for s in cands:
            prio = s.c_prio
            run = s.c_run
            g = s.c_final
            want = s.c_want
            if g < want:
                s.w_prio = prio if prio != DEFERRED else s.priority
                s.w_has = g
                short.append(s)
            if run is not None:
                if g > run.g:
                    self.free -= g - run.g
                    self._set_alloc(run, g, now)
                continue
            if g <= 0:
                continue
            head = s.c_head
            assert head is not None
            dur, width, mem, wave, tail = head
            since = s.c_since
            mem_e = 0.25 + 0.75 * mem
            self.free -= g
            # A fresh run (g was 0, remaining 1): _set_alloc inlined, with the same arithmetic.
            # The stream's Run record is reused; its kseq keeps growing, so a wave event left
            # over from an earlier kernel never matches (its completion was disarmed).
            run = s.spare
            if run is None:
                run = s.spare = Run(s, self, dur, width, mem_e, want, since)
            else:
                run.dur_s = dur
                run.width = width
                run.mem_e = mem_e
                run.want = want
                run.since = since
                run.remaining = 1.0
            run.wave_s = wave
            run.tail = tail
            run.tail_armed = False
            run.t0 = now
            run.kseq += 1
            run.wave_at = -1.0
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
            if g > s.held_max:
                s.held_max = g
            loop.arm(run.done, now + 1.0 / rate)
        if short and not full:
            self._arm_waves(short)

    @staticmethod
    def _share(cands: list[Stream], k: int, e: int, free: int) -> None:
        """Max-min fair shares of ``free`` slots among candidates ``k..e-1`` of one priority.

        Each ends with ``max(held, min(want, level))`` for the highest level the slots allow;
        what rounding leaves goes one slot each in candidate order (earliest eligible first).
        The alternative to the left-over rule (``share = "fair"``): if the work distributor took
        grids from every client's channel in turn, the blocks dispatched into freed slots would
        alternate between clients' grids. Orion's V100 point fits it worse (docs/simulator.md).
        Reads each candidate's ``c_held`` and ``c_want``, sets its ``c_final``.
        """
        budget = free
        for m in range(k, e):
            budget += cands[m].c_held
        lo = 0
        hi = 0
        for m in range(k, e):
            if cands[m].c_want > hi:
                hi = cands[m].c_want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            total = 0
            for m in range(k, e):
                s = cands[m]
                w = s.c_want if s.c_want < mid else mid
                total += s.c_held if s.c_held > w else w
            if total <= budget:
                lo = mid
            else:
                hi = mid - 1
        used = 0
        for m in range(k, e):
            s = cands[m]
            w = s.c_want if s.c_want < lo else lo
            s.c_final = s.c_held if s.c_held > w else w
            used += s.c_final
        left = budget - used
        for m in range(k, e):
            if left <= 0:
                break
            s = cands[m]
            if s.c_final < s.c_want:
                s.c_final += 1
                left -= 1

    def _time_slice_owner(self, now: float) -> Stream | None:
        """The context that may use the GPU now under time-slicing (None: nobody, for now).

        The active context keeps the GPU while it has work and its slice lasts, or while nobody
        else has work. When its slice is over and another context waits, its running kernel is
        preempted mid-flight (its progress kept), and the GPU switches round robin to the next
        context with work, idle for ``switch_s`` while the contexts are saved and restored (G9).
        """
        if now < self._switch_until:
            return None  # a switch is under way; its end is armed
        active = self._active
        streams = self.streams
        others = [
            s for s in streams if s is not active and (s.run is not None or s.nxt is not None)
        ]
        if (
            active is not None
            and active in streams
            and (active.run is not None or active.nxt is not None)
        ):
            if not others or now - self._active_since < self.slice_s - 1e-12:
                if others:
                    self._arm_slice_timer(self._active_since + self.slice_s)
                return active
            run = active.run
            if run is not None and run.g > 0:
                if run.remaining - (now - run.last_s) * run.rate <= 1e-9:
                    return active  # it ends now: its completion, due at this time, switches
                self._release(run)  # compute preemption: the rest resumes on its next slice
        if not others:
            return None
        start = streams.index(active) + 1 if active in streams else 0
        nxt = others[0]
        for k in range(len(streams)):
            s = streams[(start + k) % len(streams)]
            if s is not active and (s.run is not None or s.nxt is not None):
                nxt = s
                break
        self._active = nxt
        self.stats.context_switches += 1
        cost = self.switch_s
        self._switch_until = now + cost
        self._active_since = now + cost
        if cost > 0.0:
            self.loop.at(now + cost, self._dispatch_event_slice)
            return None
        self._arm_slice_timer(now + self.slice_s)
        return nxt

    def _arm_slice_timer(self, at_s: float) -> None:
        if at_s > self._slice_timer_for:
            self._slice_timer_for = at_s
            self.loop.at(at_s, self._dispatch_event_slice)

    def _dispatch_event_slice(self, _: object) -> None:
        self._dispatch()


# Defined after Gpu, the type of one of its fields: a mypyc-compiled dataclass whose field is a
# native class defined further down the module crashes at import.
@dataclass(slots=True, eq=False)
class Run:
    """A kernel on the GPU: slots held, remaining work (fraction of the kernel), progress rate.

    ``g == 0`` while ``stream.run is self``: a kernel that gave its slots away between two waves
    (or was preempted by a context switch) and waits to get some back; it is not in ``Gpu.runs``.
    """

    stream: Stream
    gpu: Gpu
    dur_s: float
    width: int
    mem_e: float
    want: int
    since: float
    wave_s: float = 0.0
    #: Start of the kernel's current wave train (its waves end at t0 + k * wave_s).
    t0: float = 0.0
    #: Which kernel this record holds now (records are reused; a stale wave event must not match).
    kseq: int = 0
    #: Time of the wave-end event armed for this kernel, or -1.
    wave_at: float = -1.0
    #: Fraction of its slots the last wave fills (< 1: slots free up when it starts).
    tail: float = 1.0
    #: The tail event is armed (or done) for this kernel.
    tail_armed: bool = False
    g: int = 0
    remaining: float = 1.0
    rate: float = 0.0
    last_s: float = 0.0
    #: Its completion and its next wave end (see :class:`EventLoop`).
    done: Timer = field(init=False)
    wave: Timer = field(init=False)

    def __post_init__(self) -> None:
        self.done = Timer(self, TIMER_DONE)
        self.wave = Timer(self, TIMER_WAVE_END)

    #: ``g * mem_e``: this kernel's term of the bandwidth sum (G8), kept with ``g``.
    bw: float = 0.0
