"""Run one sharing policy on one scenario in virtual time and measure what it does.

:class:`SimNode` builds the simulated GPUs and clients of a scenario and applies actions (the
registry, launcher and actuators of the real daemon, simulated). :func:`run_policy` drives it: every
control period it builds each GPU's :class:`gpushare.model.Observation`, calls the policy's
``step`` and applies the returned actions; within the period it freezes and thaws offline clients
to follow the duty cycle (see :mod:`gpushare.model`). :func:`run_scenario` adds the standalone
references (online alone; offline alone) that overheads and normalised throughputs are measured
against.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpushare.config import Config
from gpushare.control.policy import Policy
from gpushare.model import (
    Action,
    Admit,
    Alert,
    ClientClass,
    ClientState,
    ClientView,
    Evict,
    Freeze,
    GpuSample,
    Limits,
    MpsState,
    Observation,
    ProbeReading,
    ProcessMemory,
    QueuedJob,
    RecoverMps,
    RestartClient,
    SetDuty,
    SetOfflineShare,
    Thaw,
)
from gpushare.sim import data
from gpushare.sim.gpu import EventLoop, Gpu, GpuMode
from gpushare.sim.scenario import OnlineSpec, Scenario
from gpushare.sim.tally import TallyScheduler, TallyServer, TallyTrainer
from gpushare.sim.workloads import (
    OfflineTrainer,
    OnlineServer,
    ProbeClient,
    SimClient,
    WindowLatencies,
    bursty_poisson_arrivals,
    percentile,
    percentile_sorted,
    poisson_arrivals,
    rate_series_arrivals,
    trace_arrivals,
)

GPU_NAME = "Tesla V100-SXM2-16GB (simulated)"
#: Quiet probe samples needed before a baseline is learned (as in gpushare.node.probe).
PROBE_BASELINE_MIN_SAMPLES = 20
#: Width of the bins of the time series (offline throughput, online p99).
SERIES_BIN_S = 1.0


#: Policies the simulator models by a GPU mode rather than by their actions.
TIME_SLICE_POLICIES = frozenset({"time-slicing"})


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    """How a policy wants the node set up, beyond its actions.

    ``offline_mps_priority`` (a policy attribute; 1 when absent) is the MPS priority offline clients
    start with: plain MPS runs everyone at 0. A policy named in :data:`TIME_SLICE_POLICIES` (or with
    ``gpu_mode = "time_slice"``) runs the GPU in the driver's time-sliced compute mode instead of
    MPS, and its duty actions are not applied: the driver's slices (``[gpu] slice``, ms long) are
    what time-slicing is, a duty cycle at the control period would be a different, coarser thing.
    """

    gpu_mode: GpuMode = "mps"
    offline_priority: int = 1
    #: Kernel-granularity preemption of offline work (the ``tally-like`` reference, sim/tally.py).
    kernel_preemption: bool = False

    @classmethod
    def of(cls, policy: object) -> PolicyTraits:
        """Read the traits a policy declares, defaulting the rest."""
        mode = getattr(policy, "gpu_mode", None)
        if mode is None and getattr(policy, "name", None) in TIME_SLICE_POLICIES:
            mode = "time_slice"
        prio = getattr(policy, "offline_mps_priority", 1)
        return cls(
            gpu_mode="time_slice" if mode == "time_slice" else "mps",
            offline_priority=int(prio) if prio in (0, 1) else 1,
            kernel_preemption=getattr(policy, "preemption", None) == "kernel",
        )


class SimNode:
    """The simulated node of a scenario: GPUs, clients, probes and the registry's view of them."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        traits: PolicyTraits = PolicyTraits(),  # noqa: B008 - frozen value
        with_offline: bool = True,
        with_online: bool = True,
    ) -> None:
        self.scenario = scenario
        self.traits = traits
        self.cfg: Config = scenario.config
        self.loop = EventLoop()
        g = scenario.gpu
        self.gpus = [
            Gpu(
                self.loop,
                uuid=f"GPU-sim-{i:04d}",
                index=i,
                sm_count=g.sm_count,
                mem_total_bytes=g.mem_total_bytes,
                parallel_fraction=g.parallel_fraction,
                bw_beta=g.bw_beta,
                mode=traits.gpu_mode,
                slice_s=g.slice_s,
                switch_s=g.switch_s,
                wave_scale=g.wave_scale,
            )
            for i in range(g.count)
        ]
        self.by_uuid = {gpu.uuid: gpu for gpu in self.gpus}
        #: Each online server's latency window, kept sorted across control periods.
        self._windows: dict[str, WindowLatencies] = {}
        self.duty = {gpu.uuid: 1.0 for gpu in self.gpus}
        self.offline_share = {
            gpu.uuid: self.cfg.control.offline_sm_pct_default for gpu in self.gpus
        }
        self.probes = {
            gpu.uuid: ProbeClient(gpu, period_s=self.cfg.probe.period_s, kernel_s=g.probe_kernel_s)
            for gpu in self.gpus
        }
        self.online: list[OnlineServer] = []
        self.offline: list[OfflineTrainer] = []
        self.submit_at: dict[str, float] = {}
        self.alerts: list[Alert] = []
        self.actions_applied: dict[str, int] = {}
        self.mem_peak_bytes = {gpu.uuid: 0 for gpu in self.gpus}
        self._pid = 1000
        self._restart_seq: dict[str, int] = {}
        seed = scenario.seed
        tally = (
            {gpu.uuid: TallyScheduler() for gpu in self.gpus} if traits.kernel_preemption else {}
        )
        server_cls = TallyServer if tally else OnlineServer
        trainer_cls = TallyTrainer if tally else OfflineTrainer
        if with_online:
            for k, spec in enumerate(scenario.online):
                gpu = self.gpus[spec.gpu]
                prof = data.load_profile(spec.profile, g.merge_online_us, g.sm_count)
                server = server_cls(
                    spec.name,
                    gpu,
                    prof,
                    arrivals_for(spec, prof.total_s, seed * 1000 + k, scenario.duration_s),
                    sm_pct=spec.sm_pct,
                    mem_bytes=spec.mem_bytes,
                    slo_p99_ms=spec.slo_p99_ms,
                    pid=self._next_pid(),
                )
                server.launch_blocking = spec.launch_blocking
                server.launch_gap_s = g.launch_gap_s
                if isinstance(server, TallyServer):
                    server.tally = tally[gpu.uuid]
                    server.tally.servers.append(server)
                self.online.append(server)
        if with_offline:
            for spec_off in scenario.offline:
                gpu = self.gpus[spec_off.gpu]
                prof = data.load_profile(spec_off.profile, g.merge_offline_us, g.sm_count)
                trainer = trainer_cls(
                    spec_off.name,
                    gpu,
                    prof,
                    sm_pct=self.cfg.control.offline_sm_pct_default,
                    mem_bytes=spec_off.mem_bytes,
                    pinned_mem_bytes=spec_off.pinned_mem_bytes,
                    restartable=spec_off.restartable,
                )
                trainer.priority = traits.offline_priority
                trainer.launch_blocking = spec_off.launch_blocking
                trainer.launch_gap_s = g.launch_gap_s
                if isinstance(trainer, TallyTrainer):
                    # One kernel at a time through its own gate, with no launch gap.
                    trainer.launch_blocking, trainer.launch_gap_s = True, 0.0
                    trainer.tally = tally[gpu.uuid]
                    trainer.tally.trainers.append(trainer)
                self.offline.append(trainer)
                self.submit_at[spec_off.name] = spec_off.submit_s

    def _next_pid(self) -> int:
        self._pid += 1
        return self._pid

    @property
    def clients(self) -> list[SimClient]:
        """Every online and offline client."""
        return [*self.online, *self.offline]

    def client(self, cid: str) -> SimClient | None:
        """The client with this id, if any."""
        return next((c for c in self.clients if c.cid == cid), None)

    def start(self) -> None:
        """Start probes and online services (online clients start at t = 0)."""
        for probe in self.probes.values():
            probe.start(self.loop)
        for server in self.online:
            if self._allocate(server):
                server.gpu.attach(server)
                server.start(self.loop)

    # --- memory --------------------------------------------------------------------------------

    def mem_used(self, gpu: Gpu) -> int:
        """Bytes allocated on a GPU by its live clients."""
        return sum(c.mem_bytes for c in self.clients if c.gpu is gpu and c.state.is_live)

    def _allocate(self, c: SimClient) -> bool:
        """Allocate a starting client's memory; a failure fails the client (as a CUDA OOM would)."""
        if c.pinned_mem_bytes is not None and c.mem_bytes > c.pinned_mem_bytes:
            self._fail(c, "allocation over the client's pinned memory limit")
            return False
        used = self.mem_used(c.gpu) - (c.mem_bytes if c.state.is_live else 0)
        if used + c.mem_bytes > c.gpu.mem_total_bytes:
            self._fail(c, "out of GPU memory")
            return False
        c.state = ClientState.STARTING if c.cls is ClientClass.OFFLINE else ClientState.RUNNING
        peak = used + c.mem_bytes
        self.mem_peak_bytes[c.gpu.uuid] = max(self.mem_peak_bytes[c.gpu.uuid], peak)
        return True

    def _fail(self, c: SimClient, reason: str) -> None:
        c.state = ClientState.FAILED
        c.failures += 1
        c.fail_reason = reason

    # --- duty cycle ----------------------------------------------------------------------------

    def apply_duty(self, gpu: Gpu, period_s: float) -> None:
        """Thaw the GPU's offline clients for ``duty`` of this period, freeze them for the rest."""
        now = self.loop.now
        d = self.duty[gpu.uuid]
        running = False
        for c in self.offline:
            if c.gpu is not gpu or not c.active:
                continue
            if c.held or d <= 0.0:
                c.set_frozen(True, now)
                running = running or c.run is not None or c.head() is not None
                continue
            c.set_frozen(False, now)
            running = True
            if d < 1.0:
                self.loop.at(now + d * period_s, self._freeze_if_not_thawed, (c, now))
        self.probes[gpu.uuid].offline_running = running

    def _freeze_if_not_thawed(self, arg: object) -> None:
        c, _tick = cast(tuple[OfflineTrainer, float], arg)
        if c.active:
            c.set_frozen(True, self.loop.now)

    # --- actions -------------------------------------------------------------------------------

    def apply(self, gpu: Gpu, actions: Sequence[Action]) -> None:
        """Apply one GPU's actions at the current virtual time."""
        now = self.loop.now
        for a in actions:
            kind = type(a).__name__
            self.actions_applied[kind] = self.actions_applied.get(kind, 0) + 1
            if isinstance(a, SetDuty):
                if a.gpu_uuid in self.duty and self.traits.gpu_mode == "mps":
                    self.duty[a.gpu_uuid] = min(1.0, max(0.0, a.duty))
            elif isinstance(a, Freeze | Thaw):
                c = self._offline(a.client_id)
                if c is not None:
                    c.held = isinstance(a, Freeze)
                    if c.held and c.active:
                        c.set_frozen(True, now)
            elif isinstance(a, SetOfflineShare):
                if a.gpu_uuid in self.offline_share:
                    self.offline_share[a.gpu_uuid] = a.sm_pct
            elif isinstance(a, RestartClient):
                c = self._offline(a.client_id)
                if c is not None and c.active and c.restartable:
                    c.stop(ClientState.RESTARTING)
                    c.set_limits(a.sm_pct)
                    self._launch_later(c, self.scenario.gpu.restart_s)
            elif isinstance(a, Evict):
                c = self._offline(a.client_id)
                if c is not None and c.state.is_live:
                    c.stop(ClientState.QUEUED if a.requeue else ClientState.EXITED)
                    c.held = False
                    if a.requeue:
                        self.submit_at[c.cid] = now + self.cfg.control.failure_backoff_min_s
            elif isinstance(a, Admit):
                c = self._offline(a.client_id)
                if c is not None and c.state is ClientState.QUEUED:
                    self.admit(c, self.by_uuid.get(a.gpu_uuid, c.gpu), a.sm_pct)
            elif isinstance(a, RecoverMps):
                for c in self.offline:
                    if c.gpu.uuid == a.gpu_uuid and c.state.is_live:
                        c.stop(ClientState.QUEUED if c.restartable else ClientState.EXITED)
                        self.submit_at[c.cid] = now
            elif isinstance(a, Alert):
                self.alerts.append(a)

    def _offline(self, cid: str) -> OfflineTrainer | None:
        return next((c for c in self.offline if c.cid == cid), None)

    def admit(self, c: OfflineTrainer, gpu: Gpu, sm_pct: float) -> None:
        """Start a queued offline job on a GPU under ``sm_pct`` (after the start-up time)."""
        if gpu is not c.gpu:
            c.gpu = gpu
        c.set_limits(sm_pct)
        self._launch_later(c, self.scenario.gpu.start_s)

    def _launch_later(self, c: OfflineTrainer, delay_s: float) -> None:
        if not self._allocate(c):
            return
        c.state = ClientState.RESTARTING if c.started_at_s is not None else ClientState.STARTING
        seq = self._restart_seq.get(c.cid, 0) + 1
        self._restart_seq[c.cid] = seq
        self.loop.at(self.loop.now + delay_s, self._launched, (c, seq))

    def _launched(self, arg: object) -> None:
        c, seq = cast(tuple[OfflineTrainer, int], arg)
        if self._restart_seq.get(c.cid) != seq or c.state not in (
            ClientState.STARTING,
            ClientState.RESTARTING,
        ):
            return
        c.pid = self._next_pid()
        # The launcher puts the process in its (frozen, when the duty is 0) cgroup before it runs.
        c.frozen = c.held or self.duty[c.gpu.uuid] <= 0.0
        c.start(self.loop.now)
        if c.frozen:
            c.state = ClientState.FROZEN

    # --- observation ---------------------------------------------------------------------------

    def observe(self, gpu: Gpu, window_stats: tuple[float, float, float]) -> Observation:
        """Build the GPU's observation from the model's state, as the daemon's sensors would."""
        now = self.loop.now
        busy_s, sm_s, dt = window_stats
        used = self.mem_used(gpu)
        live = [c for c in self.clients if c.gpu is gpu and c.state.is_live]
        sample = GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=GPU_NAME,
            sm_count=gpu.sm_count,
            mem_total_bytes=gpu.mem_total_bytes,
            mem_used_bytes=used,
            mem_free_bytes=gpu.mem_total_bytes - used,
            gpu_util_pct=100.0 * busy_s / dt if dt > 0 else None,
            sm_active_pct=100.0 * sm_s / (dt * gpu.sm_count) if dt > 0 else None,
            processes=tuple(ProcessMemory(c.pid, c.mem_bytes) for c in live),
        )
        views = tuple(self._view(c, now) for c in self.clients if c.gpu is gpu)
        control = self.cfg.control
        return Observation(
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            sample=sample,
            probe=self.probe_reading(gpu.uuid),
            clients=views,
            mps_state=MpsState.UP,
            mem_reserve_bytes=control.online_memory_reserve_bytes,
            offline_sm_pct_max=control.offline_sm_pct_max,
        )

    def _view(self, c: SimClient, now: float) -> ClientView:
        p99: float | None = None
        reason: str | None = None
        if isinstance(c, OnlineServer):
            window = self._windows.get(c.cid)
            if window is None or window.completed is not c.completed:
                window = self._windows[c.cid] = WindowLatencies(c.completed)
            recent = window.update(now - self.cfg.latency.window_s)
            if len(recent) >= self.cfg.latency.min_samples:
                p99 = percentile_sorted(recent, 99.0)
            else:
                reason = f"{len(recent)} samples in the window (< {self.cfg.latency.min_samples})"
        state = c.state
        held = isinstance(c, OfflineTrainer) and c.held
        return ClientView(
            client_id=c.cid,
            cls=c.cls,
            state=state,
            limits=Limits(
                sm_pct=c.sm_pct, pinned_mem_bytes=c.pinned_mem_bytes, priority=c.priority
            ),
            uid=c.uid,
            pid=c.pid if state.is_live else None,
            mem_used_bytes=c.mem_bytes if state.is_live else None,
            slo_p99_ms=c.slo_p99_ms,
            p99_ms=p99,
            p99_reason=reason,
            restartable=c.restartable,
            failures=c.failures,
            started_at_s=c.started_at_s,
            held=held,
        )

    def probe_reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's reading, by the rules of ``gpushare.node.probe.ProbeWindow``.

        Latency is the p99 over the probe window (a launch not yet back counts as stalled);
        the baseline is the p99 of the samples taken while no offline work ran, over the baseline
        window ending at the last such sample, once there are at least
        :data:`PROBE_BASELINE_MIN_SAMPLES`; when offline work runs throughout, the last learned
        baseline is kept.
        """
        probe = self.probes[gpu_uuid]
        now = self.loop.now
        pc = self.cfg.probe
        samples = probe.samples
        window = [lat for t, lat, _ in _tail(samples, now - pc.window_s)]
        if not window:
            return ProbeReading(reason="no probe samples yet")
        quiet_end = next((t for t, _, off in reversed(samples) if not off), None)
        if quiet_end is not None and quiet_end != probe.baseline_at_s:
            lo = quiet_end - pc.baseline_window_s
            quiet = [lat for t, lat, off in _tail(samples, lo) if not off and t <= quiet_end]
            if len(quiet) >= PROBE_BASELINE_MIN_SAMPLES:
                probe.baseline_ms = percentile(quiet, 99.0) * 1e3
                probe.baseline_at_s = quiet_end
        lat_ms = percentile(window, 99.0) * 1e3
        if probe.pending_since is not None:
            stalled_ms = (now - samples[-1][0] - probe.period_s) * 1e3 if samples else 0.0
            lat_ms = max(lat_ms, stalled_ms)
        base = probe.baseline_ms
        return ProbeReading(
            latency_ms=lat_ms,
            run_ms=probe.kernel_s * 1e3,
            baseline_ms=base,
            ratio=lat_ms / base if base else None,
            samples=len(window),
            reason=None if base else "no baseline yet: needs quiet samples",
        )


def _tail(
    samples: list[tuple[float, float, bool]], lo: float
) -> Iterator[tuple[float, float, bool]]:
    """Samples launched at or after ``lo`` (they are in launch order)."""
    i = len(samples)
    while i > 0 and samples[i - 1][0] >= lo:
        i -= 1
    return iter(samples[i:])


def arrivals_for(spec: OnlineSpec, standalone_s: float, seed: int, end_s: float) -> Iterator[float]:
    """The arrival process of an online service."""
    if spec.arrivals == "poisson":
        rps = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
        if spec.burst is not None:
            return bursty_poisson_arrivals(rps, spec.burst, seed, 0.0, end_s)
        return poisson_arrivals(rps, seed, end_s)
    assert spec.trace is not None
    if spec.arrivals == "azure":
        times = data.load_azure_arrivals(spec.trace)
        span = times[-1] - times[0] or 1.0
        mean_rps = len(times) / span * spec.trace_speedup
        want = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
        scale = min(1.0, want / mean_rps) if mean_rps > 0 else 1.0
        return trace_arrivals(
            times,
            start_s=spec.trace_start_s,
            speedup=spec.trace_speedup,
            rate_scale=scale,
            end_s=end_s,
        )
    series = data.load_genai_qps(spec.trace)
    start_bin = int(spec.trace_start_s // 60)
    series = series[start_bin:] or series
    peak = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
    return rate_series_arrivals(series, bin_s=spec.bin_s, peak_rps=peak, seed=seed, end_s=end_s)


# --- results -----------------------------------------------------------------------------------


@dataclass
class OnlineResult:
    """What one online service saw in the measured window."""

    name: str
    requests: int
    p50_ms: float
    p99_ms: float
    slo_p99_ms: float | None
    slo_attainment: float | None
    latencies_ms: list[float] = field(repr=False, default_factory=list)


@dataclass
class OfflineResult:
    """What one offline job achieved in the measured window."""

    name: str
    iterations: int
    iter_per_s: float
    standalone_iter_per_s: float
    final_state: str
    failure: str | None


@dataclass
class RunResult:
    """One policy on one scenario."""

    scenario: str
    policy: str
    virtual_s: float
    wall_s: float
    online: list[OnlineResult]
    offline: list[OfflineResult]
    busy_fraction: float
    sm_active_fraction: float
    mem_peak_bytes: int
    mem_total_bytes: int
    actions: dict[str, int]
    kernels: dict[str, int]
    series: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def speed_factor(self) -> float:
        """Virtual seconds simulated per wall-clock second."""
        return self.virtual_s / self.wall_s if self.wall_s > 0 else math.inf


ProgressFn = Callable[[float], None]


def run_policy(
    scenario: Scenario,
    policy: Policy[Any] | None,
    *,
    name: str | None = None,
    with_offline: bool = True,
    with_online: bool = True,
    slo_ms: dict[str, float] | None = None,
    progress: ProgressFn | None = None,
) -> RunResult:
    """Run ``policy`` (None: no controller, every client runs free) on the scenario.

    ``slo_ms`` gives the online SLOs (the scenario's, or derived from the standalone run).
    """
    wall0 = time.perf_counter()
    traits = PolicyTraits.of(policy) if policy is not None else PolicyTraits()
    node = SimNode(scenario, traits=traits, with_offline=with_offline, with_online=with_online)
    for c in node.online:
        if slo_ms and c.cid in slo_ms:
            c.slo_p99_ms = slo_ms[c.cid]
    node.start()
    loop = node.loop
    period = scenario.config.control.period_s
    states = {g.uuid: policy.initial_state(g.uuid, 0.0) for g in node.gpus} if policy else {}
    duty_series: dict[str, list[tuple[float, float]]] = {g.uuid: [] for g in node.gpus}
    busy_total = {g.uuid: 0.0 for g in node.gpus}
    sm_total = {g.uuid: 0.0 for g in node.gpus}
    queued_since: dict[str, float] = {}
    warmup, end = scenario.warmup_s, scenario.duration_s
    t = 0.0
    ticks = 0
    while t < end - 1e-12:
        t_next = min(end, (ticks + 1) * period)
        # Offline jobs reach the queue at their submit time.
        for job in node.offline:
            if job.state is ClientState.QUEUED and node.submit_at.get(job.cid, math.inf) <= t:
                queued_since.setdefault(job.cid, t)
        observations: dict[str, Observation] = {}
        for gpu in node.gpus:
            stats = gpu.take_stats()
            dt = loop.now - stats.since_s
            if loop.now > warmup:
                lo = max(stats.since_s, warmup)
                frac = (loop.now - lo) / dt if dt > 0 else 0.0
                busy_total[gpu.uuid] += stats.busy_s * frac
                sm_total[gpu.uuid] += stats.sm_s * frac
            if policy is not None:
                obs = node.observe(gpu, (stats.busy_s, stats.sm_s, dt))
                observations[gpu.uuid] = obs
                states[gpu.uuid], actions = policy.step(states[gpu.uuid], obs, loop.now)
                node.apply(gpu, actions)
            duty_series[gpu.uuid].append((loop.now, node.duty[gpu.uuid]))
        admit_fn = _admission_function()
        if admit_fn is not None and observations:
            queue = [
                QueuedJob(
                    client_id=job.cid,
                    uid=job.uid,
                    mem_bytes=job.mem_bytes,
                    sm_pct=None,
                    gpu=job.gpu.uuid,
                    submitted_at_s=since,
                    restartable=job.restartable,
                )
                for job in node.offline
                if (since := queued_since.get(job.cid)) is not None
                and job.state is ClientState.QUEUED
            ]
            if queue:
                admits = admit_fn(queue, observations, dict(node.offline_share), loop.now)
                for admit in admits:
                    node.apply(node.by_uuid[admit.gpu_uuid], [admit])
        # Without gpushare's admission module (or without a policy), the simulator admits a job
        # left queued for a period under the GPU's current offline share.
        for job in node.offline:
            since = queued_since.get(job.cid)
            if (
                since is not None
                and job.state is ClientState.QUEUED
                and (admit_fn is None or not observations)
                and t - since >= period
            ):
                node.admit(job, job.gpu, node.offline_share[job.gpu.uuid])
            if job.state is not ClientState.QUEUED:
                queued_since.pop(job.cid, None)
        for gpu in node.gpus:
            node.apply_duty(gpu, t_next - t)
        loop.run_until(t_next)
        t = t_next
        ticks += 1
        if progress is not None:
            progress(t / end)
    for gpu in node.gpus:
        stats = gpu.take_stats()
        if loop.now > warmup:
            busy_total[gpu.uuid] += stats.busy_s
            sm_total[gpu.uuid] += stats.sm_s
    wall = time.perf_counter() - wall0
    return _collect(node, scenario, policy, name, wall, duty_series, busy_total, sm_total)


AdmitFn = Callable[
    [Sequence[QueuedJob], dict[str, Observation], dict[str, float], float], list[Admit]
]


def _admission_function() -> AdmitFn | None:
    """The node-level admission rule of the controller package, when it provides one."""
    try:
        module = importlib.import_module("gpushare.control.admission")
    except ImportError:
        return None
    fn = getattr(module, "admit", None)
    return cast(AdmitFn, fn) if callable(fn) else None


def _collect(
    node: SimNode,
    scenario: Scenario,
    policy: Policy[Any] | None,
    name: str | None,
    wall: float,
    duty_series: dict[str, list[tuple[float, float]]],
    busy_total: dict[str, float],
    sm_total: dict[str, float],
) -> RunResult:
    warmup, end = scenario.warmup_s, scenario.duration_s
    window = end - warmup
    online: list[OnlineResult] = []
    nbins = max(1, math.ceil(window / SERIES_BIN_S))
    series: dict[str, Any] = {"bin_s": SERIES_BIN_S, "t0_s": warmup, "duty": {}, "offline_ips": {}}
    series["online_p99_ms"] = {}
    for c in node.online:
        lats = [lat * 1e3 for arr, lat in c.completed if arr >= warmup]
        slo = c.slo_p99_ms
        att = (sum(1 for x in lats if x <= slo) / len(lats)) if (slo and lats) else None
        online.append(
            OnlineResult(
                name=c.cid,
                requests=len(lats),
                p50_ms=percentile(lats, 50.0),
                p99_ms=percentile(lats, 99.0),
                slo_p99_ms=slo,
                slo_attainment=att,
                latencies_ms=lats,
            )
        )
        bins: list[list[float]] = [[] for _ in range(nbins)]
        for arr, lat in c.completed:
            if arr >= warmup:
                bins[min(nbins - 1, int((arr - warmup) / SERIES_BIN_S))].append(lat * 1e3)
        series["online_p99_ms"][c.cid] = [percentile(b, 99.0) if b else None for b in bins]
    offline: list[OfflineResult] = []
    for job in node.offline:
        its = [t for t in job.iterations if t >= warmup]
        standalone = 1.0 / job.profile.total_s
        offline.append(
            OfflineResult(
                name=job.cid,
                iterations=len(its),
                iter_per_s=len(its) / window,
                standalone_iter_per_s=standalone,
                final_state=job.state.value,
                failure=job.fail_reason,
            )
        )
        counts = [0] * nbins
        for t in its:
            counts[min(nbins - 1, int((t - warmup) / SERIES_BIN_S))] += 1
        series["offline_ips"][job.cid] = [n / SERIES_BIN_S / standalone for n in counts]
    series["duty"] = {u: [(t, d) for t, d in s if t >= warmup] for u, s in duty_series.items()}
    n_gpus = len(node.gpus)
    kernels = {
        "issued": sum(c.counts.issued for c in node.clients),
        "done": sum(c.counts.done for c in node.clients),
        "discarded": sum(c.counts.discarded for c in node.clients),
    }
    return RunResult(
        scenario=scenario.name,
        policy=name or str(getattr(policy, "name", "none")),
        virtual_s=end,
        wall_s=wall,
        online=online,
        offline=offline,
        busy_fraction=sum(busy_total.values()) / (window * n_gpus),
        sm_active_fraction=sum(sm_total[g.uuid] / (window * g.sm_count) for g in node.gpus)
        / n_gpus,
        mem_peak_bytes=max(node.mem_peak_bytes.values()),
        mem_total_bytes=node.gpus[0].mem_total_bytes,
        actions=dict(node.actions_applied),
        kernels=kernels,
        series=series,
    )


@dataclass
class ScenarioResult:
    """Every policy on one scenario, with the standalone reference."""

    scenario: Scenario
    alone: RunResult | None
    slo_ms: dict[str, float]
    runs: list[RunResult]


def standalone(scenario: Scenario) -> tuple[RunResult | None, dict[str, float]]:
    """Run the online services alone; return that run and each service's SLO in ms.

    A service's SLO is its ``slo_p99_ms`` or, when absent, ``slo_factor`` x its p99 alone.
    """
    if not scenario.online:
        return None, {}
    alone = run_policy(scenario, None, name="alone", with_offline=False)
    slo: dict[str, float] = {}
    for spec, res in zip(scenario.online, alone.online, strict=True):
        slo[spec.name] = spec.slo_p99_ms or spec.slo_factor * res.p99_ms
    return alone, slo


def run_scenario(
    scenario: Scenario,
    policies: Sequence[tuple[str, Policy[Any]]],
    *,
    progress: Callable[[str, float], None] | None = None,
) -> ScenarioResult:
    """Run the standalone reference and then every policy on the scenario."""
    alone, slo = standalone(scenario)
    runs = []
    for pname, policy in policies:

        def tick(frac: float, pname: str = pname) -> None:
            if progress is not None:
                progress(pname, frac)

        runs.append(run_policy(scenario, policy, name=pname, slo_ms=slo, progress=tick))
    return ScenarioResult(scenario, alone, slo, runs)
