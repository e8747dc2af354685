"""Wiring of the real-time simulated node into the real daemon (``gpushare daemon --simulate N``).

The daemon runs unchanged: its socket, CLI, registry, controller, launcher and pauser are real, and
every submitted workload is a real process (any command: ``sleep 600`` does). What it would do on a
GPU is simulated: a client whose environment names a simulated profile (``gpushare submit
--sim-profile resnet50-train``, or ``GPUSHARE_SIM_PROFILE``) gets a simulated twin on the
simulated GPU when the daemon attaches its process, is frozen and thawed with it, and goes away
with it. NVML readings and the probe come from the simulated node; MPS is NVIDIA's real control
daemon where it is installed (:mod:`gpushare.sim.hybrid_mps`), else simulated too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpushare.model import ClientClass, PauseMechanism
from gpushare.node.base import NodePauser
from gpushare.node.cgroups.route import FreezeRoute
from gpushare.node.pauser_base import PauserError
from gpushare.node.pauser_defaults import PauserDefaults
from gpushare.sim.inflight import launch_queue
from gpushare.sim.realtime import RealTimeSimNode, SimProfileError, workload_from_env
from gpushare.sim.simenv import ENV_PROFILE

log = structlog.get_logger("gpushare.sim")

#: Memory a simulated client allocates when it declared none.
DEFAULT_MEM_BYTES = {ClientClass.ONLINE: 2 << 30, ClientClass.OFFLINE: 4 << 30}


@dataclass(frozen=True, slots=True)
class SimClientInfo:
    """What the registry knows of a client that its simulated twin needs."""

    cls: ClientClass
    gpu_uuid: str
    sm_pct: float
    mem_bytes: int | None
    slo_p99_ms: float | None
    restartable: bool
    env: Mapping[str, str]


def _process_env(pid: int) -> dict[str, str]:
    """A process's initial environment (empty when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


class SimulatedPauser(PauserDefaults):
    """A real pauser that also freezes, thaws and ends each client's simulated twin (a ``NodePauser``).

    Adoption, batches, members and owners are forwarded to the real pauser. Requests without a
    wait, ``is_frozen``, ``clients`` and the pre-exec cgroup handle are the null ones
    (:class:`~gpushare.node.pauser_defaults.PauserDefaults`): a request is this pauser's own
    waiting :meth:`freeze`/:meth:`thaw`, so the twin is frozen with the process, and a client
    joins its cgroup when attached, which also starts its twin.
    """

    def __init__(
        self,
        real: NodePauser,
        rt: RealTimeSimNode,
        lookup: Callable[[str], SimClientInfo | None],
    ) -> None:
        self.real = real
        self.rt = rt
        self.lookup = lookup
        self.mechanism = real.mechanism
        self._sim = rt.pauser()

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Attach the process, and start its simulated twin if it names a profile."""
        self.real.attach(client_id, pid, owner_uid=owner_uid)
        self._twin(client_id, pid)

    def adopt(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> FreezeRoute:
        """Adopt a process where it is (the real pauser's ``adopt``), and start its twin too.

        Raises:
            PauserError: the real pauser cannot adopt it (gone, another uid's, the daemon).
        """
        route = self.real.adopt(client_id, pid, owner_uid=owner_uid)
        self._twin(client_id, pid)
        return route

    def route(self, client_id: str) -> FreezeRoute | None:
        """How an adopted client is paused (``None`` for a launched one)."""
        return self.real.route(client_id)

    def mechanism_of(self, client_id: str) -> PauseMechanism:
        """The mechanism that pauses this client (the real pauser's answer)."""
        return self.real.mechanism_of(client_id)

    def _twin(self, client_id: str, pid: int) -> None:
        info = self.lookup(client_id)
        if info is None:
            return
        env = info.env
        launched = _process_env(pid)
        if ENV_PROFILE not in env:
            env = launched  # a foreground submit: the profile is in its environment
        blocking, bound = launch_queue(launched)
        # Issue 32: a live --queue auto client follows its GPU's control file, as the library does.
        with self.rt.lock:  # the node's advance reads the followers
            live = self.rt.controls.follow(client_id, info.gpu_uuid, launched) if bound else None
        bound = bound if live is None else live
        try:
            workload = workload_from_env(env)
            if workload is None:
                log.info("sim_client_without_profile", client_id=client_id)
                return
            ok = self.rt.add_client(
                client_id,
                info.cls,
                workload,
                gpu_uuid=info.gpu_uuid,
                sm_pct=info.sm_pct,
                mem_bytes=info.mem_bytes or DEFAULT_MEM_BYTES[info.cls],
                pid=pid,
                slo_p99_ms=info.slo_p99_ms,
                restartable=info.restartable,
                # The daemon's --queue shallow launches it with CUDA_LAUNCH_BLOCKING=1 or, bounded,
                # with GPUSHARE_MAX_INFLIGHT=k (launcher.queue_env).
                launch_blocking=blocking,
                inflight_bound=bound,
            )
        except (SimProfileError, KeyError) as exc:
            # Raised, not logged: the daemon then stops the process and fails the client, so a
            # submit with a bad profile is an error its caller sees, not a twin-less client.
            raise PauserError(f"its simulated workload cannot run: {exc}") from exc
        if not ok:
            raise PauserError(
                f"the simulated GPU {info.gpu_uuid} cannot hold its limits "
                f"(SM {info.sm_pct:g} %, memory {info.mem_bytes or DEFAULT_MEM_BYTES[info.cls]} B)"
            )
        self._sim.attach(client_id, pid)

    def freeze(self, client_id: str) -> None:
        """Freeze the process and stop its twin issuing kernels."""
        self.real.freeze(client_id)
        self._sim.freeze(client_id)

    def thaw(self, client_id: str) -> None:
        """Thaw both."""
        self.real.thaw(client_id)
        self._sim.thaw(client_id)

    def freeze_many(self, client_ids: Sequence[str]) -> None:
        """Freeze several at once (the real pauser's batched form)."""
        try:
            self.real.freeze_many(client_ids)
        finally:
            for client_id in client_ids:
                self._sim.freeze(client_id)

    def thaw_many(self, client_ids: Sequence[str]) -> None:
        """Thaw several at once."""
        try:
            self.real.thaw_many(client_ids)
        finally:
            for client_id in client_ids:
                self._sim.thaw(client_id)

    def kill(self, client_id: str) -> None:
        """Kill the process; its twin's work is discarded."""
        self.real.kill(client_id)
        self.rt.remove_client(client_id)

    def pids(self, client_id: str) -> Sequence[int]:
        """The real process's pids."""
        return self.real.pids(client_id)

    def members(self, client_id: str) -> Sequence[int]:
        """The real process's pids read now (``pids`` may lag a fork; node/cgroups/pid_tracker.py)."""
        return list(self.real.members(client_id))

    def owner_of(self, pid: int) -> str | None:
        """The client whose cgroup holds ``pid``, where the real pauser can tell."""
        return self.real.owner_of(pid)

    def release(self, client_id: str) -> None:
        """Forget the client and its twin."""
        self.real.release(client_id)
        self._sim.release(client_id)
        self.rt.remove_client(client_id)


if TYPE_CHECKING:  # the wrapper implements the Protocol the daemon holds it by

    def _conforms(p: SimulatedPauser) -> NodePauser:
        return p
