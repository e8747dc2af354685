"""The simulator's discrete-event clock: a virtual time, a heap of timed callbacks, kernel timers.

Everything in the simulated node happens in an event this loop runs: arrivals, probes, the
controller's ticks and dispatches are heap entries (:meth:`EventLoop.at`); each running kernel's
completion and next wave end are two :class:`Timer` records kept on its
:class:`~gpushare.sim.gpu.Run`, moved in place (:meth:`EventLoop.arm`). It is deterministic:
events run in the order of ``(time, sequence number)``. Compiled with the GPU model
(:mod:`gpushare.sim.engine`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from gpushare.sim.gpu import Run

# The heap functions bound once: compiled, ``heapq.heappush`` is a module attribute look-up per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop

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
                run.gpu.complete(run)
            else:
                run.gpu.wave_end(c)
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
