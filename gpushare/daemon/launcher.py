"""Starting clients: detached spawning as the submitter, with the environment of :mod:`gpushare.mpsenv`.

MPS fixes a client's SM share, pinned-memory cap and priority when the client starts
(docs/design.md §2), so everything is decided before exec, by the same code that ``gpushare env``
prints from. The workload always runs as the submitting user with that user's groups
(docs/design.md D9); argv is a list end to end, never a shell string.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpushare import native
from gpushare.config import GateConfig
from gpushare.native import CONTROL_ENV, INFLIGHT_ENV, LIBRARY_NAME
from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.procs.identity import is_same_process, process_start_time
from gpushare.node.procs.spawning import spawn
from gpushare.node.procs.users import user_groups


def spawn_detached(
    argv: Sequence[str],
    *,
    uid: int,
    gid: int,
    cwd: str,
    env: Mapping[str, str],
    log_dir: Path,
    client_id: str,
    cgroup_procs_fd: int | None = None,
) -> tuple[subprocess.Popen[bytes], float | None, Path]:
    """Start a detached workload as ``uid`` with its login groups; (process, start time, log).

    Raises:
        OSError: the program, the working directory or the log cannot be used.
    """
    # Made root's 0711 at start (daemon/statedir.py); a log dir removed since comes back 0711.
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    log_path = log_dir / f"{client_id}.log"
    proc = spawn(
        argv,
        uid=uid,
        gid=gid,
        groups=user_groups(uid, gid),
        cwd=cwd,
        env=env,
        log_path=log_path,
        cgroup_procs_fd=cgroup_procs_fd,
    )
    return proc, process_start_time(proc.pid), log_path


class HostProcesses:
    """:class:`gpushare.node.base.ProcessHost` on this host: real processes, pidfd exit watch."""

    def __init__(self) -> None:
        self._watcher: ExitWatcher | None = None

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Start the exit watcher thread."""
        self._watcher = ExitWatcher(on_exit).start()

    def stop(self) -> None:
        """Stop the exit watcher thread."""
        if self._watcher is not None:
            self._watcher.stop()

    def health(self) -> tuple[bool, int, str | None]:
        """The exit watcher's ``(alive, restarts, last_error)``; not alive before :meth:`start`."""
        if self._watcher is None:
            return False, 0, None
        return self._watcher.health()

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
    ) -> tuple[subprocess.Popen[bytes], float | None, Path]:
        """:func:`spawn_detached`."""
        return spawn_detached(
            argv, uid=uid, gid=gid, cwd=cwd, env=env, log_dir=log_dir, client_id=client_id,
            cgroup_procs_fd=cgroup_procs_fd,
        )  # fmt: skip

    def watch(self, proc: subprocess.Popen[bytes] | int, start_time: float | None = None) -> None:
        """Report the process's exit to the ``on_exit`` given to :meth:`start`."""
        assert self._watcher is not None, "start() first"
        self._watcher.watch(proc, start_time)

    def reap(self, proc: subprocess.Popen[bytes] | int, timeout_s: float) -> bool:
        """Wait for a spawned child to exit (a bare pid is not ours to wait for)."""
        if isinstance(proc, int):
            return True
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def signal(self, pid: int, sig: int, pids: Sequence[int]) -> None:
        """Signal the process group ``pid`` leads, or each of ``pids`` (a gone process is fine)."""
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                for each in pids or [pid]:
                    with contextlib.suppress(ProcessLookupError):  # one may have exited since
                        os.kill(each, sig)
        except ProcessLookupError:
            pass

    def alive(self, pid: int, start_time: float) -> bool:
        """Whether ``pid`` still is the process that started at ``start_time``."""
        return is_same_process(pid, start_time)


BLOCKING_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
"""A shallow queue by ``[gate] shallow_queue = "blocking"``: every kernel launch returns only when
the kernel has finished (CUDA Programming Guide, "Asynchronous Concurrent Execution"), so the
client has at most one kernel on the GPU and a freeze bites within one kernel. The guide documents
the variable as a debugging aid; its price is the CPU's time per kernel, which no longer overlaps
the GPU's (docs/controller.md, "Shallow offline queues")."""

SHALLOW_MARKERS = ("CUDA_LAUNCH_BLOCKING", INFLIGHT_ENV, CONTROL_ENV)
"""The variables that say, in a running client's environment, that it was launched shallow."""


def shallow_how(env: Mapping[str, str]) -> str | None:
    """How a client launched with ``env`` keeps its queue shallow, ``None`` for a deep queue.

    ``"<k> in flight"`` (the in-flight bound) or ``"blocking"`` (``CUDA_LAUNCH_BLOCKING=1``). Read
    from the launch environment and, on re-adoption, from ``/proc/<pid>/environ``.
    """
    if INFLIGHT_ENV in env:
        return f"{env[INFLIGHT_ENV]} in flight"
    if env.get("CUDA_LAUNCH_BLOCKING") == "1":
        return "blocking"
    return None


def choose_queue(mode: str | None, *, gating_on: bool) -> tuple[str, str]:
    """The queue an offline client is launched with: ``("shallow" | "deep", why)``.

    ``shallow`` and ``deep`` are what the submitter asked; ``None`` is ``deep`` (the behaviour
    before queues could be chosen). ``auto`` is decided at every (re)launch: shallow while request
    gating is on for the client's GPU (a freeze must bite within a kernel for gating to protect a
    request), deep otherwise. Deep even with the cheap in-flight bound: without gating, the duty
    cycle's freezes are what throttle, and a deep queue running on past each of them is offline
    work the duty cycle's loop has learned to allow (tried on the simulator: auto always bounded
    gave 0.07 of solo instead of 0.12 without gating over the 39 scenarios at 1.1x, attainment
    the same).
    MPS and CUDA read the variable at start, so a running client changes mode only when it is
    relaunched: a restart for a new share, a requeue, or the controller's restart of a restartable
    auto client whose queue does not match gating (``gpushare.control.restarts.shallow_restart``
    1 s after gating turns on, ``queue_restart`` a ``share_min_interval`` after it turns off).
    """
    if mode == "shallow":
        return "shallow", "--queue shallow"
    if mode == "auto":
        if gating_on:
            return "shallow", "--queue auto: request gating is on for this GPU"
        return "deep", "--queue auto: request gating is off for this GPU"
    return "deep", "--queue deep" if mode == "deep" else "default queue (deep)"


def queue_env(
    queue: str,
    gate: GateConfig,
    library: str | None,
    *,
    vet: Callable[[str], str | None] | None = None,
) -> tuple[dict[str, str], str]:
    """The variables of an effective queue mode (:func:`choose_queue`), and how it is kept shallow.

    ``library`` is the built in-flight bound (:func:`gpushare.native.library_path`), ``None`` when
    clients could not preload it at daemon start (:func:`gpushare.native.unusable_reason`).
    ``vet`` (the daemon passes :func:`library_refusal`) asks again now, at this launch: a library
    that was root's at start may have been replaced since by a user who can write a directory
    above it, and it would run in this client with its submitter's rights (root's, too). In both
    cases ``[gate] shallow_queue = "bounded"`` falls back to ``CUDA_LAUNCH_BLOCKING`` (a freeze
    still bites within a kernel; only the throughput is lower) and says why.
    The preload is joined in front of the workload's own ``LD_PRELOAD`` by
    :func:`gpushare.mpsenv.workload_env`.
    """
    if queue != "shallow":
        return {}, "deep"
    if gate.shallow_queue == "bounded":
        refused = None if library is None or vet is None else vet(library)
        if library is not None and refused is None:
            k = gate.inflight_kernels
            env = {"LD_PRELOAD": library, INFLIGHT_ENV: str(k)}
            return env, f"at most {k} kernels in flight ({LIBRARY_NAME})"
        return dict(BLOCKING_ENV), f"CUDA_LAUNCH_BLOCKING=1: {refused or CANNOT_PRELOAD}"
    return dict(BLOCKING_ENV), "CUDA_LAUNCH_BLOCKING=1"


def vetted_library(library: str | None, vet: Callable[[str], str | None] | None) -> str | None:
    """``library`` when it may be preloaded at this launch (``vet`` asked now), else ``None``."""
    if library is None or (vet is not None and vet(library) is not None):
        return None
    return library


def library_refusal(library: str) -> str | None:
    """Why ``library`` may not be preloaded at this launch (:func:`gpushare.native.unusable_reason`).

    A refusal is counted (``status``: ``trust_refusals``) and logged once per state of the files.
    """
    return native.unusable_reason(Path(library))


CANNOT_PRELOAD = (
    f"{LIBRARY_NAME} cannot be preloaded here (`gpushare doctor` says why; "
    "`sudo gpushare install` builds it)"
)
"""Why a bounded shallow queue runs as a blocking one, in each launch's ``offline_queue`` line."""

FALLBACK = '[gate] shallow_queue = "bounded" falls back to CUDA_LAUNCH_BLOCKING=1'
"""What happens then (the daemon's start-up warning names the reason)."""
