"""Wave ends and partial last waves: when a running kernel gives slots to waiting work (G5, G6).

A kernel runs as waves of blocks. A running wave is never preempted: a kernel gives slots to
a waiting kernel of higher MPS priority at its next wave end (its pending blocks are dispatched
first); to one of its own priority, under ``share = "fifo"``, only the slots its last, partial
wave leaves empty. :func:`arm_waves` arms the earliest such event, :func:`wave_end` and
:func:`tail_start` run it and dispatch again (:meth:`gpushare.sim.gpu.Gpu.dispatch`).

Functions over a :class:`~gpushare.sim.gpu.Gpu`'s public state, compiled with it into one mypyc
group (:mod:`gpushare.sim.engine`). It imports the other modules only for types.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpushare.sim.events import Timer
    from gpushare.sim.gpu import Gpu, Run, Stream


def wave_end(gpu: Gpu, timer: Timer) -> None:
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
    if not _waiter_gains(gpu, run):
        return  # whoever waited was served meanwhile: the blocks go on as they were
    gpu.release(run)
    gpu.stats.wave_yields += 1
    gpu.dispatch()


def _waiter_gains(gpu: Gpu, run: Run) -> bool:
    """Whether some other stream now waits for slots this kernel would give up (G5)."""
    own = run.stream
    p = own.priority
    fair = gpu.fair
    for s in gpu.streams:
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


def tail_start(gpu: Gpu, arg: tuple[Run, int]) -> None:
    """A kernel's last, partial wave starts: the slots it leaves empty go to waiting work."""
    run, kseq = arg
    if run.kseq != kseq or run.g == 0 or run.stream.run is not run:
        return
    g = max(1, math.ceil(run.tail * run.g - 1e-9))
    if g >= run.g:
        return
    gpu.account()
    now = gpu.loop.now
    # Progress continues at the same rate: the last wave's blocks run as the others did.
    run.remaining -= (now - run.last_s) * run.rate
    run.last_s = now
    gpu.free += run.g - g
    run.g = g
    run.bw = g * run.mem_e
    run.want = g
    run.width = g
    gpu.dispatch()


def arm_waves(gpu: Gpu, short: list[Stream]) -> None:
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
    loop = gpu.loop
    now = loop.now
    fair = gpu.fair
    best: Run | None = None
    best_t = 0.0
    for r in gpu.runs:
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
            # Never before now (EventLoop.at takes the later of the two).
            loop.at(end - ws, gpu.tail_start, (r, r.kseq))
    if best is not None and best.wave_at < 0.0:
        best.wave_at = best_t
        w = best.wave
        # Still pending for this very wave end (armed, cancelled by a release, armed again
        # for the same time): it fires first, as the older of two heap entries would.
        if w.slot < 0 or w.kseq != best.kseq or w.due_s != best_t:
            w.kseq = best.kseq
            loop.arm(w, best_t)
