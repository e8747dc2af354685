"""Starting clients: detached spawning as the submitter, with the environment of :mod:`gpushare.mpsenv`.

MPS fixes a client's SM share, pinned-memory cap and priority when the client starts
(docs/design.md §2), so everything is decided before exec, by the same code that ``gpushare env``
prints from. The workload always runs as the submitting user with that user's groups
(docs/design.md D9); argv is a list end to end, never a shell string.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpushare.node import procs


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
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    log_path = log_dir / f"{client_id}.log"
    proc = procs.spawn(
        argv,
        uid=uid,
        gid=gid,
        groups=procs.user_groups(uid, gid),
        cwd=cwd,
        env=env,
        log_path=log_path,
        cgroup_procs_fd=cgroup_procs_fd,
    )
    return proc, procs.process_start_time(proc.pid), log_path
