"""Handing a GPU's free SM slots to the kernels that want them: the dispatcher (G5).

At each dispatch point (a kernel issued or ended, a wave end or a partial last wave that someone
waits for, the end of a time slice) :func:`dispatch` collects every stream that wants slots, serves
the MPS priorities in order and, within one, the earliest grid first (``share = "fifo"``) or a
max-min fair share (``share = "fair"``, :func:`_share`). Whoever is left short waits for a running
kernel's wave end (:func:`gpushare.sim.waves.arm_waves`). While one stream is alone on the GPU its
kernels run inline without the event queue (:func:`_run_on`, the exact fast path).

Functions over a :class:`~gpushare.sim.gpu.Gpu`'s public state (the interface listed on the
class), compiled with it into one mypyc group (:mod:`gpushare.sim.engine`), so calls among them
and reads of its fields stay native. This is the simulator's hot path. It imports
:mod:`gpushare.sim.gpu` only for types (gpu.py imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpushare.sim.timeslice import slice_owner
from gpushare.sim.waves import arm_waves

if TYPE_CHECKING:
    from gpushare.sim.gpu import Gpu, Stream

#: Sort key of a kernel served after every other candidate at a dispatch point (see dispatch).
DEFERRED = 1 << 30


def dispatch(gpu: Gpu, completing: Stream | None = None) -> None:
    """Give free slots to the kernels that want them (G5).

    One scan collects every stream that wants slots (an issued kernel not started, or a kernel
    holding fewer than it wants). Priorities are served in order; within one priority, when the
    free slots do not cover every want, the earliest grid goes first (or, with
    ``share = "fair"``, they are shared max-min fairly, :func:`_share`). Whoever is left short
    waits for the next wave end of a kernel it may take slots from
    (:func:`~gpushare.sim.waves.arm_waves`). When the only candidate is the stream whose kernel
    just completed, its uncontended stretch runs inline first (:func:`_run_on`). This is the
    simulator's hot path: the start of a kernel (:meth:`Gpu.set_alloc` for a fresh run) is
    inlined with the same arithmetic, in the same order.

    Why it is one long function (over the 80-line rule): it runs at nearly every event, and its
    five steps (collect, sort, fast path, share, start) pass a dozen locals from one to the next
    (``now``, ``free``, ``full``, ``cands``, ``runs``, ``stats``, the loop); compiled, a split
    into functions would turn them into arguments and return tuples (boxed objects, one per
    call) or fields written back to the GPU, and the inlined kernel start exists only to save
    a call per started kernel. The steps that carry no such locals already live apart
    (:func:`_share`, :func:`_run_on`, :func:`~gpushare.sim.waves.arm_waves`,
    :func:`~gpushare.sim.timeslice.slice_owner`); the comments mark the steps.
    """
    loop = gpu.loop
    now = loop.now
    if gpu.time_sliced:
        allowed = slice_owner(gpu, now)
        if allowed is None or gpu.free <= 0:
            return
        streams: list[Stream] = [allowed]
        full = gpu.sm_count
    else:
        streams = gpu.streams
        full = 0
    # Step 1, collect: each candidate is a stream with this dispatch's view of it in c_* fields.
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
    if gpu.free <= 0:
        if not full:
            for s in cands:
                r = s.c_run
                s.w_prio = s.c_prio
                s.w_has = r.g if r is not None else 0
            arm_waves(gpu, cands)
        return
    if len(cands) > 1:
        # Step 2, sort: insertion sort by (priority, since, index), compared field by field.
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
    elif completing is not None and cands[0] is completing and gpu.fast_path and not full:
        # Step 3, the fast path: the completing stream alone runs its next kernels inline.
        _run_on(gpu, completing)
        head = completing.nxt
        if head is None:
            return
        completing.c_prio = completing.priority
        completing.c_since = completing.eligible_since
        completing.c_index = 0
        completing.c_head = head
        completing.c_run = None
        now = loop.now
    if now != gpu.last_change_s:
        gpu.account()
    # Step 4, share: what each candidate holds and wants, then what it gets.
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
    free = gpu.free
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
        elif gpu.fair:
            _share(cands, k, e, free)
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
    # Step 5, start: grow the runs that got more, start the new ones, arm waves for the short.
    short: list[Stream] = []
    runs = gpu.runs
    stats = gpu.stats
    beta_per_sm = gpu.beta_per_sm if gpu.beta > 0.0 else 0.0
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
                gpu.free -= g - run.g
                gpu.set_alloc(run, g, now)
            continue
        if g <= 0:
            continue
        head = s.c_head
        assert head is not None
        dur, width, mem, wave, tail = head
        since = s.c_since
        mem_e = 0.25 + 0.75 * mem
        gpu.free -= g
        # A fresh run (g was 0, remaining 1): set_alloc inlined, with the same arithmetic.
        # The stream's Run record is reused; its kseq keeps growing, so a wave event left
        # over from an earlier kernel never matches (its completion was disarmed).
        run = s.spare
        if run is None:
            run = s.spare = gpu.new_run(s, dur, width, mem_e, want, since)
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
        slow = 1.0 if g >= width else gpu.serial + gpu.f * width / g
        if g < width and s.sat > 0.0:
            slow = saturating_slow(gpu.serial, gpu.f, width, g, mem, s.sat)
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
        arm_waves(gpu, short)


def saturating_slow(serial: float, f: float, width: int, g: int, mem: float, sat: float) -> float:
    """G7 with the saturating law of LLM kernels (docs/simulator.md L3b), for ``g < width`` slots.

    The memory-bound share ``mem`` of the kernel's time (a merged chunk's duration-weighted
    memory-boundness) keeps its speed down to ``sat x width`` slots and follows G7 with that width
    below it; the rest follows G7. Only streams with ``sat > 0`` (the LLM server's) use it.
    """
    g7 = serial + f * width / g
    low = serial + f * sat * width / g
    if low < 1.0:
        low = 1.0
    return mem * low + (1.0 - mem) * g7


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


def _run_on(gpu: Gpu, stream: Stream) -> None:
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
    runs = gpu.runs
    loop = gpu.loop
    end = loop.end_s
    limit = loop.next_at(end)
    now = loop.now
    cap = stream.cap_sms
    f = gpu.f
    serial = gpu.serial
    free = gpu.free
    held_others = gpu.sm_count - free
    other_bw = 0.0
    if runs and gpu.beta > 0.0:
        other_bw = sum(r.bw for r in runs)
    beta_per_sm = gpu.beta_per_sm
    stats = gpu.stats
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
        if g < width and stream.sat > 0.0:
            slow = saturating_slow(serial, f, width, g, mem, stream.sat)
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
        gpu.last_change_s = now
        client.on_kernel_done(now)
        limit = loop.next_at(end)
