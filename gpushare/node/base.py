"""The Protocols every node adapter implements.

The real adapters live in this package, the simulated node in :mod:`gpushare.sim`, and the fakes
in ``tests/fakes/`` (one per Protocol).

The daemon's run loop talks to the node only through these, which is what lets the same loop and
controller run on a real host, on the simulator (in virtual time: :class:`Clock`) and in tests.

A capability beyond a Protocol's core is a Protocol of its own (:class:`BatchPauser`,
:class:`TrackingPauser`, :class:`SpawnPauser`, :class:`AdoptPauser`; :class:`ManagedMpsNode`,
:class:`DescribedMpsNode`; :class:`SimulatedFlag`; :class:`SlotHoldingProbe`), and the daemon
holds the union it calls (:class:`NodePauser`, :class:`DaemonMpsNode`, :class:`DaemonGpuBackend`).
An adapter without a capability implements it with null behaviour (for pausers by inheriting
:class:`gpushare.node.pauser_defaults.PauserDefaults`; elsewhere a constant or a no-op), so no
caller probes for a method with ``getattr``: mypy sees every call. Each adapter's module has a
``_conforms`` function that mypy checks, and ``tests/test_conformance.py`` checks every adapter and
fake against the Protocols it claims, signatures included. (What a policy declares besides its
step is on :class:`gpushare.control.policy.Policy`.)
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpushare.model import GpuEvent, GpuSample, MpsEvent, MpsState, PauseMechanism, ProbeReading

if TYPE_CHECKING:  # the route module imports the pausers' errors; only its type is needed here
    from gpushare.node.cgroups.route import FreezeRoute


class GpuBackend(Protocol):
    """NVML readings, one snapshot per GPU per tick (:mod:`gpushare.node.nvml`)."""

    def sample(self) -> Sequence[GpuSample]:
        """Read every GPU once; never raises, a failing GPU is a sample with ``error`` set."""
        ...

    def drain_events(self) -> Sequence[GpuEvent]:
        """XID and other critical events seen since the last call."""
        ...

    def close(self) -> None:
        """Release NVML and stop any event thread."""
        ...


class SimulatedFlag(Protocol):
    """An adapter that says whether what it reads is simulated (``daemon.simulated`` in status)."""

    #: True for the real-time simulated node (``daemon --simulate``); False for real hardware,
    #: the batch simulator (it serves no status) and fakes.
    simulated: bool


class DaemonGpuBackend(GpuBackend, SimulatedFlag, Protocol):
    """The daemon's GPU backend (``NodeState.gpu``)."""


class LatencyProbe(Protocol):
    """The per-GPU probe kernel's latency (:mod:`gpushare.node.probe_manager`)."""

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's latency over its window on one GPU; never raises."""
        ...

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        """Tell the probe whether offline work ran this tick (it learns its baseline only without)."""
        ...

    def close(self) -> None:
        """Stop every probe worker."""
        ...


class SlotHoldingProbe(LatencyProbe, Protocol):
    """A probe that says how many MPS client slots it holds (counted against the GPU's limit)."""

    def mps_client_slots(self, gpu_uuid: str) -> int:
        """MPS client slots the probe holds on this GPU now (0 where it holds none)."""
        ...


class Pauser(Protocol):
    """Freezes, thaws and kills a client's processes (:mod:`gpushare.node.cgroups`)."""

    mechanism: PauseMechanism

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Put a client's process (and later its children) under this pauser.

        With ``owner_uid`` the process must belong to that user: a pid handed to the daemon
        never lets one user freeze or kill another's process.
        """
        ...

    def freeze(self, client_id: str) -> None:
        """Stop the client's processes from running (and so from issuing GPU work)."""
        ...

    def thaw(self, client_id: str) -> None:
        """Let the client's processes run again."""
        ...

    def kill(self, client_id: str) -> None:
        """Kill every process of the client."""
        ...

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's live processes."""
        ...

    def release(self, client_id: str) -> None:
        """Forget a client whose processes are gone (removes its cgroup)."""
        ...


class BatchPauser(Pauser, Protocol):
    """A pauser that acts on several clients at once, or asks without waiting (request gating)."""

    #: True when :meth:`request_frozen` already waits for each freeze (a pauser that cannot only
    #: ask: the null behaviour); False when it only asks, and a caller that must know the
    #: clients are stopped calls :meth:`Pauser.freeze` after it (the gate does).
    request_waits: bool

    def freeze_many(self, client_ids: Sequence[str]) -> None:
        """Freeze several clients, all asked before any is waited for (else one by one)."""
        ...

    def thaw_many(self, client_ids: Sequence[str]) -> None:
        """Thaw several clients."""
        ...

    def request_frozen(self, client_ids: Sequence[str], frozen: bool) -> list[str]:
        """Ask for each client to be frozen (or thawed); waits only when :attr:`request_waits`.

        Returns:
            The clients that could not be asked (gone, never attached, or their freeze failed).
        """
        ...

    def is_frozen(self, client_id: str) -> bool:
        """Whether every process of the client is stopped now (``False`` when unknown or none)."""
        ...


class TrackingPauser(Pauser, Protocol):
    """A pauser that can say which processes a client has now, and whose a process is."""

    def members(self, client_id: str) -> Sequence[int]:
        """The client's processes read now (:meth:`Pauser.pids` may lag a fork); for signals."""
        ...

    def owner_of(self, pid: int) -> str | None:
        """The client whose cgroup holds ``pid``; ``None`` when none or the pauser cannot tell."""
        ...

    def clients(self) -> dict[str, list[int]]:
        """Every client the pauser holds and its live processes (empty when it cannot list)."""
        ...


class SpawnPauser(Pauser, Protocol):
    """A pauser a client can join before its program runs (the cgroup freezer)."""

    def open_procs_fd(self, client_id: str) -> int | None:
        """An open ``cgroup.procs`` of the client's cgroup for the child to join before exec.

        ``None`` when the pauser has nothing to join (signals, simulated, fakes): the child is
        attached after it started.
        """
        ...


class LaunchPauser(BatchPauser, TrackingPauser, SpawnPauser, Protocol):
    """Every capability of a pauser of launched clients (cgroup freezer, signals)."""


class AdoptPauser(Pauser, Protocol):
    """A pauser that takes processes gpushare did not start where they are (adoption)."""

    def adopt(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> FreezeRoute:
        """Take ``pid`` as client ``client_id`` without moving it; how it will be paused.

        A pauser that cannot pause a process where it is attaches it as a launched client
        (the null behaviour) and says so in the route's reason.

        Raises:
            PauserError: the process is gone, is init or the daemon, or is another uid's.
        """
        ...

    def route(self, client_id: str) -> FreezeRoute | None:
        """How an adopted client is paused; ``None`` for a launched or unknown one."""
        ...

    def mechanism_of(self, client_id: str) -> PauseMechanism:
        """The mechanism that pauses this client (:attr:`Pauser.mechanism` unless adopted)."""
        ...


class NodePauser(LaunchPauser, AdoptPauser, Protocol):
    """The daemon's pauser: every capability it calls (``NodeState.pauser``)."""


class MpsNode(Protocol):
    """The MPS side of every shared GPU (:mod:`gpushare.node.mps`): one control daemon per GPU."""

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """The ``CUDA_MPS_PIPE_DIRECTORY`` clients of this GPU must use."""
        ...

    def state(self, gpu_uuid: str) -> MpsState:
        """Health of the GPU's control daemon and server."""
        ...

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """Events since the last call."""
        ...

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """Kill the client's outstanding GPU work (MPS ``terminate_client``); True on success."""
        ...

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Recover a FAULTed server: offline clients terminated first, then the rest."""
        ...


class ManagedMpsNode(MpsNode, Protocol):
    """An :class:`MpsNode` whose control daemons are started and stopped (``MpsNodeManager``)."""

    def start(self) -> None:
        """Start every GPU's control daemon."""
        ...

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Stop supervising and, with ``quit_daemon``, the daemons (nothing to stop: no-op)."""
        ...


class MultiuserInfo(Protocol):
    """What the daemon reads of one GPU's MPS control daemon (``MpsSupervisor``)."""

    @property
    def multiuser(self) -> bool:
        """Whether the daemon was started with ``-multiuser-server``."""
        ...


class DescribedMpsNode(MpsNode, Protocol):
    """An :class:`MpsNode` that says what answers it and how each GPU's daemon runs."""

    @property
    def backend(self) -> str | None:
        """What answers MPS commands: ``"real"``, ``"simulated"``, ``None`` where unknown.

        Shown as ``gpus[].mps_backend`` in ``gpushare status --json``.
        """
        ...

    @property
    def supervisors(self) -> Mapping[str, MultiuserInfo]:
        """Each GPU's control daemon by UUID; empty where none is real (assume single-user)."""
        ...


class DaemonMpsNode(ManagedMpsNode, DescribedMpsNode, Protocol):
    """The daemon's MPS node: every capability it calls (``NodeState.mps``)."""


Process = subprocess.Popen[bytes] | int
"""A client's process as :class:`ProcessHost` hands it out: a child (``Popen``) or a pid."""


class Clock(Protocol):
    """The time the daemon's loop runs on: the host's clocks, or the simulator's virtual time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: the ``now`` of ticks and deadlines."""
        ...

    def time(self) -> float:
        """Seconds since the epoch: the registry's timestamps."""
        ...

    def sleep_until(self, deadline: float, stop: threading.Event) -> bool:
        """Wait until :meth:`monotonic` reaches ``deadline`` or ``stop`` is set; True if stopped."""
        ...


class ProcessHost(Protocol):
    """Starts, signals and watches clients' processes (:mod:`gpushare.node.procs.host`)."""

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Begin reporting exits of watched processes as ``on_exit(pid, exit_code)``."""
        ...

    def stop(self) -> None:
        """Stop reporting exits."""
        ...

    def health(self) -> tuple[bool, int, str | None]:
        """The exit watcher's ``(alive, restarts, last_error)`` (``daemon.threads`` in status)."""
        ...

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
    ) -> tuple[Process, float | None, Path]:
        """Start a detached workload as ``uid``: (process, its start time, its log).

        Raises:
            OSError: the program, the working directory or the log cannot be used.
        """
        ...

    def watch(self, proc: Process, start_time: float | None = None) -> None:
        """Report when ``proc`` exits (at once when it is already gone or the pid was reused)."""
        ...

    def reap(self, proc: Process, timeout_s: float) -> bool:
        """Wait for a killed process the daemon spawned, unreported; False if it outlived that."""
        ...

    def signal(self, pid: int, sig: int, pids: Sequence[int]) -> None:
        """Signal a client: its process group when ``pid`` leads one, else each of ``pids``."""
        ...

    def alive(self, pid: int, start_time: float) -> bool:
        """Whether ``pid`` is still the process that started at ``start_time``."""
        ...


class ComputeModeControl(Protocol):
    """Reads and sets a GPU's compute mode (:class:`gpushare.node.nvml.NvmlBackend`).

    The MPS supervisor puts shared GPUs in ``"exclusive_process"`` and restores the old mode.
    """

    def get_compute_mode(self, uuid: str) -> str | None:
        """``"default"``, ``"exclusive_process"``, ``"prohibited"``, or ``None`` if unreadable."""
        ...

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Set ``"exclusive_process"`` or ``"default"`` (root only); raises on failure."""
        ...
