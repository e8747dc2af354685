"""The node Protocols of :mod:`gpushare.node.base`, implemented on a simulated node.

These adapters let code written against the real node (the daemon's run loop, tests) drive a
:class:`gpushare.sim.runner.SimNode`: NVML readings come from the GPU model, the probe from the
simulated probe kernel, freezing from the simulated cgroup freezer, and MPS operations act on the
simulated clients. Nothing here touches the host.
"""

from __future__ import annotations

from collections.abc import Sequence
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
)
from gpushare.node.base import GpuBackend, LatencyProbe, MpsNode, Pauser
from gpushare.sim.runner import SimNode
from gpushare.sim.workloads import OfflineTrainer, OnlineServer, SimClient


class SimGpuBackend:
    """:class:`gpushare.node.base.GpuBackend` on the simulated GPUs.

    Utilisation and SM activity are averaged since the previous :meth:`sample` call, as NVML's
    sampling counters are.
    """

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._last = {g.uuid: (node.loop.now, *g.totals()) for g in node.gpus}

    def sample(self) -> Sequence[GpuSample]:
        """One reading per simulated GPU."""
        out = []
        now = self.node.loop.now
        for gpu in self.node.gpus:
            busy, sm = gpu.totals()
            t0, busy0, sm0 = self._last[gpu.uuid]
            self._last[gpu.uuid] = (now, busy, sm)
            obs = self.node.observe(gpu, (busy - busy0, sm - sm0, now - t0))
            out.append(obs.sample)
        return out

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


class SimPauser:
    """:class:`gpushare.node.base.Pauser` on simulated clients (a cgroup freezer, simulated).

    Freezing an offline client stops it issuing kernels; the ones it already issued still run.
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
        if isinstance(client, OfflineTrainer) and client.active:
            client.held = True
            client.set_frozen(True, self.node.loop.now)

    def thaw(self, client_id: str) -> None:
        """Let the client issue kernels again."""
        client = self._attached.get(client_id)
        if isinstance(client, OfflineTrainer) and client.active:
            client.held = False
            client.set_frozen(False, self.node.loop.now)

    def kill(self, client_id: str) -> None:
        """End the client's process; its outstanding kernels are discarded."""
        client = self._attached.get(client_id)
        if isinstance(client, OfflineTrainer) and client.state.is_live:
            client.stop(ClientState.EXITED)
        elif isinstance(client, OnlineServer) and client.state.is_live:
            client.stop()

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's pid while it is live."""
        client = self._attached.get(client_id)
        return [client.pid] if client is not None and client.state.is_live else []

    def release(self, client_id: str) -> None:
        """Forget the client."""
        self._attached.pop(client_id, None)


class SimMpsNode:
    """:class:`gpushare.node.base.MpsNode` on the simulated GPUs: MPS is always up."""

    def __init__(self, node: SimNode, runtime_dir: Path) -> None:
        self.node = node
        self.runtime_dir = runtime_dir

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
        """Kill the outstanding GPU work of the client with this pid; True if one was found."""
        for c in self.node.clients:
            if c.gpu.uuid == gpu_uuid and c.pid == client_pid and c.state.is_live:
                if isinstance(c, OfflineTrainer):
                    c.stop(ClientState.EXITED)
                elif isinstance(c, OnlineServer):
                    c.stop()
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


def protocols(node: SimNode, runtime_dir: Path) -> tuple[GpuBackend, LatencyProbe, Pauser, MpsNode]:
    """The four node adapters of a simulated node, typed as the Protocols they implement."""
    return (
        SimGpuBackend(node),
        SimLatencyProbe(node),
        SimPauser(node),
        SimMpsNode(node, runtime_dir),
    )
