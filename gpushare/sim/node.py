"""The simulated node of a scenario: its GPUs, its clients' workloads, and what sensors read there.

:class:`SimNode` owns the GPU model (:mod:`gpushare.sim.gpu`) and the workloads
(:mod:`gpushare.sim.workloads`) of a :class:`~gpushare.sim.scenario.Scenario`, allocates their GPU
memory, keeps the table of their simulated processes (pid to client; an exit is reported through
:attr:`SimNode.on_process_exit`), and computes what NVML and the probe would read. It decides
nothing: the daemon's own control loop drives it through the node Protocols of
:mod:`gpushare.sim.adapters`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from gpushare.config import Config
from gpushare.control.policy import Policy
from gpushare.model import (
    ClientClass,
    ClientState,
    GpuSample,
    ProbeReading,
    ProcessMemory,
    SmPeriod,
)
from gpushare.sim import data
from gpushare.sim.arrivals import arrivals_for
from gpushare.sim.checkpoint import Checkpoints
from gpushare.sim.gpu import EventLoop, Gpu, GpuMode
from gpushare.sim.inflight_switch import SimBoundWriter
from gpushare.sim.llm import LlmServer
from gpushare.sim.llm_node import llm_servers
from gpushare.sim.probe import ProbeClient
from gpushare.sim.scenario import GpuSpec, Scenario
from gpushare.sim.tally import TallyScheduler, TallyServer, TallyTrainer
from gpushare.sim.workloads import (
    OfflineTrainer,
    OnlineServer,
    SimClient,
    request_alone_s,
)

GPU_NAME = "Tesla V100-SXM2-16GB (simulated)"

#: Policies the simulator models by a GPU mode rather than by their actions.
TIME_SLICE_POLICIES = frozenset({"time-slicing"})


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    """How a policy wants the node set up, beyond its actions.

    ``offline_mps_priority`` (declared by every :class:`~gpushare.control.policy.Policy`; 1 unless
    0 or 1) is the MPS priority offline clients start with: plain MPS runs everyone at 0. A policy
    with ``gpu_mode = "time_slice"`` (or named in :data:`TIME_SLICE_POLICIES`) runs the GPU in the driver's time-sliced compute mode instead of
    MPS (``[gpu] slice``, ms long); the simulated NVML reads it as compute mode ``"default"``, and
    the time-slicing policy, seeing ``Observation.time_sliced``, then sends no duty.
    """

    gpu_mode: GpuMode = "mps"
    offline_priority: int = 1
    #: Kernel-granularity preemption of offline work (the ``tally-like`` reference, sim/tally.py).
    kernel_preemption: bool = False

    @classmethod
    def of(cls, policy: Policy[Any]) -> PolicyTraits:
        """Read the traits a policy declares."""
        sliced = policy.gpu_mode == "time_slice" or policy.name in TIME_SLICE_POLICIES
        prio = policy.offline_mps_priority
        return cls(
            gpu_mode="time_slice" if sliced else "mps",
            offline_priority=int(prio) if prio in (0, 1) else 1,
            kernel_preemption=policy.preemption == "kernel",
        )


def launch_costs(trainer: OfflineTrainer, g: GpuSpec) -> None:
    """Give a training job the ``[gpu]`` section's launch costs.

    The blocking launch gap (W3), the bounded queue's wake (W3b) and the job's own CPU time per
    kernel (a sensitivity, 0 by default).
    """
    trainer.launch_gap_s = g.launch_gap_s
    trainer.inflight_wake_s = g.inflight_wake_s
    if g.train_host_per_kernel_s > 0.0:
        trainer.set_host_cost(g.train_host_per_kernel_s)


class SimNode:
    """The simulated node of a scenario: GPUs, clients, probes and their processes."""

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
        self.gpus = [self._gpu(i) for i in range(g.count)]
        self.by_uuid = {gpu.uuid: gpu for gpu in self.gpus}
        self.probes = {
            gpu.uuid: ProbeClient(gpu, period_s=self.cfg.probe.period_s, kernel_s=g.probe_kernel_s)
            for gpu in self.gpus
        }
        self.online: list[OnlineServer] = []
        self.offline: list[OfflineTrainer] = []
        #: LLM servers (``[[llm]]``, :mod:`gpushare.sim.llm_node`): online, reporting token timings.
        self.llm: list[LlmServer] = []
        #: When each offline job of the scenario reaches the queue, and its ``--queue``.
        self.submit_at: dict[str, float] = {}
        self.queue_mode: dict[str, str | None] = {}
        #: Offline jobs the scenario runs launch-blocking whatever their queue mode.
        self.always_blocking: set[str] = set()
        #: Issue 32: the daemon's live queue switch in virtual time (set by the runner).
        self.inflight_switch: SimBoundWriter | None = None
        #: Issue 32: the work a restart loses (gpushare.sim.checkpoint).
        self.checkpoints = Checkpoints(self)
        self.mem_peak_bytes = {gpu.uuid: 0 for gpu in self.gpus}
        #: The live simulated processes by pid, and who hears of their exits.
        self.processes: dict[int, SimClient] = {}
        self.on_process_exit: Callable[[int, int | None], None] | None = None
        self._pid = 1000
        tally = (
            {gpu.uuid: TallyScheduler() for gpu in self.gpus} if traits.kernel_preemption else {}
        )
        if with_online:
            self._add_online(tally)
            self.llm = llm_servers(scenario, self.gpus, self.next_pid)
        if with_offline:
            self._add_offline(tally)

    def _gpu(self, index: int) -> Gpu:
        g = self.scenario.gpu
        return Gpu(
            self.loop,
            uuid=f"GPU-sim-{index:04d}",
            index=index,
            sm_count=g.sm_count,
            mem_total_bytes=g.mem_total_bytes,
            parallel_fraction=g.parallel_fraction,
            bw_beta=g.bw_beta,
            mode=self.traits.gpu_mode,
            slice_s=g.slice_s,
            switch_s=g.switch_s,
            wave_scale=g.wave_scale,
        )

    def _add_online(self, tally: dict[str, TallyScheduler]) -> None:
        """The scenario's online services, each with its arrival process, in scenario order."""
        scenario, g, seed = self.scenario, self.scenario.gpu, self.scenario.seed
        server_cls = TallyServer if tally else OnlineServer
        for k, spec in enumerate(scenario.online):
            gpu = self.gpus[spec.gpu]
            prof = data.load_profile(spec.profile, g.merge_online_us, g.sm_count)
            server = server_cls(
                spec.name,
                gpu,
                prof,
                arrivals_for(
                    spec,
                    request_alone_s(prof, g.host_per_kernel_s),
                    seed * 1000 + k,
                    scenario.duration_s,
                ),
                sm_pct=spec.sm_pct,
                mem_bytes=spec.mem_bytes,
                slo_p99_ms=spec.slo_p99_ms,
                pid=self.next_pid(),
            )
            server.launch_blocking = spec.launch_blocking
            server.launch_gap_s = g.launch_gap_s
            server.set_host_cost(g.host_per_kernel_s)
            if isinstance(server, TallyServer):
                server.tally = tally[gpu.uuid]
                server.tally.servers.append(server)
            self.online.append(server)

    def _add_offline(self, tally: dict[str, TallyScheduler]) -> None:
        """The scenario's offline jobs, waiting for their submit time."""
        g, traits = self.scenario.gpu, self.traits
        trainer_cls = TallyTrainer if tally else OfflineTrainer
        for spec_off in self.scenario.offline:
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
            launch_costs(trainer, g)
            if isinstance(trainer, TallyTrainer):
                # One kernel at a time through its own gate, with no launch gap.
                trainer.launch_blocking, trainer.launch_gap_s = True, 0.0
                trainer.tally = tally[gpu.uuid]
                trainer.tally.trainers.append(trainer)
            self.offline.append(trainer)
            self.submit_at[spec_off.name] = spec_off.submit_s
            self.queue_mode[spec_off.name] = spec_off.queue
            if spec_off.launch_blocking:
                self.always_blocking.add(spec_off.name)

    def next_pid(self) -> int:
        """A fresh pid for a simulated process."""
        self._pid += 1
        return self._pid

    @property
    def clients(self) -> list[SimClient]:
        """Every online, LLM and offline client."""
        return [*self.online, *self.llm, *self.offline]

    def client(self, cid: str) -> SimClient | None:
        """The client with this id, if any."""
        return next((c for c in self.clients if c.cid == cid), None)

    def start(self) -> None:
        """Start probes and online services (online clients start at t = 0)."""
        for probe in self.probes.values():
            probe.start(self.loop)
        for server in self.online:
            if self.allocate(server):
                self.processes[server.pid] = server
                server.gpu.attach(server)
                server.start(self.loop)
        for srv in self.llm:
            if self.allocate(srv):
                self.processes[srv.pid] = srv
                srv.start(self.loop)

    # --- memory --------------------------------------------------------------------------------

    def mem_used(self, gpu: Gpu) -> int:
        """Bytes allocated on a GPU by its live clients."""
        return sum(c.mem_bytes for c in self.clients if c.gpu is gpu and c.state.is_live)

    def allocate(self, c: SimClient) -> bool:
        """Allocate a starting client's memory; a failure fails the client (as a CUDA OOM would)."""
        if c.pinned_mem_bytes is not None and c.mem_bytes > c.pinned_mem_bytes:
            self.fail(c, "allocation over the client's pinned memory limit")
            return False
        used = self.mem_used(c.gpu) - (c.mem_bytes if c.state.is_live else 0)
        if used + c.mem_bytes > c.gpu.mem_total_bytes:
            self.fail(c, "out of GPU memory")
            return False
        c.state = ClientState.STARTING if c.cls is ClientClass.OFFLINE else ClientState.RUNNING
        peak = used + c.mem_bytes
        self.mem_peak_bytes[c.gpu.uuid] = max(self.mem_peak_bytes[c.gpu.uuid], peak)
        return True

    def fail(self, c: SimClient, reason: str) -> None:
        """The client failed (its process ends with an error)."""
        c.state = ClientState.FAILED
        c.failures += 1
        c.fail_reason = reason

    # --- processes -----------------------------------------------------------------------------

    def end_process(self, pid: int, code: int | None, state: ClientState) -> None:
        """A simulated process ends: its GPU work is discarded and its exit reported (at once)."""
        c = self.processes.pop(pid, None)
        if c is None:
            return
        stop_work(c, state)
        if self.on_process_exit is not None:
            # Reported from the event loop, as the exit watcher reports from its own thread.
            self.loop.at(self.loop.now, self._report_exit, (pid, code))

    def _report_exit(self, arg: object) -> None:
        pid, code = cast(tuple[int, int | None], arg)
        if self.on_process_exit is not None:
            self.on_process_exit(pid, code)

    # --- sensors -------------------------------------------------------------------------------

    def sample(
        self,
        gpu: Gpu,
        busy_s: float,
        sm_s: float,
        dt: float,
        *,
        sm_periods: tuple[SmPeriod, ...] | None = None,
        compute_mode: str | None = None,
    ) -> GpuSample:
        """What NVML reads on a GPU: memory, its processes, utilisation over the last ``dt``.

        ``sm_periods`` and ``compute_mode`` are the caller's (:mod:`gpushare.sim.adapters`), given
        here rather than set by a copy of the sample: one sample per GPU per tick.
        """
        used = self.mem_used(gpu)
        live = [c for c in self.clients if c.gpu is gpu and c.state.is_live]
        return GpuSample(
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
            sm_periods=sm_periods,
            compute_mode=compute_mode,
        )

    def forget_history(self) -> None:
        """Drop what no reading can use again, for a node that runs for days.

        A probe reading looks back over the probe window and, for the baseline, over the baseline
        window: a sample launched before both, and already taken in by the quiet samples, is
        never read again. A trainer's iteration times are kept for the same span, for whoever
        looks at its progress. The virtual-time runner never calls this (its results read the
        whole run), so its runs are unchanged.
        """
        pc = self.cfg.probe
        lo = self.loop.now - max(pc.window_s, pc.baseline_window_s)
        for probe in self.probes.values():
            probe.forget_before(lo)
        for job in self.offline:
            del job.iterations[: bisect.bisect_left(job.iterations, lo)]

    def probe_reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's reading now (:meth:`gpushare.sim.probe.ProbeClient.reading`)."""
        pc = self.cfg.probe
        return self.probes[gpu_uuid].reading(self.loop.now, pc.window_s, pc.baseline_window_s)


def stop_work(c: SimClient, state: ClientState = ClientState.EXITED) -> None:
    """End a client's GPU work (its kernels are discarded); a stopped client stays stopped."""
    if isinstance(c, OfflineTrainer) and c.state.is_live:
        c.stop(state)
    elif isinstance(c, OnlineServer) and c.state.is_live:
        c.stop()
