"""Time-slicing: the default compute mode without MPS, one context on the GPU at a time (G9).

``mode = "time_slice"``: one client (context) at a time owns the GPU for ``slice_s``; when the
slice ends and another context has work, the running kernel is preempted mid-flight (compute
preemption, Pascal and later), the GPU idles ``switch_s`` (context save and restore) and the next
context resumes where it was stopped. The dispatcher asks :func:`slice_owner` whose kernels may
have slots.

Functions over a :class:`~gpushare.sim.gpu.Gpu`'s public state and its :class:`SliceState`
(``gpu.slicing``, which only this module and ``Gpu.detach`` write), compiled with it into one mypyc
group (:mod:`gpushare.sim.engine`). It imports :mod:`gpushare.sim.gpu` only for types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpushare.sim.gpu import Gpu, Stream


class SliceState:
    """One GPU's time-slicing state (G9): the context that owns it, and the switch under way."""

    def __init__(self) -> None:
        #: The context (stream) that owns the GPU, or None.
        self.active: Stream | None = None
        #: When its slice began (the end of the switch to it).
        self.active_since_s = 0.0
        #: A context switch is under way until then: nobody runs.
        self.switch_until_s = 0.0
        #: The latest slice end armed on the loop (so each is armed once).
        self.timer_for_s = -1.0


def slice_owner(gpu: Gpu, now: float) -> Stream | None:
    """The context that may use the GPU now under time-slicing (None: nobody, for now).

    The active context keeps the GPU while it has work and its slice lasts, or while nobody
    else has work. When its slice is over and another context waits, its running kernel is
    preempted mid-flight (its progress kept), and the GPU switches round robin to the next
    context with work, idle for ``switch_s`` while the contexts are saved and restored (G9).
    """
    st = gpu.slicing
    if now < st.switch_until_s:
        return None  # a switch is under way; its end is armed
    active = st.active
    streams = gpu.streams
    others = [s for s in streams if s is not active and (s.run is not None or s.nxt is not None)]
    if (
        active is not None
        and active in streams
        and (active.run is not None or active.nxt is not None)
    ):
        if not others or now - st.active_since_s < gpu.slice_s - 1e-12:
            if others:
                _arm_slice_timer(gpu, st.active_since_s + gpu.slice_s)
            return active
        run = active.run
        if run is not None and run.g > 0:
            if run.remaining - (now - run.last_s) * run.rate <= 1e-9:
                return active  # it ends now: its completion, due at this time, switches
            gpu.release(run)  # compute preemption: the rest resumes on its next slice
    if not others:
        return None
    start = streams.index(active) + 1 if active in streams else 0
    nxt = others[0]
    for k in range(len(streams)):
        s = streams[(start + k) % len(streams)]
        if s is not active and (s.run is not None or s.nxt is not None):
            nxt = s
            break
    st.active = nxt
    gpu.stats.context_switches += 1
    cost = gpu.switch_s
    st.switch_until_s = now + cost
    st.active_since_s = now + cost
    if cost > 0.0:
        gpu.loop.at(now + cost, gpu.slice_event)
        return None
    _arm_slice_timer(gpu, now + gpu.slice_s)
    return nxt


def _arm_slice_timer(gpu: Gpu, at_s: float) -> None:
    st = gpu.slicing
    if at_s > st.timer_for_s:
        st.timer_for_s = at_s
        gpu.loop.at(at_s, gpu.slice_event)
