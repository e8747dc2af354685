"""An offline client's launch queue when gpushare's in-flight bound keeps it shallow.

The interposer (``gpushare/native/inflight.c``, docs/controller.md "Shallow offline queues") lets a
process have at most k kernels in flight without blocking each launch. This module is the
simulator's model of it (docs/simulator.md W3b): which launch environment asks for it
(:func:`launch_queue`), and one iteration's timeline alone under the bound
(:func:`bounded_timeline`), read per chunk by :class:`gpushare.sim.workloads.OfflineTrainer`
(:func:`bound_tables`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpushare import native
from gpushare.sim.data import KernelProfile

#: Bounded in-flight mode (``GPUSHARE_MAX_INFLIGHT=k``, the LD_PRELOAD interposer): the time from
#: the completion of the kernel that frees a slot to the next launch reaching the GPU (the
#: interposer's poll of the event sees it, the real launch is made, the GPU picks it up). An
#: empty kernel's launch-and-synchronise round trip on a V100, the Orion profiles' GPU: 12.83 us
#: (PETSc ``ex1cu.cu`` on Summit, n = 100000; 12.95 us in another version of the same test). It is
#: that loop's period, so it also holds the empty kernel's own run time: an upper bound by that
#: much. Not fitted to any benchmark (docs/simulator.md W3b, docs/sources.md).
DEFAULT_INFLIGHT_WAKE_S = 12.83e-6


def launch_queue(env: Mapping[str, str]) -> tuple[bool, int]:
    """``(launch_blocking, inflight_bound)`` of a process launched with ``env``.

    ``CUDA_LAUNCH_BLOCKING=1``: every launch synchronises (one kernel in flight, the launch gap).
    ``GPUSHARE_MAX_INFLIGHT=k`` with the interposer in ``LD_PRELOAD`` (the dynamic loader splits
    it at colons and spaces): at most ``k`` in flight. Without the library preloaded nothing reads
    the variable; like the interposer, a missing, non-integer or < 1 value means no bound (0).
    """
    blocking = env.get("CUDA_LAUNCH_BLOCKING") == "1"
    raw = env.get(native.INFLIGHT_ENV, "").strip()
    preload = env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    loaded = any(entry.rsplit("/", 1)[-1] == native.LIBRARY_NAME for entry in preload)
    bound = int(raw) if raw.isdigit() and loaded else 0
    return blocking, bound


def source_durations(profile: KernelProfile) -> tuple[tuple[float, ...], ...]:
    """Per chunk, the run times alone (s) of its source kernels (one per chunk without parts)."""
    if profile.parts:
        return tuple(tuple(d_us * 1e-6 for d_us, _ in part) for part in profile.parts)
    return tuple((d,) for d in profile.dur_s)


@dataclass(frozen=True, slots=True)
class BoundTables:
    """What bounded in-flight mode needs per chunk, from the trainer's source kernels alone.

    The bound acts on source kernels, the simulator runs chunks (G11), so the source-level
    timeline of one iteration alone (:func:`bounded_timeline`) is computed once and read per chunk:

    * ``stall_s[p]``: the idle time the bound adds from chunk ``p - 1``'s end to chunk ``p``'s end
      when alone (waits for slots, the wake latency), paid before the chunk as launch-blocking
      mode pays its gaps. With other clients' kernels stretching the trainer's, more of the wake
      would be hidden: the stall is that of the trainer alone, an upper bound.
    * ``ref[p]``: the chunk holding source kernel ``first(p) - k``, the one whose completion lets
      chunk ``p``'s first source kernel launch (-1: none in this iteration; the iteration's first
      ``k`` launch at its start); ``tail_s[p]``: the time alone from that kernel's completion to
      its chunk's end, so its completion is estimated as that chunk's recorded end minus it.
    * ``alone_s``: one iteration alone in this mode.
    """

    stall_s: tuple[float, ...]
    ref: tuple[int, ...]
    tail_s: tuple[float, ...]
    alone_s: float


#: The interposer's wait (gpushare/native/inflight.c ``wait_event``): it polls the oldest launch's
#: event with ``sched_yield`` for the first millisecond of a wait, then every 50 us
#: (``nanosleep``). A completion during the spin is seen at once (the wake covers it); one after it
#: is seen at the next poll: half a poll period late on average, a period being the 50 us nap plus
#: Linux's default 50 us timer slack for a normal thread (``prctl(PR_SET_TIMERSLACK)``), so 50 us.
INFLIGHT_SPIN_S = 1e-3
INFLIGHT_NAP_LAG_S = 50e-6


def bounded_timeline(
    durs_s: list[float],
    bound: int,
    wake_s: float,
    host_per_kernel_s: float = 0.0,
    spin_s: float = INFLIGHT_SPIN_S,
    nap_lag_s: float = INFLIGHT_NAP_LAG_S,
) -> tuple[list[float], list[float]]:
    """Launch and completion times of one iteration's source kernels alone, from its start.

    Source kernel ``j`` is launched once the CPU has reached it (``host_per_kernel_s`` after the
    launch before it) and, for ``j >= bound``, ``wake_s`` after kernel ``j - bound`` completed,
    ``nap_lag_s`` later still when the CPU had been waiting for that completion longer than
    ``spin_s`` (the interposer naps then); it runs once launched and its predecessor is done (one
    in-order stream).
    """
    launch = [0.0] * len(durs_s)
    done = [0.0] * len(durs_s)
    prev_launch = prev_done = 0.0
    for j, d in enumerate(durs_s):
        at = prev_launch + host_per_kernel_s if j else 0.0
        if j >= bound:
            freed = done[j - bound]
            if freed - at > spin_s:
                freed += nap_lag_s
            at = max(at, freed + wake_s)
        launch[j] = at
        prev_done = done[j] = max(prev_done, at) + d
        prev_launch = at
    return launch, done


def bound_tables(
    profile: KernelProfile, bound: int, wake_s: float, host_per_kernel_s: float = 0.0
) -> BoundTables:
    """The per-chunk tables of :class:`BoundTables` for one profile, bound and wake latency."""
    parts = source_durations(profile)
    flat = [d for part in parts for d in part]
    chunk_of = [p for p, part in enumerate(parts) for _ in part]
    _, done = bounded_timeline(flat, bound, wake_s, host_per_kernel_s)
    stall, ref, tail = [], [], []
    first = 0
    prev_end = 0.0
    last_done = [0.0] * len(parts)
    for p, part in enumerate(parts):
        last_done[p] = done[first + len(part) - 1]
        stall.append(max(0.0, last_done[p] - prev_end - profile.dur_s[p]))
        prev_end = last_done[p]
        j0 = first - bound
        if j0 < 0:
            ref.append(-1)
            tail.append(0.0)
        else:
            q = chunk_of[j0]
            ref.append(q)
            tail.append(last_done[q] - done[j0])
        first += len(part)
    return BoundTables(tuple(stall), tuple(ref), tuple(tail), last_done[-1] if parts else 0.0)
