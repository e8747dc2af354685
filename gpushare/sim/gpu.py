"""The GPU model: SM slots shared by MPS clients, kernels' progress rates, and accounting.

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

``mode = "time_slice"`` models the default compute mode without MPS, one context at a time with
compute preemption (:mod:`gpushare.sim.timeslice`).

The model is five modules, compiled together (:mod:`gpushare.sim.engine`): this one (the
:class:`Gpu` and its records: :class:`Stream`, :class:`Run`, :class:`GpuStats`),
:mod:`gpushare.sim.events` (the virtual clock and event queue), :mod:`gpushare.sim.dispatch` (who
gets the free slots at a dispatch point), :mod:`gpushare.sim.waves` (wave ends and partial last
waves that give slots to waiting work) and :mod:`gpushare.sim.timeslice` (with its
:class:`~gpushare.sim.timeslice.SliceState`). :class:`Gpu` keeps the state; the other modules are
functions over it, through its public fields and methods only (listed on :class:`Gpu`; no module
reads another's ``_private`` names). This module imports the others; they import it only under
``TYPE_CHECKING``, for its types, so there is no import cycle. The shared state is typed with the
concrete classes, not Protocols: compiled, a native class's field is a direct struct read, a
Protocol's a generic attribute look-up, and these reads are the simulator's hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

# Runtime imports go one way, from this module to the others (which import it only under
# TYPE_CHECKING, for its types): there is no import cycle among the engine's modules.
from gpushare.sim.dispatch import dispatch as dispatch_free_slots
from gpushare.sim.dispatch import saturating_slow
from gpushare.sim.events import TIMER_DONE, TIMER_WAVE_END, Timer
from gpushare.sim.events import EventLoop as EventLoop  # re-exported: Gpu(loop, ...) takes one
from gpushare.sim.timeslice import SliceState
from gpushare.sim.waves import tail_start as waves_tail_start
from gpushare.sim.waves import wave_end as waves_wave_end

GpuMode = Literal["mps", "time_slice"]

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
#: How slots are shared among kernels of one MPS priority (docs/simulator.md G5).
ShareRule = Literal["fifo", "fair"]


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
        # The dispatcher's view of it as a candidate: sort key (priority, since, index), its next
        # kernel or its run, the slots it holds, wants and gets; and as a waiter left short, for
        # waves.arm_waves: its priority and the slots it holds. Fields of a native record, they cost
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
        #: The saturating fraction of its memory-bound kernels (docs/simulator.md L3b; the LLM
        #: server's); 0: G7 for every kernel.
        self.sat = 0.0


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
    """One simulated GPU: SM allocation, kernel progress and accounting.

    What the engine's other modules use of it (its interface among them):

    * state: ``loop``, ``streams``, ``runs``, ``free``, ``sm_count``, ``stats``, ``fast_path``,
      ``last_change_s``; the model's parameters ``f``, ``serial``, ``beta``, ``beta_per_sm``,
      ``slice_s``, ``switch_s``; the mode flags ``fair`` and ``time_sliced``; ``slicing``, the
      time-slicing state :mod:`gpushare.sim.timeslice` owns;
    * slots: :meth:`account` (before ``free`` changes), :meth:`set_alloc`, :meth:`release`,
      :meth:`new_run`;
    * events, called by the loop or armed on it: :meth:`complete`, :meth:`dispatch`,
      :meth:`wave_end`, :meth:`tail_start`, :meth:`slice_event`.
    """

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
        #: ``share == "fair"`` and ``mode == "time_slice"``, tested on every dispatch.
        self.fair = share == "fair"
        self.time_sliced = mode == "time_slice"
        #: Who owns the GPU under time-slicing (:mod:`gpushare.sim.timeslice` keeps it).
        self.slicing = SliceState()
        #: The attached clients' streams, in attach order (the dispatcher's last tie-break).
        self.streams: list[Stream] = []
        #: SM slots no running kernel holds.
        self.free = sm_count
        #: The kernels holding slots (``g > 0``), in the order they got them.
        self.runs: list[Run] = []
        self.stats = GpuStats()
        #: When ``stats`` last integrated busy time and SM-seconds (see :meth:`account`).
        self.last_change_s = 0.0
        self._dispatch_pending = False
        self._cum_busy_s = 0.0
        self._cum_sm_s = 0.0
        #: The rate law's serial fraction ``1 - f`` and the bandwidth term's ``beta / sm_count``.
        self.serial = 1.0 - parallel_fraction
        self.beta_per_sm = bw_beta / sm_count
        #: Run uncontended stretches inline (exact; False only to test that it is).
        self.fast_path = True

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
        if self.slicing.active is stream:
            self.slicing.active = None
        self.wake()
        return killed

    def kill_running(self, client: Client) -> int:
        """Kill the client's running kernel (``terminate_client``); its SMs free at once."""
        stream = client.stream
        run = stream.run
        if run is None:
            return 0
        self.account()
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

    def account(self) -> None:
        """Integrate busy time and SM-seconds up to now (call before ``free`` changes)."""
        now = self.loop.now
        dt = now - self.last_change_s
        if dt > 0.0:
            held = self.sm_count - self.free
            if held:
                self.stats.busy_s += dt
                self.stats.sm_s += held * dt
            self.last_change_s = now

    def take_stats(self) -> GpuStats:
        """Return the integrals since the last call and start new ones."""
        self.account()
        stats = self.stats
        self._cum_busy_s += stats.busy_s
        self._cum_sm_s += stats.sm_s
        self.stats = GpuStats(since_s=self.loop.now)
        return stats

    def totals(self) -> tuple[float, float]:
        """Busy seconds and SM-seconds since the GPU was created (for NVML-like readings)."""
        self.account()
        return self._cum_busy_s + self.stats.busy_s, self._cum_sm_s + self.stats.sm_s

    @property
    def held_sms(self) -> int:
        """SMs held by running kernels now."""
        return self.sm_count - self.free

    # --- scheduling ----------------------------------------------------------------------------

    def set_alloc(self, run: Run, g: int, now: float) -> None:
        """Give ``run`` ``g`` slots from ``now`` (``free`` already debited): new rate, new end.

        Its progress so far is kept; a run that held none joins ``runs`` as a new train of waves.
        """
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
        slow = 1.0 if g >= w else self.serial + self.f * w / g
        sat = run.stream.sat
        if g < w and sat > 0.0:
            slow = saturating_slow(self.serial, self.f, w, g, (run.mem_e - 0.25) / 0.75, sat)
        runs = self.runs
        if len(runs) > 1 and self.beta > 0.0:
            other = 0.0
            for r in runs:
                if r is not run:
                    other += r.bw
            slow *= 1.0 + self.beta_per_sm * run.mem_e * other
        rate = 1.0 / (run.dur_s * slow)
        run.rate = rate
        stream = run.stream
        if g > stream.held_max:
            stream.held_max = g
        remaining = run.remaining if run.remaining > 0.0 else 0.0
        self.loop.arm(run.done, now + remaining / rate)

    def release(self, run: Run) -> None:
        """Take every slot from a running kernel, keeping its progress (it stays the stream's)."""
        self.account()
        now = self.loop.now
        run.remaining -= (now - run.last_s) * run.rate
        run.last_s = now
        self.loop.disarm(run.done)  # its completion is cancelled
        run.wave_at = -1.0  # and its wave end no longer matches
        self.free += run.g
        run.g = 0
        run.bw = 0.0
        self.runs.remove(run)

    def complete(self, run: Run) -> None:
        """The kernel of ``run`` completed (the loop calls this when its completion is due)."""
        now = self.loop.now
        stats = self.stats
        # Accounting (see account), inlined.
        dt = now - self.last_change_s
        if dt > 0.0:
            held = self.sm_count - self.free
            if held:
                stats.busy_s += dt
                stats.sm_s += held * dt
            self.last_change_s = now
        self.free += run.g
        self.runs.remove(run)
        stream = run.stream
        stream.run = None
        stats.kernels_done += 1
        stream.client.on_kernel_done(now)
        self.dispatch(stream)

    def new_run(
        self, stream: Stream, dur_s: float, width: int, mem_e: float, want: int, since: float
    ) -> Run:
        """A stream's :class:`Run` record, made at its first kernel (the dispatcher reuses it)."""
        return Run(stream, self, dur_s, width, mem_e, want, since)

    # --- events ------------------------------------------------------------------------------
    # Their bodies are in dispatch.py, waves.py and timeslice.py. They stay methods: the loop and
    # the heap call them on the GPU, and bench/mps_dispatch_whatif.py replaces dispatch (and
    # complete) on the pure-Python class for its what-if. Compiled, each is one more direct C call.

    def dispatch(self, completing: Stream | None = None) -> None:
        """Give free slots to the kernels that want them (:mod:`gpushare.sim.dispatch`).

        ``completing``: the stream whose kernel just ended (its next kernel is served last).
        """
        dispatch_free_slots(self, completing)

    def _dispatch_event(self, _: object) -> None:
        self._dispatch_pending = False
        self.dispatch()

    def slice_event(self, _: object) -> None:
        """A time slice or a context switch ends (:mod:`gpushare.sim.timeslice` arms it)."""
        self.dispatch()

    def wave_end(self, timer: Timer) -> None:
        """A wave end someone waits for (:func:`gpushare.sim.waves.wave_end`)."""
        waves_wave_end(self, timer)

    def tail_start(self, arg: tuple[Run, int]) -> None:
        """A partial last wave starts (:func:`gpushare.sim.waves.tail_start`)."""
        waves_tail_start(self, arg)


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
