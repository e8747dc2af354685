"""The Protocols every node adapter implements.

The real adapters live in this package, the simulated node in :mod:`gpushare.sim`, and the fakes
in ``tests/``.

The daemon's run loop talks to the node only through these, which is what lets the same loop and
controller run on a real host, on the simulator (in virtual time: :class:`Clock`) and in tests.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from gpushare.model import GpuEvent, GpuSample, MpsEvent, MpsState, PauseMechanism, ProbeReading


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
