"""Spawning workloads as their submitter, never with more privilege (docs/design.md D9).

:func:`spawn` runs an argv (never a shell) as a given uid/gid with that user's groups only, in a
new session, entering the working directory as that user, stdin from ``/dev/null`` and
stdout+stderr into a log file owned by the user.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.node.exec import run as exec_run
from gpushare.node.notify import clean_env
from gpushare.node.procs.users import user_groups

log = structlog.get_logger(__name__)


class SpawnError(OSError):
    """A workload could not be started; the message names the command and the fix."""


def open_log(log_path: Path, uid: int, gid: int) -> int:
    """Open a client log for appending: created 0600 and owned by ``uid:gid``; return the descriptor.

    Created exclusively and never through a symlink, so a user cannot point the daemon's
    root-opened log at a file of their choosing. An existing log is used only when it is what a
    launch of this user left (a relaunch of the same client appends): a regular file with one
    link, owned by ``uid``. Any other file there (another user's log left by an earlier client of
    the same name) is refused, never chowned.

    Raises:
        SpawnError: the file cannot be opened, is not this user's log, or cannot be handed over.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    root = os.geteuid() == 0
    created = True
    try:
        try:
            fd = os.open(log_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            created = False
            fd = os.open(log_path, flags)
    except OSError as exc:
        raise SpawnError(
            exc.errno, f"cannot open client log {log_path}: {exc.strerror}; check client_log_dir"
        ) from exc
    try:
        if created:
            if root:
                os.fchown(fd, uid, gid)
        else:
            _check_users_log(fd, log_path, uid if root else None)
    except SpawnError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise SpawnError(
            exc.errno, f"cannot hand client log {log_path} over: {exc.strerror}"
        ) from exc
    return fd


def _check_users_log(fd: int, log_path: Path, uid: int | None) -> None:
    """Refuse an existing log that a launch of ``uid`` did not leave; else make it 0600."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (uid is not None and st.st_uid != uid):
        raise SpawnError(
            errno.EEXIST,
            f"client log {log_path} already exists and is not this user's (owner uid "
            f"{st.st_uid}); it is left as it is and not used",
        )
    os.fchmod(fd, 0o600)


# GNU env's exit statuses when it cannot chdir or exec (coreutils env(1)); spawn runs the workload
# through `env -C` so these are what a bad working directory or command looks like.
LAUNCH_FAILURES = {
    125: "the working directory is missing or not accessible to the user",
    126: "the command is not executable by the user",
    127: "the command was not found in the user's PATH",
}
_ENV_DIRS = "/usr/bin:/bin"
#: The umask a workload starts with: a login's usual one, whatever the daemon's own (UMask=0077).
WORKLOAD_UMASK = 0o022


def launch_failure(exit_code: int | None) -> str | None:
    """What an exit status of a process started by :func:`spawn` may mean, or ``None``.

    The codes are GNU env's; a workload that exits 125-127 itself reads the same, so callers
    should say "probably" and point at the log file.
    """
    return LAUNCH_FAILURES.get(exit_code) if exit_code is not None else None


@functools.lru_cache(maxsize=1)
def _env_binary() -> str | None:
    """GNU env with ``-C`` (chdir), or ``None`` where it lacks the option (busybox, coreutils < 8.28)."""
    found = shutil.which("env", path=_ENV_DIRS)
    if found is None:
        return None
    try:
        probe = exec_run([found, "-C", "/", "--", "true"], timeout_s=5.0, env={"PATH": _ENV_DIRS})
    except OSError:
        return None
    return found if probe.ok else None


def spawn(
    argv: Sequence[str],
    *,
    uid: int,
    gid: int,
    groups: Sequence[int] | None = None,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    log_path: Path | None,
    new_session: bool = True,
    cgroup_procs_fd: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``uid:gid``, never with more privilege than that user.

    The child gets exactly ``groups`` (default: the user's login groups) as supplementary groups,
    ``env`` minus systemd's notify variables, stdin ``/dev/null``, and stdout+stderr appended to
    ``log_path`` (``/dev/null`` when ``None``). Nothing goes through a shell.

    The user's identity is taken before the working directory is entered: the child runs
    ``env -C <cwd> -- argv…`` as the user, which changes directory and then execs ``argv`` (same
    pid). Entering ``cwd`` as root first would let a user work inside a directory whose parents
    they may not traverse. Consequently a bad ``cwd`` or command shows up as exit status 125, 126
    or 127 with env's message in the log (see :func:`launch_failure`), not as an exception.
    ``argv[0]`` is looked up in ``env["PATH"]``, relative to ``cwd`` when it has a slash.

    Args:
        argv: the command and its arguments.
        uid: the submitter's uid.
        gid: the submitter's primary gid.
        groups: supplementary groups; ``None`` means :func:`user_groups`.
        cwd: the working directory (the submitter's), absolute.
        env: the complete environment of the child.
        log_path: where output goes; created 0600 and owned by ``uid:gid`` (:func:`open_log`).
        new_session: start a new session (and process group), so the client can be paused and
            killed as a group and does not get the daemon's terminal signals.
        cgroup_procs_fd: an open ``cgroup.procs`` of the client's cgroup
            (``CgroupPauser.open_procs_fd``). The child writes itself into it before it drops
            privileges and execs, so no process of the workload ever runs outside its cgroup;
            the caller closes the descriptor afterwards.

    Returns:
        The running child.

    Raises:
        ValueError: ``argv`` is empty, its program name contains ``=``, or ``cwd`` is relative.
        SpawnError: the user switch, the log file or the launcher failed (message says which).
    """
    args, workdir = _command(argv, cwd)
    supplementary = list(groups) if groups is not None else user_groups(uid, gid)
    launcher, as_root = _launcher(uid, gid)
    out_fd = open_log(log_path, uid, gid) if log_path is not None else None
    # Popen switches ids in C before it would call a preexec_fn, and joining a cgroup needs the
    # daemon's rights: with a cgroup to join, the child does both itself, in that order.
    join = cgroup_procs_fd is not None
    setup = _join_then_drop(cgroup_procs_fd, uid, gid, supplementary, as_root) if join else None
    switch = (uid, gid, supplementary) if as_root and not join else None
    try:
        proc = _popen([launcher, "-C", workdir, "--", *args], out_fd, clean_env(env), new_session,
                      switch, setup)  # fmt: skip
    except subprocess.SubprocessError as exc:
        raise SpawnError(
            1,
            f"cannot start {args[0]!r}: joining its cgroup or switching to uid {uid} failed "
            "in the child (is the cgroup still there?)",
        ) from exc
    except OSError as exc:
        raise SpawnError(
            exc.errno, f"cannot start {args[0]!r} through {launcher}: {exc.strerror or exc}"
        ) from exc
    finally:
        if out_fd is not None:
            os.close(out_fd)
    log.info("process_spawned", pid=proc.pid, uid=uid, gid=gid, argv0=args[0])
    return proc


def _popen(
    cmd: list[str],
    out_fd: int | None,
    env: dict[str, str],
    new_session: bool,
    switch: tuple[int, int, list[int]] | None,
    setup: Callable[[], None] | None,
) -> subprocess.Popen[bytes]:
    """Popen as :func:`spawn` needs it; ``switch`` is (uid, gid, groups) for Popen to take."""
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=out_fd if out_fd is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        cwd="/",
        env=env,
        close_fds=True,
        start_new_session=new_session,
        # The unit's UMask=0077 is for the daemon's own files; a workload gets the usual one.
        umask=WORKLOAD_UMASK,
        user=switch[0] if switch else None,
        group=switch[1] if switch else None,
        extra_groups=switch[2] if switch else None,
        preexec_fn=setup,  # direct system calls only, see _join_then_drop
    )


def _command(argv: Sequence[str], cwd: str | os.PathLike[str]) -> tuple[list[str], str]:
    """``argv`` and ``cwd`` as strings, checked as :func:`spawn` documents (``ValueError``)."""
    if not argv:
        raise ValueError("empty command: give the program to run after '--'")
    workdir = os.fspath(cwd)
    if not os.path.isabs(workdir):
        raise ValueError(f"working directory {workdir!r} must be an absolute path")
    args = [os.fspath(a) for a in argv]
    if "=" in args[0]:
        # env(1) would take it for a NAME=VALUE assignment, not a command.
        raise ValueError(f"command {args[0]!r} contains '=': rename the program")
    return args, workdir


def _launcher(uid: int, gid: int) -> tuple[str, bool]:
    """GNU env to start through, and whether the daemon is root (``SpawnError`` as documented)."""
    # Root drops to the submitter completely (also when the submitter is root: only root's own
    # login groups remain); anyone else can only start its own workloads.
    as_root = os.geteuid() == 0
    if not as_root and (uid != os.geteuid() or gid != os.getegid()):
        raise SpawnError(
            1,
            f"cannot start a workload as uid {uid} gid {gid} from uid {os.geteuid()}: "
            "the daemon must run as root to launch other users' workloads",
        )
    launcher = _env_binary()
    if launcher is None:
        raise SpawnError(
            2,
            f"no GNU env with -C in {_ENV_DIRS}: install coreutils >= 8.28 "
            "(gpushare enters the working directory as the user through it)",
        )
    return launcher, as_root


def _join_then_drop(
    procs_fd: int | None, uid: int, gid: int, groups: list[int], as_root: bool
) -> Callable[[], None]:
    """The child's steps between fork and exec: join the cgroup, then become the user.

    Runs in the forked child of a threaded daemon, so it only makes direct system calls on
    values prepared here (no imports, locks, logging or I/O buffers).
    """
    join = b"0"  # "0" moves the writing process itself
    group_list = list(groups)

    def setup() -> None:
        if procs_fd is not None:
            os.write(procs_fd, join)
        if as_root:
            os.setgroups(group_list)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)

    return setup
