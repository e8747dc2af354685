"""Simulated clients: online servers (open-loop requests) and offline trainers.

Each is a :class:`gpushare.sim.gpu.Client` with one :class:`~gpushare.sim.gpu.Stream`: one in-order
stream of kernels on one GPU.

* :class:`OnlineServer` serves requests first come, first served; a request is the kernel sequence
  of one forward pass, launched asynchronously by the server's CPU, which synchronises at its end.
  The CPU issues the pass's kernels one after another at :data:`DEFAULT_HOST_PER_KERNEL_S` each
  (the framework's per-operator cost, W3), so a request alone takes about
  ``max(kernel time, kernels x host cost)`` (:func:`request_alone_s`). Latency = completion -
  arrival.
* :class:`OfflineTrainer` runs training iterations in a closed loop. Its CPU side issues a whole
  iteration at the iteration's start and synchronises at its end (PyTorch's ``loss.item()``), so it
  runs ahead of the GPU by at most one iteration. Frozen, it issues nothing new; the kernels of the
  iteration already issued still run.

The latency probe's client is :class:`gpushare.sim.probe.ProbeClient`; arrival processes are in
:mod:`gpushare.sim.arrivals`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpushare.model import ClientClass, ClientState
from gpushare.sim.data import KernelProfile, wave_s, wave_tail
from gpushare.sim.gpu import EventLoop, Gpu, Kernel, Run, Stream
from gpushare.sim.inflight import DEFAULT_INFLIGHT_WAKE_S, BoundTables, bound_tables

#: How long a cgroup freeze of a busy process takes to stop it (median), and a thaw to restart
#: it: ``bench/pauser_latency.py`` on this project's CI machine (``cgroup_freeze_busy`` p50
#: 0.19 ms, p99 0.36 ms; ``cgroup_thaw_busy`` p50 0.12 ms; bench/results/pauser_latency.json).
FREEZE_S = 0.19e-3
THAW_S = 0.12e-3
#: CPU time between two kernels of a client launched with ``CUDA_LAUNCH_BLOCKING=1``: the
#: framework's per-operator cost plus the launch and the synchronisation, each a few
#: microseconds; PyTorch's per-op CPU cost is of the order of 10 us (docs/simulator.md W3).
DEFAULT_LAUNCH_GAP_S = 10e-6
#: CPU time an eager PyTorch inference server spends per kernel it issues (Python, the
#: framework's dispatch, the launch): the mean of what two published standalone latencies need,
#: ResNet-50 b4 and Transformer-XL b4 on a V100 (calibration; validated on BERT-large b2 and a
#: ResNeXt101 b4 proxy; docs/simulator.md section 4, ``validation.host_cost_from``).
DEFAULT_HOST_PER_KERNEL_S = 56.2e-6


def cap_sms(sm_pct: float, sm_count: int) -> int:
    """SMs an MPS client with an active-thread percentage may hold (at least one)."""
    return max(1, min(sm_count, round(sm_pct * sm_count / 100.0)))


def source_counts(profile: KernelProfile) -> tuple[int, ...]:
    """Source kernels per chunk of a (possibly merged) profile: what the CPU pays per launch."""
    return tuple(len(part) for part in profile.parts) or (1,) * len(profile)


def request_alone_s(profile: KernelProfile, host_per_kernel_s: float) -> float:
    """One pass alone when the CPU issues each source kernel ``host_per_kernel_s`` after the last.

    Chunk ``p`` can start once its last source kernel is issued and the chunk before it is done:
    ``end_p = max(end_(p-1), host x kernels up to p) + dur_p``. With no host cost this is the
    profile's kernel time; it is what a standalone latency measured on the hardware would be, so
    a scenario's load is taken against it.
    """
    if host_per_kernel_s <= 0.0:
        return profile.total_s
    end, issued = 0.0, 0
    for dur, n in zip(profile.dur_s, source_counts(profile), strict=True):
        issued += n
        end = max(end, host_per_kernel_s * issued) + dur
    return end


class StreamView:
    """A client's :class:`Stream` fields as the client's own attributes (for readers elsewhere).

    The hot paths here use ``self.stream`` directly.
    """

    stream: Stream

    @property
    def run(self) -> Run | None:
        """The running kernel, or None."""
        return self.stream.run

    @property
    def held_max(self) -> int:
        """The most SM slots it ever held."""
        return self.stream.held_max

    @property
    def nxt(self) -> Kernel | None:
        """The next issued kernel not yet started (what ``head()`` returns)."""
        return self.stream.nxt

    @nxt.setter
    def nxt(self, kernel: Kernel | None) -> None:
        self.stream.nxt = kernel

    @property
    def eligible_since(self) -> float:
        """When ``nxt`` was issued."""
        return self.stream.eligible_since

    @eligible_since.setter
    def eligible_since(self, t: float) -> None:
        self.stream.eligible_since = t

    @property
    def priority(self) -> int:
        """MPS client priority: online 0, offline 1 (the runner may override it for a baseline)."""
        return self.stream.priority

    @priority.setter
    def priority(self, p: int) -> None:
        self.stream.priority = p

    @property
    def cap_sms(self) -> int:
        """SM slots its MPS cap lets it hold."""
        return self.stream.cap_sms

    def head(self) -> Kernel | None:
        """The next issued kernel not yet started."""
        return self.stream.nxt


@dataclass(slots=True)
class KernelCounts:
    """Conservation bookkeeping of one client: every kernel issued completes or is killed."""

    issued: int = 0
    done: int = 0
    discarded: int = 0


@dataclass(eq=False)
class SimClient(StreamView):
    """State shared by every simulated client (the registry's view of it)."""

    cid: str
    cls: ClientClass
    gpu: Gpu
    sm_pct: float
    mem_bytes: int
    pinned_mem_bytes: int | None
    uid: int = 1000
    pid: int = 0
    slo_p99_ms: float | None = None
    restartable: bool = False
    state: ClientState = ClientState.QUEUED
    failures: int = 0
    started_at_s: float | None = None
    fail_reason: str | None = None
    counts: KernelCounts = field(default_factory=KernelCounts)
    #: Launch-blocking mode (``CUDA_LAUNCH_BLOCKING=1``, issue 14's shallow queue): one kernel in
    #: flight, each launched ``launch_gap_s`` per source kernel after the previous one ended.
    launch_blocking: bool = False
    launch_gap_s: float = DEFAULT_LAUNCH_GAP_S
    #: Bounded in-flight mode (``GPUSHARE_MAX_INFLIGHT=k``; offline trainers only; 0: off;
    #: ``launch_blocking`` takes precedence): source kernel ``j`` is launched ``inflight_wake_s``
    #: after source kernel ``j - k`` completed (:meth:`OfflineTrainer.set_inflight`).
    inflight_bound: int = 0
    inflight_wake_s: float = DEFAULT_INFLIGHT_WAKE_S
    #: CPU time per source kernel when issuing (:meth:`set_host_cost`); 0: a whole sequence is
    #: issued at once.
    host_per_kernel_s: float = 0.0

    def __post_init__(self) -> None:
        self.stream = Stream(
            self, self.cid, self.cls.mps_priority, cap_sms(self.sm_pct, self.gpu.sm_count)
        )

    def _load_profile(self, profile: KernelProfile) -> None:
        """Unpack a kernel profile into the flat per-kernel sequences the hot path reads."""
        self.profile = profile
        self._dur = profile.dur_s
        self._mem = profile.mem
        self._n = len(profile)
        scale = self.gpu.wave_scale
        if profile.parts:
            waves = tuple(wave_s(part, scale) for part in profile.parts)
            tails = tuple(wave_tail(part, scale) for part in profile.parts)
        else:  # no per-kernel data: every chunk is one full wave
            waves = profile.dur_s
            tails = (1.0,) * len(profile)
        self._kernels: tuple[Kernel, ...] = tuple(
            zip(profile.dur_s, profile.width, profile.mem, waves, tails, strict=True)
        )
        #: Source kernels per chunk: what launch-blocking mode pays a gap for.
        self._counts = source_counts(profile)
        self.pos = self._n  # no kernel sequence in progress
        self._gate = 0  # bumped when a sequence is dropped: a pending launch must not fire
        #: When the current sequence began, and when (after that) its CPU has issued each chunk.
        self._seq_t0 = 0.0
        self._issued_after: tuple[float, ...] = (0.0,) * self._n

    def set_host_cost(self, host_per_kernel_s: float) -> None:
        """Issue each source kernel ``host_per_kernel_s`` of CPU time after the one before it.

        Chunk ``p`` of a sequence becomes the stream's next kernel once the CPU has issued its
        last source kernel (a merged chunk starts with it; the error is at most the merge limit).
        """
        self.host_per_kernel_s = host_per_kernel_s
        cum = 0
        offsets = []
        for n in self._counts:
            cum += n
            offsets.append(host_per_kernel_s * cum)
        self._issued_after = tuple(offsets)

    def _present(self, p: int, now: float) -> None:
        """Make chunk ``p`` the next kernel: at once, or when the CPU has issued it.

        Asynchronous issue with a host cost makes chunk ``p`` wait for the CPU's issue time in the
        sequence; launch-blocking mode launches it only after the previous chunk ended, its
        source kernels' host cost and launch gaps later.
        """
        st = self.stream
        if self.launch_blocking:
            at = now + (self.launch_gap_s + self.host_per_kernel_s) * self._counts[p]
        else:
            at = self._seq_t0 + self._issued_after[p]
            if at <= now:
                st.nxt = self._kernels[p]
                st.eligible_since = now
                return
        st.nxt = None
        self.gpu.loop.at(at, self._launched_one, (self._gate, p))

    def _launched_one(self, arg: tuple[int, int]) -> None:
        gate, p = arg
        if gate != self._gate or p != self.pos:
            return
        st = self.stream
        st.nxt = self._kernels[p]
        st.eligible_since = self.gpu.loop.now
        self.gpu.wake()

    def on_kernel_done(self, now: float) -> None:
        """The running kernel completed at ``now`` (each kind of client advances its own way)."""
        raise NotImplementedError

    def blocking_cost(self) -> float:
        """Run time alone in launch-blocking mode over the asynchronous run time alone."""
        total = self.profile.total_s
        gap = self.launch_gap_s + self.host_per_kernel_s
        return (total + gap * sum(self._counts)) / total if total > 0 else 1.0

    def set_limits(self, sm_pct: float) -> None:
        """Apply a new SM percentage (only at a (re)start: MPS fixes it for the client's life)."""
        self.sm_pct = sm_pct
        self.stream.cap_sms = cap_sms(sm_pct, self.gpu.sm_count)


class OnlineServer(SimClient):
    """An inference server: FIFO requests, each one forward pass."""

    def __init__(
        self,
        cid: str,
        gpu: Gpu,
        profile: KernelProfile,
        arrivals: Iterator[float],
        *,
        sm_pct: float,
        mem_bytes: int,
        pinned_mem_bytes: int | None = None,
        slo_p99_ms: float | None = None,
        pid: int = 0,
    ) -> None:
        super().__init__(
            cid=cid,
            cls=ClientClass.ONLINE,
            gpu=gpu,
            sm_pct=sm_pct,
            mem_bytes=mem_bytes,
            pinned_mem_bytes=pinned_mem_bytes,
            slo_p99_ms=slo_p99_ms,
            pid=pid,
        )
        self._load_profile(profile)
        self._arrivals = arrivals
        self.queue: deque[float] = deque()
        self.current_arrival = 0.0
        #: (arrival_s, latency_s) of every completed request.
        self.completed: list[tuple[float, float]] = []
        #: (arrival_s, service_s) of every completed request: from the moment the server took it
        #: off its queue to its completion, queueing excluded. This is the latency Tally's
        #: benchmark records (docs/simulator.md section 4, "What Tally measures").
        self.served: list[tuple[float, float]] = []
        #: Told ``(+1 | -1, now)`` when a request starts (arrives) and ends, as a service using
        #: ``gpushare.client.request_started``/``request_ended`` tells the daemon
        #: (:class:`gpushare.sim.gating.BoundarySender`); ``None``: the service says nothing.
        self.on_boundary: Callable[[int, float], None] | None = None

    def start(self, loop: EventLoop) -> None:
        """Begin accepting requests (schedules the first arrival)."""
        self.state = ClientState.RUNNING
        self.started_at_s = loop.now
        self._loop = loop
        self._next_arrival()

    def _next_arrival(self) -> None:
        t = next(self._arrivals, None)
        if t is not None:
            self._loop.at(t, self._arrive, t)

    def _arrive(self, arg: object) -> None:
        if self.on_boundary is not None:
            self.on_boundary(1, self._loop.now)
        self.queue.append(float(arg))  # type: ignore[arg-type]
        self._next_arrival()
        if self.pos >= self._n and self.stream.run is None:
            self._begin_next(self._loop.now)
            self.gpu.wake()

    def _begin_next(self, now: float) -> None:
        if self.queue and self.state is ClientState.RUNNING:
            self.current_arrival = self.queue.popleft()
            self._seq_t0 = now
            self.pos = 0
            self._present(0, now)
            self.counts.issued += self._n

    def on_kernel_done(self, now: float) -> None:
        """Advance the request; at its end record the latency and start the next one."""
        self.counts.done += 1
        p = self.pos + 1
        self.pos = p
        if p >= self._n:
            self.stream.nxt = None
            self.completed.append((self.current_arrival, now - self.current_arrival))
            self.served.append((self.current_arrival, now - self._seq_t0))
            if self.on_boundary is not None:
                self.on_boundary(-1, now)
            self._begin_next(now)
        elif self.launch_blocking or self.host_per_kernel_s > 0.0:
            self._present(p, now)
        else:  # _present inlined: this runs for every kernel
            st = self.stream
            st.nxt = self._kernels[p]
            st.eligible_since = now

    def stop(self) -> None:
        """Stop serving: drop queued requests and the rest of the current one."""
        if self.pos < self._n:
            self.counts.discarded += self._n - self.pos - (1 if self.stream.run else 0)
        self.counts.discarded += self.gpu.detach(self)
        self.pos = self._n
        self.stream.nxt = None
        self._gate += 1
        self.queue.clear()
        self.state = ClientState.EXITED


class OfflineTrainer(SimClient):
    """A training job: iterations in a closed loop, at most one iteration issued ahead."""

    def __init__(
        self,
        cid: str,
        gpu: Gpu,
        profile: KernelProfile,
        *,
        sm_pct: float,
        mem_bytes: int,
        pinned_mem_bytes: int | None = None,
        restartable: bool = False,
        pid: int = 0,
    ) -> None:
        super().__init__(
            cid=cid,
            cls=ClientClass.OFFLINE,
            gpu=gpu,
            sm_pct=sm_pct,
            mem_bytes=mem_bytes,
            pinned_mem_bytes=pinned_mem_bytes,
            restartable=restartable,
            pid=pid,
        )
        self._load_profile(profile)
        self.frozen = False
        #: A freeze stops the process only ``FREEZE_S`` after it is asked for (W4).
        self._stops_at = 0.0
        self.held = False
        self.active = False
        #: In launch-blocking and bounded mode, the chunk whose launch a freeze stopped (resumed by
        #: the thaw).
        self._parked_launch: int | None = None
        #: Bounded in-flight mode: the tables for (bound, wake, host cost) and, per chunk of the
        #: current iteration, when it ended.
        self._bound: BoundTables | None = None
        self._bound_key: tuple[int, float, float] = (0, 0.0, 0.0)
        self._ends: list[float] = []
        #: Completion time of every training iteration.
        self.iterations: list[float] = []

    def start(self, now: float) -> None:
        """The process is up and begins its first iteration (unless frozen)."""
        self.active = True
        self.state = ClientState.RUNNING
        self.started_at_s = now
        self.pos = self._n
        self._parked_launch = None
        self.stream.nxt = None
        self._maybe_issue(now)
        self.gpu.attach(self)

    def set_inflight(self, bound: int, wake_s: float | None = None) -> None:
        """Bound the kernels in flight to ``bound`` (0: off), each slot freed ``wake_s`` late.

        ``GPUSHARE_MAX_INFLIGHT=bound`` (the LD_PRELOAD interposer): before launch ``j`` the
        process waits for launch ``j - bound`` to complete; the launch reaches the GPU ``wake_s``
        (default: the client's ``inflight_wake_s``) after that completion. Launch-blocking mode,
        when also set, takes precedence (each launch then synchronises anyway).

        Raises:
            ValueError: ``bound`` is not a whole number >= 0 or ``wake_s`` not finite and >= 0.
        """
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ValueError(f"in-flight bound {bound!r}: expected a whole number >= 0 (0: off)")
        if wake_s is not None:
            if not (isinstance(wake_s, int | float) and 0.0 <= wake_s < math.inf):
                raise ValueError(f"in-flight wake {wake_s!r} s: expected a finite time >= 0")
            self.inflight_wake_s = float(wake_s)
        self.inflight_bound = bound
        if bound:
            self._bound_for()

    def inflight_cost(self) -> float:
        """Run time alone in bounded mode (its bound and wake) over the asynchronous run time."""
        total = self.profile.total_s
        if self.inflight_bound <= 0 or total <= 0:
            return 1.0
        return self._bound_for().alone_s / total

    def _bound_for(self) -> BoundTables:
        key = (self.inflight_bound, self.inflight_wake_s, self.host_per_kernel_s)
        if self._bound is None or key != self._bound_key:
            self._bound = bound_tables(self.profile, *key)
            self._bound_key = key
            self._ends = [0.0] * self._n
        return self._bound

    def _present_bounded(self, p: int, now: float) -> None:
        """:meth:`_present` in bounded in-flight mode (a method of its own: no cost elsewhere)."""
        # Bounded: chunk p's first source kernel was launched when the kernel `bound` source
        # kernels before it completed, plus the wake (its completion estimated from its chunk's
        # recorded end); the chunk runs after the stall the bound gives it alone.
        tables = self._bound_for()
        q = tables.ref[p]
        launched = self._seq_t0
        if q >= 0:
            launched = max(launched, self._ends[q] - tables.tail_s[p] + self.inflight_wake_s)
        at = max(now + tables.stall_s[p], launched)
        st = self.stream
        if at <= now:
            if self.frozen and launched >= self._stops_at:
                st.nxt = None
                self._parked_launch = p
                return
            st.nxt = self._kernels[p]
            st.eligible_since = now
            return
        st.nxt = None
        self.gpu.loop.at(at, self._bounded_launch, (self._gate, p, launched))

    def _bounded_launch(self, arg: tuple[int, int, float]) -> None:
        # A launch made before the freeze took hold runs (the GPU has it); one after it parks.
        gate, p, launched = arg
        if gate != self._gate or p != self.pos:
            return
        if self.frozen and launched >= self._stops_at:
            self._parked_launch = p
            return
        st = self.stream
        st.nxt = self._kernels[p]
        st.eligible_since = self.gpu.loop.now
        self.gpu.wake()

    def _maybe_issue(self, now: float) -> None:
        running = not self.frozen or now < self._stops_at
        if self.active and running and self.pos >= self._n:
            self.pos = 0
            self._seq_t0 = now
            if self.inflight_bound > 0 and not self.launch_blocking:
                self._present_bounded(0, now)
            else:
                self._present(0, now)
            self.counts.issued += self._n

    def set_frozen(self, frozen: bool, now: float) -> None:
        """Freeze or thaw the CPU side (cgroup freezer); kernels already issued still run.

        A freeze stops the process ``FREEZE_S`` after it is asked for (an iteration ending
        before that still issues the next one); a thawed process issues again ``THAW_S`` later.
        """
        if frozen == self.frozen:
            return
        self.frozen = frozen
        if self.active and self.state in (ClientState.RUNNING, ClientState.FROZEN):
            self.state = ClientState.FROZEN if frozen else ClientState.RUNNING
        if frozen:
            self._stops_at = now + FREEZE_S
        else:
            self._stops_at = 0.0
            self.gpu.loop.at(now + THAW_S, self._thawed, self._gate)

    def _launched_one(self, arg: tuple[int, int]) -> None:
        # Launch-blocking mode: the CPU side launches each kernel itself, so a freeze that has
        # taken hold stops it before the next launch (the shallow queue's point, issue 14).
        gate, p = arg
        if (
            gate == self._gate
            and p == self.pos
            and self.frozen
            and self.gpu.loop.now >= self._stops_at
        ):
            self._parked_launch = p
            return
        super()._launched_one(arg)

    def _thawed(self, arg: object) -> None:
        if arg != self._gate or self.frozen:
            return
        now = self.gpu.loop.now
        parked, self._parked_launch = self._parked_launch, None
        if parked is not None and parked == self.pos and self.active:
            super()._launched_one((self._gate, parked))
            return
        self._maybe_issue(now)
        self.gpu.wake()

    def on_kernel_done(self, now: float) -> None:
        """Advance; at an iteration's end record it and issue the next unless frozen."""
        self.counts.done += 1
        p = self.pos + 1
        self.pos = p
        if p >= self._n:
            self.stream.nxt = None
            self.iterations.append(now)
            self._maybe_issue(now)
        elif self.launch_blocking:
            self._present(p, now)
        elif self.inflight_bound > 0:
            self._ends[p - 1] = now
            self._present_bounded(p, now)
        elif self.host_per_kernel_s > 0.0:  # the CPU issues each chunk in its own time
            if self.frozen and now > self._seq_t0 + self._issued_after[p] >= self._stops_at:
                self.stream.nxt = None
                self._parked_launch = p  # the freeze stopped the CPU before it issued chunk p
            else:
                self._present(p, now)
        else:  # _present inlined: this runs for every kernel
            st = self.stream
            st.nxt = self._kernels[p]
            st.eligible_since = now

    def stop(self, state: ClientState) -> None:
        """The process is gone (evicted, restarting, failed): its outstanding work is discarded."""
        if self.pos < self._n:
            self.counts.discarded += self._n - self.pos - (1 if self.stream.run else 0)
        self.counts.discarded += self.gpu.detach(self)
        self.pos = self._n
        self.stream.nxt = None
        self._gate += 1
        self._parked_launch = None
        self.active = False
        self.state = state
