"""The simulated node in real time, with clients added and removed as they come and go.

This is the piece a daemon's simulated mode (docs/design.md D10: "the daemon's ``--simulate`` mode runs
the same simulated node in real time") needs: :class:`RealTimeSimNode` owns a
:class:`gpushare.sim.node.SimNode` whose virtual clock follows a wall clock, lets clients be
added by a named simulated profile (``--sim-profile resnet50-train``, ``--sim-profile
bert-inference --rps 40``) and removed, and hands out the four node Protocols of
:mod:`gpushare.node.base`; every Protocol call first advances the simulation to the wall clock.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.config import Config
from gpushare.daemon.inflight_control import SUBDIR
from gpushare.model import (
    ClientClass,
    ClientState,
    GpuEvent,
    GpuSample,
    MpsEvent,
    MpsState,
    PauseMechanism,
    ProbeReading,
)
from gpushare.node.base import MultiuserInfo
from gpushare.node.pauser_defaults import PauserDefaults
from gpushare.sim import adapters as simnode
from gpushare.sim import data
from gpushare.sim.arrivals import bursty_poisson_arrivals
from gpushare.sim.control_follow import ControlFollower
from gpushare.sim.gating import BoundarySender
from gpushare.sim.node import SimNode, launch_costs
from gpushare.sim.scenario import GpuSpec, Scenario
from gpushare.sim.simenv import ENV_BURST, ENV_PROFILE, ENV_RPS, rate_problem
from gpushare.sim.workloads import OfflineTrainer, OnlineServer

log = structlog.get_logger("gpushare.sim")

ORION = "orion-v100-kernels"
#: One :meth:`RealTimeSimNode.advance` simulates in steps of this much virtual time, and stops
#: (behind the wall clock, to catch up at the next call) once it has run this long, so no
#: workload can hold the node's lock, and so the daemon's tick and API, for long. A node that
#: keeps up with the wall clock never reaches it.
ADVANCE_STEP_S = 0.005
ADVANCE_BUDGET_S = 1.0
# The daemon's tick advances the node a dozen times (each reading, each freeze): the control
# files are read at most once per advance step (the library reads its file at each launch, every
# few ms), and history is trimmed once a second (each trim walks every simulated job: 8 x 200 idle).
FOLLOW_PERIOD_S = ADVANCE_STEP_S
FORGET_PERIOD_S = 1.0

#: Simulated workload profiles by the name ``--sim-profile`` takes: class and kernel profile.
SIM_PROFILES: dict[str, tuple[ClientClass, str]] = {
    "bert-inference": (ClientClass.ONLINE, f"{ORION}/bert_2_fwd.csv"),
    "mobilenetv2-inference": (ClientClass.ONLINE, f"{ORION}/mobilenetv2_4_fwd.csv"),
    "resnet50-inference": (ClientClass.ONLINE, f"{ORION}/resnet50_4_fwd.csv"),
    "resnet101-inference": (ClientClass.ONLINE, f"{ORION}/resnet101_4_fwd.csv"),
    "transformer-xl-inference": (ClientClass.ONLINE, f"{ORION}/transformer_xl_4_fwd.csv"),
    "bert-train": (ClientClass.OFFLINE, f"{ORION}/bert_8_fb1.csv"),
    "mobilenetv2-train": (ClientClass.OFFLINE, f"{ORION}/mobilenetv2_32_fb1.csv"),
    "resnet50-train": (ClientClass.OFFLINE, f"{ORION}/resnet50_32_fb1.csv"),
    "resnet101-train": (ClientClass.OFFLINE, f"{ORION}/resnet101_32_fb1.csv"),
    "transformer-xl-train": (ClientClass.OFFLINE, f"{ORION}/transformer_xl_8_fb1.csv"),
}


class SimProfileError(ValueError):
    """A simulated profile name or its parameters are bad; the message names the fix."""


@dataclass(frozen=True, slots=True)
class SimWorkload:
    """What a client submitted in simulated mode runs on the simulated GPU."""

    profile: str
    rps: float | None = None
    #: ``(at_s, for_s, factor)``: from ``at_s`` after the client starts, for ``for_s``, the
    #: request rate is ``factor`` times ``rps`` (an online burst).
    burst: tuple[float, float, float] | None = None

    def validate(self, cls: ClientClass) -> None:
        """Check the profile exists and is readable, fits the client's class, has a rate when online.

        Raises:
            SimProfileError: the message lists the valid profiles or says what is missing.
        """
        entry = SIM_PROFILES.get(self.profile)
        if entry is None:
            valid = ", ".join(sorted(SIM_PROFILES))
            raise SimProfileError(f"unknown --sim-profile {self.profile!r}; valid: {valid}")
        if entry[0] is not cls:
            raise SimProfileError(
                f"--sim-profile {self.profile} is an {entry[0].value} workload, "
                f"the client is {cls.value}"
            )
        if cls is ClientClass.ONLINE and (self.rps is None or not self.rps > 0):
            raise SimProfileError(f"--sim-profile {self.profile} needs --rps > 0")
        if (problem := rate_problem(self.rps, self.burst)) is not None:
            raise SimProfileError(problem)
        try:
            data.load_profile(entry[1])
        except data.DataError as exc:
            raise SimProfileError(
                f"--sim-profile {self.profile}: {exc} (reinstall gpushare, or set "
                f"{data.DATA_ENV} to a folder that has {entry[1]})"
            ) from exc


def workload_from_env(env: Mapping[str, str]) -> SimWorkload | None:
    """The simulated workload a client's environment names, None when it names none.

    Raises:
        SimProfileError: a malformed rate or burst.
    """
    profile = env.get(ENV_PROFILE)
    if not profile:
        return None
    try:
        rps = float(env[ENV_RPS]) if ENV_RPS in env else None
        burst = None
        if env.get(ENV_BURST):
            at, length, factor = (float(x) for x in env[ENV_BURST].split(":"))
            burst = (at, length, factor)
    except ValueError:
        raise SimProfileError(
            f"bad {ENV_RPS}={env.get(ENV_RPS)!r} or {ENV_BURST}={env.get(ENV_BURST)!r}: "
            "a rate is a number, a burst AT_S:FOR_S:FACTOR"
        ) from None
    return SimWorkload(profile, rps, burst)


class RealTimeSimNode:
    """A simulated node whose virtual time follows ``clock`` (seconds, monotonic)."""

    def __init__(
        self,
        gpu_count: int,
        config: Config,
        *,
        runtime_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 1,
    ) -> None:
        if gpu_count < 1:
            raise ValueError(f"need at least one simulated GPU, got {gpu_count}")
        scenario = Scenario(
            name="simulate",
            file="<simulate>",
            description="the daemon's simulated node",
            duration_s=math.inf,
            warmup_s=0.0,
            seed=seed,
            gpu=GpuSpec(count=gpu_count),
            online=(),
            offline=(),
            config=config,
        )
        self.node = SimNode(scenario)
        self.node.start()
        self._clock = clock
        self._t0 = clock()
        self._seed = seed
        self._adapters = simnode.protocols(self.node, runtime_dir)
        #: The daemon calls in from its tick thread and its API threads.
        self.lock = threading.RLock()
        #: ``(client_id, latency_s, at_s)`` for every completed request of a simulated online
        #: client, ``at_s`` on ``clock``: what the service would report with
        #: ``gpushare.client.report_latency`` (the daemon's simulated mode records it directly).
        self.on_latency: Callable[[str, float, float], None] | None = None
        #: How far the simulation was behind the wall clock when the last advance stopped.
        self.behind_s = 0.0
        self._followed_at = -math.inf  # virtual time of the last control-file read
        self._forgot_at = -math.inf  # and of the last history trim
        #: Request boundaries of the simulated online clients on their way to the daemon
        #: (:meth:`start_boundaries`): ``(client_id, pid, requests in flight, at_s on clock)``.
        self._boundaries: queue.SimpleQueue[tuple[str, int, int, float] | None] | None = None
        self._boundary_thread: threading.Thread | None = None
        #: Issue 32: twins of live ``--queue auto`` clients read the daemon's control files.
        self.controls = ControlFollower(runtime_dir / SUBDIR)

    def start_boundaries(self, deliver: Callable[[str, int, int, float], None]) -> None:
        """Send the simulated online clients' request boundaries to ``deliver``, from a thread.

        What ``gpushare.client.request_started``/``request_ended`` do for a real service: the
        daemon's request gate hears of them on its own thread (its latency receiver's), so a
        freeze it asks for never runs inside the simulation's event loop (``deliver`` may take
        the gate's lock and then this node's, the order every other caller takes them in).
        """
        self._boundaries = queue.SimpleQueue()
        self._boundary_thread = threading.Thread(
            target=self._deliver_boundaries, args=(deliver,), name="sim-boundaries", daemon=True
        )
        self._boundary_thread.start()

    def stop_boundaries(self) -> None:
        """Stop the delivery thread (queued boundaries are delivered first)."""
        if self._boundaries is not None and self._boundary_thread is not None:
            self._boundaries.put(None)
            self._boundary_thread.join(timeout=2.0)
        self._boundaries = None
        self._boundary_thread = None

    def _deliver_boundaries(self, deliver: Callable[[str, int, int, float], None]) -> None:
        boundaries = self._boundaries
        assert boundaries is not None
        while (item := boundaries.get()) is not None:
            deliver(*item)

    def _send_boundary(self, client_id: str, pid: int, count: int) -> None:
        if self._boundaries is not None:
            self._boundaries.put((client_id, pid, count, self._t0 + self.node.loop.now))

    @property
    def gpu_uuids(self) -> list[str]:
        """The simulated GPUs' UUIDs, by index."""
        return [g.uuid for g in self.node.gpus]

    def advance(self) -> None:
        """Run the simulation up to the wall clock, or for :data:`ADVANCE_BUDGET_S` at most."""
        with self.lock:
            loop = self.node.loop
            target = max(loop.now, self._clock() - self._t0)
            if self.controls.following and target - self._followed_at >= FOLLOW_PERIOD_S:
                self._followed_at = target
                self._follow_controls()
            began = time.perf_counter()
            while loop.now < target:
                loop.run_until(min(target, loop.now + ADVANCE_STEP_S))
                if time.perf_counter() - began > ADVANCE_BUDGET_S:
                    self.behind_s = target - loop.now
                    break
            else:
                self.behind_s = 0.0
            for server in self.node.online:
                if self.on_latency is not None:
                    for arrival, latency in server.completed:
                        self.on_latency(server.cid, latency, self._t0 + arrival + latency)
                # Once reported, a request is the daemon's to keep (in its own windows): a node
                # that runs for days keeps none (the virtual-time runner reads them at the end).
                server.completed.clear()
                server.served.clear()
            if loop.now - self._forgot_at >= FORGET_PERIOD_S:
                self._forgot_at = loop.now
                self.node.forget_history()

    def _follow_controls(self) -> None:
        """Give each following twin the bound its control file holds now (issue 32)."""
        for client_id, bound in self.controls.changed():
            c = self.node.client(client_id)
            if isinstance(c, OfflineTrainer) and c.state.is_live:
                c.set_inflight(bound)
                log.info("sim_inflight_bound", client_id=client_id, bound=bound, pid=c.pid)

    def add_client(
        self,
        client_id: str,
        cls: ClientClass,
        workload: SimWorkload,
        *,
        gpu_uuid: str,
        sm_pct: float,
        mem_bytes: int,
        pid: int,
        slo_p99_ms: float | None = None,
        restartable: bool = False,
        launch_blocking: bool = False,
        inflight_bound: int = 0,
    ) -> bool:
        """Start a client on a simulated GPU; False when its memory allocation failed.

        ``launch_blocking``: an offline client launched with a shallow queue
        (``CUDA_LAUNCH_BLOCKING=1``): one kernel in flight, a launch gap per kernel.
        ``inflight_bound``: one launched with ``GPUSHARE_MAX_INFLIGHT=k`` (the interposer): at
        most k kernels in flight (:meth:`OfflineTrainer.set_inflight`); 0: no bound.

        Raises:
            SimProfileError: a bad profile for the class, or no rate for an online client.
            KeyError: no simulated GPU with that UUID.
        """
        workload.validate(cls)
        with self.lock:
            self.advance()
            if self.node.client(client_id) is not None:
                return True  # re-attached (e.g. the daemon re-adopted it): already simulated
            added = self._add(
                client_id, cls, workload, gpu_uuid, sm_pct, mem_bytes, pid, slo_p99_ms, restartable
            )
            c = self.node.client(client_id)
            if added and isinstance(c, OfflineTrainer):
                c.launch_blocking = launch_blocking
                c.set_inflight(inflight_bound)
            return added

    def _add(
        self,
        client_id: str,
        cls: ClientClass,
        workload: SimWorkload,
        gpu_uuid: str,
        sm_pct: float,
        mem_bytes: int,
        pid: int,
        slo_p99_ms: float | None,
        restartable: bool,
    ) -> bool:
        node = self.node
        gpu = node.by_uuid[gpu_uuid]
        rel = SIM_PROFILES[workload.profile][1]
        g = node.scenario.gpu
        if cls is ClientClass.ONLINE:
            prof = data.load_profile(rel, g.merge_online_us, g.sm_count)
            self._seed += 1
            assert workload.rps is not None
            arrivals = bursty_poisson_arrivals(
                workload.rps, workload.burst, self._seed, node.loop.now, math.inf
            )
            server = OnlineServer(
                client_id,
                gpu,
                prof,
                arrivals,
                sm_pct=sm_pct,
                mem_bytes=mem_bytes,
                slo_p99_ms=slo_p99_ms,
                pid=pid,
            )
            server.set_host_cost(g.host_per_kernel_s)
            server.on_boundary = BoundarySender(self._send_boundary, server).boundary
            node.online.append(server)
            if not node.allocate(server):
                return False
            node.processes[pid] = server
            gpu.attach(server)
            server.start(node.loop)
            return True
        trainer = OfflineTrainer(
            client_id,
            gpu,
            data.load_profile(rel, g.merge_offline_us, g.sm_count),
            sm_pct=sm_pct,
            mem_bytes=mem_bytes,
            restartable=restartable,
            pid=pid,
        )
        trainer.priority = node.traits.offline_priority
        launch_costs(trainer, g)
        node.offline.append(trainer)
        if not node.allocate(trainer):
            return False
        node.processes[pid] = trainer
        trainer.start(node.loop.now)
        return True

    def remove_client(self, client_id: str) -> None:
        """The client's process is gone: its outstanding work is discarded."""
        with self.lock:
            self.controls.forget(client_id)
            self.advance()
            c = self.node.client(client_id)
            if isinstance(c, OfflineTrainer) and c.state.is_live:
                c.stop(ClientState.EXITED)
            elif isinstance(c, OnlineServer) and c.state.is_live:
                c.stop()
            if c is not None:
                self.node.processes.pop(c.pid, None)
                # Forget it: a relaunch under the same id is a new simulated client.
                if isinstance(c, OfflineTrainer):
                    self.node.offline.remove(c)
                elif isinstance(c, OnlineServer):
                    self.node.online.remove(c)

    # --- the node Protocols, advanced to the wall clock on every call ----------------------------

    def gpu_backend(self) -> RealTimeGpuBackend:
        """:class:`gpushare.node.base.GpuBackend` of the simulated GPUs."""
        return RealTimeGpuBackend(self)

    def latency_probe(self) -> RealTimeLatencyProbe:
        """:class:`gpushare.node.base.LatencyProbe` of the simulated probe."""
        return RealTimeLatencyProbe(self)

    def pauser(self) -> RealTimePauser:
        """:class:`gpushare.node.base.Pauser` acting on the simulated clients."""
        return RealTimePauser(self)

    def mps_node(self) -> RealTimeMpsNode:
        """:class:`gpushare.node.base.MpsNode` of the simulated GPUs."""
        return RealTimeMpsNode(self)


class RealTimeGpuBackend:
    """NVML-like readings of the simulated GPUs at the wall clock."""

    #: The GPUs are simulated (``daemon.simulated`` in ``gpushare status --json``).
    simulated = True

    def __init__(self, rt: RealTimeSimNode) -> None:
        self.rt = rt

    def sample(self) -> Sequence[GpuSample]:
        """One reading per simulated GPU."""
        with self.rt.lock:
            self.rt.advance()
            return self.rt._adapters[0].sample()

    def drain_events(self) -> Sequence[GpuEvent]:
        """No XIDs on simulated GPUs."""
        return ()

    def close(self) -> None:
        """Nothing to release."""


class RealTimeLatencyProbe:
    """The simulated probe at the wall clock."""

    def __init__(self, rt: RealTimeSimNode) -> None:
        self.rt = rt

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's reading now."""
        with self.rt.lock:
            self.rt.advance()
            return self.rt._adapters[1].reading(gpu_uuid)

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        """Mark later probe samples as taken with or without offline work."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[1].set_offline_running(gpu_uuid, running)

    def close(self) -> None:
        """Nothing to stop."""


class RealTimePauser(PauserDefaults):
    """Freezes and thaws simulated clients at the wall clock (no process is touched).

    The core :class:`~gpushare.node.base.Pauser`; the other capabilities are the null ones.
    """

    mechanism = PauseMechanism.CGROUP

    def __init__(self, rt: RealTimeSimNode) -> None:
        self.rt = rt

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Track a simulated client."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[2].attach(client_id, pid)

    def freeze(self, client_id: str) -> None:
        """Stop the client issuing kernels."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[2].freeze(client_id)

    def thaw(self, client_id: str) -> None:
        """Let the client issue kernels again."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[2].thaw(client_id)

    def kill(self, client_id: str) -> None:
        """End the simulated client."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[2].kill(client_id)

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's pid while it is live."""
        with self.rt.lock:
            return self.rt._adapters[2].pids(client_id)

    def release(self, client_id: str) -> None:
        """Forget the client."""
        with self.rt.lock:
            self.rt._adapters[2].release(client_id)


class RealTimeMpsNode:
    """The simulated MPS at the wall clock."""

    #: What answers MPS commands (``gpus[].mps_backend`` in ``gpushare status --json``).
    backend = "simulated"

    def __init__(self, rt: RealTimeSimNode) -> None:
        self.rt = rt

    @property
    def supervisors(self) -> Mapping[str, MultiuserInfo]:
        """No real control daemon: none (single-user MPS is assumed)."""
        return {}

    def start(self) -> None:
        """The simulated MPS is always up."""

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Nothing to stop."""

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """A per-GPU pipe directory name."""
        return self.rt._adapters[3].pipe_dir(gpu_uuid)

    def state(self, gpu_uuid: str) -> MpsState:
        """UP for a simulated GPU."""
        return self.rt._adapters[3].state(gpu_uuid)

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """No MPS events."""
        return ()

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """Kill the client's outstanding simulated work."""
        with self.rt.lock:
            self.rt.advance()
            return self.rt._adapters[3].terminate_client(gpu_uuid, client_pid)

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Offline clients first, then online ones."""
        with self.rt.lock:
            self.rt.advance()
            self.rt._adapters[3].recover(gpu_uuid, offline_pids, online_pids)
