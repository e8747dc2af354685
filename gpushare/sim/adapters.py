"""The node Protocols of :mod:`gpushare.node.base`, implemented on a simulated node.

These let code written against the real node (the daemon's control loop and client lifecycle,
tests) drive a :class:`gpushare.sim.node.SimNode`: NVML readings come from the GPU model, the probe
from the simulated probe kernel, freezing from the simulated cgroup freezer, MPS operations and
processes act on the simulated clients, and :class:`VirtualClock` makes the loop's waits advance
the simulation instead of sleeping. Nothing here touches the host.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpushare.model import (
    ClientClass,
    ClientState,
    GpuEvent,
    GpuSample,
    MpsEvent,
    MpsState,
    PauseMechanism,
    ProbeReading,
    SmPeriod,
)
from gpushare.node.base import (
    DaemonGpuBackend,
    DaemonMpsNode,
    LatencyProbe,
    MultiuserInfo,
    NodePauser,
)
from gpushare.node.pauser_defaults import PauserDefaults
from gpushare.sim.gpu import EventLoop
from gpushare.sim.inflight import launch_queue
from gpushare.sim.node import SimNode, stop_work
from gpushare.sim.tally import TallyTrainer
from gpushare.sim.workloads import OfflineTrainer, SimClient


class VirtualClock:
    """:class:`gpushare.node.base.Clock` on the simulation's event loop: waiting runs the model."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop

    def monotonic(self) -> float:
        """Virtual seconds since the start of the run."""
        return self.loop.now

    def time(self) -> float:
        """The same virtual seconds (the run starts at the epoch)."""
        return self.loop.now

    def sleep_until(self, deadline: float, stop: threading.Event) -> bool:
        """Simulate every event up to ``deadline``; True when a stop was requested."""
        if deadline > self.loop.now:
            self.loop.run_until(deadline)
        return stop.is_set()


class SimGpuBackend:
    """:class:`gpushare.node.base.GpuBackend` on the simulated GPUs.

    Utilisation and SM activity are averaged since the previous :meth:`sample` call, as NVML's
    sampling counters are. The per-process SM reading (``sm_periods``) is one sampling period per
    call, from the previous call to now, listing the client processes that ran a kernel in it (one
    completed, or one on the GPU now), as NVML lists the processes with non-zero SM utilisation;
    a kernel issued but not yet given SMs is not listed, as it is not on a GPU. The compute mode
    is the simulated GPU's: ``"default"`` when the driver time-slices it, else the
    ``"exclusive_process"`` the MPS supervisor sets.
    """

    #: The daemon's status says ``simulated`` only for the real-time node (sim/realtime.py); the
    #: batch simulator runs no status.
    simulated = False

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._last = {g.uuid: (node.loop.now, *g.totals()) for g in node.gpus}
        self._done: dict[int, int] = {}

    def sample(self) -> Sequence[GpuSample]:
        """One reading per simulated GPU."""
        out = []
        now = self.node.loop.now
        for gpu in self.node.gpus:
            busy, sm = gpu.totals()
            t0, busy0, sm0 = self._last[gpu.uuid]
            self._last[gpu.uuid] = (now, busy, sm)
            periods = (SmPeriod(now, self._ran(gpu.uuid)),) if now > t0 else ()
            mode = "default" if gpu.mode == "time_slice" else "exclusive_process"
            out.append(
                self.node.sample(
                    gpu, busy - busy0, sm - sm0, now - t0, sm_periods=periods, compute_mode=mode
                )
            )
        return out

    def _ran(self, gpu_uuid: str) -> tuple[int, ...]:
        """The pids of the GPU's processes that ran a kernel since the last call."""
        ran = []
        for pid, c in self.node.processes.items():
            if c.gpu.uuid != gpu_uuid:
                continue
            done = c.counts.done
            # A pid seen for the first time: the counter may hold an earlier process of the same
            # client (a relaunch), so only a kernel on the GPU now counts.
            if done != self._done.get(pid, done) or c.run is not None:
                ran.append(pid)
            self._done[pid] = done
        return tuple(sorted(ran))

    def drain_events(self) -> Sequence[GpuEvent]:
        """The simulated GPUs raise no XID events."""
        return ()

    def close(self) -> None:
        """Nothing to release."""


class SimLatencyProbe:
    """:class:`gpushare.node.base.LatencyProbe` backed by the simulated probe kernel."""

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's window p99 and baseline on one simulated GPU."""
        if gpu_uuid not in self.node.probes:
            return ProbeReading(reason=f"unavailable: no simulated GPU {gpu_uuid}")
        return self.node.probe_reading(gpu_uuid)

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        """Mark later probe samples as taken with or without offline work."""
        probe = self.node.probes.get(gpu_uuid)
        if probe is not None:
            probe.offline_running = running

    def close(self) -> None:
        """Nothing to stop."""


class SimPauser(PauserDefaults):
    """:class:`gpushare.node.base.NodePauser` on simulated clients (a cgroup freezer, simulated).

    Only the core :class:`~gpushare.node.base.Pauser` is simulated; every other capability is
    the null one (:class:`~gpushare.node.pauser_defaults.PauserDefaults`): one client at a time,
    waiting, no adoption where a process is.

    Freezing an offline client stops it issuing kernels; the ones it already issued still run. A
    process frozen before its workload started stays frozen when it starts (it is in its cgroup).
    Online clients are never frozen by the simulated node (the controller never asks for it).
    """

    mechanism = PauseMechanism.CGROUP

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._attached: dict[str, SimClient] = {}

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Track a simulated client under its id (``pid`` is recorded on it; no owner check)."""
        client = self.node.client(client_id)
        if client is None:
            raise KeyError(f"no simulated client {client_id!r}")
        client.pid = pid
        self._attached[client_id] = client

    def freeze(self, client_id: str) -> None:
        """Stop the client issuing kernels."""
        client = self._attached.get(client_id)
        if isinstance(client, OfflineTrainer):
            client.set_frozen(True, self.node.loop.now)

    def thaw(self, client_id: str) -> None:
        """Let the client issue kernels again."""
        client = self._attached.get(client_id)
        if isinstance(client, OfflineTrainer):
            client.set_frozen(False, self.node.loop.now)

    def kill(self, client_id: str) -> None:
        """End the client's process; its outstanding kernels are discarded."""
        client = self._attached.get(client_id)
        if client is not None:
            if client.pid in self.node.processes:
                self.node.end_process(client.pid, -signal.SIGKILL, ClientState.EXITED)
            else:
                stop_work(client)

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's pid while its process lives."""
        client = self._attached.get(client_id)
        return [client.pid] if client is not None and client.pid in self.node.processes else []

    def release(self, client_id: str) -> None:
        """Forget the client."""
        self._attached.pop(client_id, None)


class SimMpsNode:
    """:class:`gpushare.node.base.MpsNode` on the simulated GPUs: MPS is always up."""

    backend = "simulated"

    def __init__(self, node: SimNode, runtime_dir: Path) -> None:
        self.node = node
        self.runtime_dir = runtime_dir

    @property
    def supervisors(self) -> Mapping[str, MultiuserInfo]:
        """No real control daemon: none (single-user MPS is assumed)."""
        return {}

    def start(self) -> None:
        """MPS is always up."""

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Nothing to stop."""

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """A per-GPU pipe directory name (nothing listens there: the GPU is simulated)."""
        return self.runtime_dir / "mps" / gpu_uuid

    def state(self, gpu_uuid: str) -> MpsState:
        """UP for a simulated GPU, UNKNOWN for anything else."""
        return MpsState.UP if gpu_uuid in self.node.by_uuid else MpsState.UNKNOWN

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """The simulated MPS reports no events."""
        return ()

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """Kill the outstanding GPU work of the client with this pid; True if one was found.

        The process itself lives on (it is killed separately), as with MPS.
        """
        for c in self.node.clients:
            if c.gpu.uuid == gpu_uuid and c.pid == client_pid and c.state.is_live:
                stop_work(c)
                return True
        return False

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Terminate the offline clients first, then the online ones, as the real recovery does."""
        ordered = sorted(
            (c for c in self.node.clients if c.gpu.uuid == gpu_uuid),
            key=lambda c: 0 if c.cls is ClientClass.OFFLINE else 1,
        )
        wanted = set(offline_pids) | set(online_pids)
        for c in ordered:
            if c.pid in wanted:
                self.terminate_client(gpu_uuid, c.pid)


class SimProcesses:
    """:class:`gpushare.node.base.ProcessHost` on the simulated node.

    A spawned client's workload is the scenario's simulated client of the same id. It reads its
    MPS limits from the environment it is launched with, as a CUDA client does; it allocates its
    memory at once (a failed allocation is the process exiting with status 1) and starts issuing
    work after the scenario's start-up time (``[gpu] start``, or ``[gpu] restart`` when it ran
    before). A signal other than SIGKILL, which the workload is taken to handle by checkpointing
    and exiting, ends it as well.
    """

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._starting: dict[int, OfflineTrainer] = {}

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Report exits of simulated processes to ``on_exit``."""
        self.node.on_process_exit = on_exit

    def stop(self) -> None:
        """Stop reporting exits."""
        self.node.on_process_exit = None

    def spawn(
        self,
        argv: Sequence[str],
        *,
        uid: int,
        gid: int,
        cwd: str,
        env: Mapping[str, str],
        log_dir: Path,
        client_id: str,
        cgroup_procs_fd: int | None = None,
    ) -> tuple[int, float | None, Path]:
        """Start the simulated workload of ``client_id``; raises OSError when there is none."""
        node = self.node
        c = node.client(client_id)
        if not isinstance(c, OfflineTrainer):
            raise FileNotFoundError(2, f"no simulated offline workload named {client_id!r}")
        pid = node.next_pid()
        c.pid = pid
        c.set_limits(float(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]))
        c.priority = int(env["CUDA_MPS_CLIENT_PRIORITY"])
        if not isinstance(c, TallyTrainer):  # the tally-like trainer has its own one-kernel gate
            # The queue the daemon launched it with (``--queue``, launcher.queue_env): blocking
            # (CUDA_LAUNCH_BLOCKING=1) or bounded (GPUSHARE_MAX_INFLIGHT=k, the interposer).
            blocking, bound = launch_queue(env)
            if node.inflight_switch is not None:  # issue 32: the control file overrides
                bound = node.inflight_switch.bound_at_spawn(client_id, env, bound)
            c.launch_blocking = blocking or client_id in node.always_blocking
            c.set_inflight(bound)
        ran_before = c.started_at_s is not None
        node.processes[pid] = c
        if not node.allocate(c):
            node.end_process(pid, 1, ClientState.FAILED)
        else:
            g = node.scenario.gpu
            delay = g.restart_s if ran_before else g.start_s
            self._starting[pid] = c
            node.loop.at(node.loop.now + delay, self._started, pid)
        return pid, None, log_dir / f"{client_id}.log"

    def _started(self, arg: object) -> None:
        pid = arg
        assert isinstance(pid, int)
        c = self._starting.pop(pid, None)
        if c is not None and self.node.processes.get(pid) is c:
            c.start(self.node.loop.now)  # keeps a freeze that came before the start
            self.node.checkpoints.started(c, self.node.loop.now)  # issue 32

    def watch(self, proc: object, start_time: float | None = None) -> None:
        """Exits are reported for every simulated process; a gone one was reported already."""

    def reap(self, proc: object, timeout_s: float) -> bool:
        """A simulated process is gone as soon as it is killed."""
        return True

    def health(self) -> tuple[bool, int, str | None]:
        """Exits are events of the simulation: no thread to fail."""
        return True, 0, None

    def signal(self, pid: int, sig: int, pids: Sequence[int]) -> None:
        """The workload exits on any signal (by it: status ``-sig``)."""
        if pid in self.node.processes:
            self._starting.pop(pid, None)
            c = self.node.processes[pid]
            if isinstance(c, OfflineTrainer):  # issue 32: what it did not save is lost
                self.node.checkpoints.signalled(c, self.node.loop.now)
            self.node.end_process(pid, -sig, ClientState.EXITED)

    def alive(self, pid: int, start_time: float) -> bool:
        """A simulation never re-adopts: no process outlives its run."""
        return False


def protocols(
    node: SimNode, runtime_dir: Path
) -> tuple[DaemonGpuBackend, LatencyProbe, NodePauser, DaemonMpsNode]:
    """The four sensing and actuating adapters of a simulated node, typed as their Protocols."""
    return (
        SimGpuBackend(node),
        SimLatencyProbe(node),
        SimPauser(node),
        SimMpsNode(node, runtime_dir),
    )
