"""The real :class:`gpushare.node.base.ProcessHost`: workloads spawned detached as their submitter.

MPS fixes a client's SM share, pinned-memory cap and priority when the client starts
(docs/design.md §2), so the environment comes decided from the daemon (its queue policy is
:mod:`gpushare.daemon.launcher`); this module only runs it. The workload always runs as the
submitting user with that user's groups (docs/design.md D9); argv is a list end to end, never a
shell string. Exits are noticed by :class:`~gpushare.node.procs.exits.ExitWatcher` (pidfds).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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
