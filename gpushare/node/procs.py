"""Processes: spawning workloads as their submitter, identity across restarts, and exit noticing.

This module owns ``/proc``, psutil, process spawning and uid switching (docs/design.md §3, D9).

- :func:`spawn` runs an argv (never a shell) as a given uid/gid with that user's groups only, in a
  new session, entering the working directory as that user, stdin from ``/dev/null`` and
  stdout+stderr into a log file owned by the user.
- :func:`process_start_time` and :func:`is_same_process` tell a live client from a recycled pid
  when the daemon re-adopts clients after a restart (docs/design.md D6).
- :func:`process_facts` reads what adoption rules match on (uid, cgroup, systemd unit, the
  ``GPUSHARE_*``/``CUDA_MPS_*`` environment) for processes gpushare did not start.
- :class:`ExitWatcher` notices exits on its own thread through pidfds (``poll``, no busy loop):
  children report their exit code, adopted non-children report ``None`` (unknowable).
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import queue
import select
import shutil
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import structlog

from gpushare.model import ProcessFacts
from gpushare.node.exec import run as exec_run
from gpushare.node.notify import clean_env

log = structlog.get_logger(__name__)

# psutil's create_time comes from /proc/<pid>/stat start ticks (10 ms on Linux) plus the boot
# time; allow a little more than one tick so that two readings of one process always match.
START_TIME_TOLERANCE_S = 0.02


class SpawnError(OSError):
    """A workload could not be started; the message names the command and the fix."""


class Exit(NamedTuple):
    """One exit noticed by :class:`ExitWatcher`.

    ``exit_code`` follows ``Popen.returncode``: the status for a normal exit, ``-N`` for death by
    signal N, and ``None`` when it is unknown: the process was not our child and its parent reaped
    it before we could read its status.
    """

    pid: int
    exit_code: int | None


# ---------------------------------------------------------------------------------------------------
# Users and groups


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the number as text when it has no passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def user_groups(uid: int, gid: int) -> list[int]:
    """The groups ``uid`` gets at login (primary ``gid`` first); just ``[gid]`` without an entry."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return [gid]
    groups = os.getgrouplist(name, gid)
    return [gid, *sorted(set(groups) - {gid})]


def user_in_group(uid: int, group_name: str) -> bool:
    """Whether ``uid`` belongs to ``group_name``, as primary or supplementary group.

    An unknown group or a uid without a passwd entry is not a member.
    """
    try:
        group = grp.getgrnam(group_name)
        entry = pwd.getpwuid(uid)
    except KeyError:
        return False
    if entry.pw_gid == group.gr_gid or entry.pw_name in group.gr_mem:
        return True
    # getgrouplist also asks NSS sources that do not list members in the group entry.
    return group.gr_gid in os.getgrouplist(entry.pw_name, entry.pw_gid)


# ---------------------------------------------------------------------------------------------------
# Spawning


def open_log(log_path: Path, uid: int, gid: int) -> int:
    """Open (append, create 0640) a client log file owned by ``uid:gid``; return the descriptor.

    Refuses to follow a symlink at the final component, so a user cannot point the daemon's
    root-opened log at a file of their choosing.

    Raises:
        SpawnError: the file cannot be opened or handed to the user.
    """
    try:
        fd = os.open(
            log_path,
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o640,
        )
    except OSError as exc:
        raise SpawnError(
            exc.errno, f"cannot open client log {log_path}: {exc.strerror}; check client_log_dir"
        ) from exc
    try:
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
    except OSError as exc:
        os.close(fd)
        raise SpawnError(exc.errno, f"cannot chown client log {log_path}: {exc.strerror}") from exc
    return fd


# GNU env's exit statuses when it cannot chdir or exec (coreutils env(1)); spawn runs the workload
# through `env -C` so these are what a bad working directory or command looks like.
LAUNCH_FAILURES = {
    125: "the working directory is missing or not accessible to the user",
    126: "the command is not executable by the user",
    127: "the command was not found in the user's PATH",
}
_ENV_DIRS = "/usr/bin:/bin"


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
        log_path: where output goes; created 0640 and owned by ``uid:gid``.
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
    if not argv:
        raise ValueError("empty command: give the program to run after '--'")
    workdir = os.fspath(cwd)
    if not os.path.isabs(workdir):
        raise ValueError(f"working directory {workdir!r} must be an absolute path")
    args = [os.fspath(a) for a in argv]
    if "=" in args[0]:
        # env(1) would take it for a NAME=VALUE assignment, not a command.
        raise ValueError(f"command {args[0]!r} contains '=': rename the program")
    supplementary = list(groups) if groups is not None else user_groups(uid, gid)
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
    out_fd = open_log(log_path, uid, gid) if log_path is not None else None
    # Popen switches ids in C before it would call a preexec_fn, and joining a cgroup needs the
    # daemon's rights: with a cgroup to join, the child does both itself, in that order.
    join = cgroup_procs_fd is not None
    setup = _join_then_drop(cgroup_procs_fd, uid, gid, supplementary, as_root) if join else None
    try:
        proc = subprocess.Popen(
            [launcher, "-C", workdir, "--", *args],
            stdin=subprocess.DEVNULL,
            stdout=out_fd if out_fd is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd="/",
            env=clean_env(env),
            close_fds=True,
            start_new_session=new_session,
            user=uid if as_root and not join else None,
            group=gid if as_root and not join else None,
            extra_groups=supplementary if as_root and not join else None,
            preexec_fn=setup,  # direct system calls only, see _join_then_drop
        )
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


# ---------------------------------------------------------------------------------------------------
# Identity and /proc


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch, psutil ``create_time``), or ``None`` if gone."""
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_same_process(pid: int, start_time: float | None) -> bool:
    """Whether ``pid`` still runs and is the process that started at ``start_time``.

    A recycled pid has another start time; a zombie has finished and does not count. A missing
    record (pid ``0`` or below, start time ``None``) is never the same process.
    """
    if pid <= 0 or start_time is None:
        return False
    try:
        proc = psutil.Process(pid)
        same = abs(proc.create_time() - start_time) <= START_TIME_TOLERANCE_S
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def process_uid(pid: int) -> int | None:
    """The real uid of ``pid``, or ``None`` when it is gone."""
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid).uids().real
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_identity(pid: int) -> tuple[int, list[str]] | None:
    """The real gid and the command line of ``pid`` (for an adopted client's record); ``None`` if gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return proc.gids().real, proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children, grandchildren, …); empty when it is gone."""
    if pid <= 0:
        return []
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return sorted(kid.pid for kid in kids)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    return groups_members([pgid])[pgid]


def groups_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """Live (non-zombie) members of each process group in ``pgids``, in one pass over /proc."""
    out: dict[int, list[int]] = {pgid: [] for pgid in pgids}
    if not out:
        return out
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _stat_fields(int(entry.name))
        # fields after "comm": [0] state, [1] ppid, [2] pgrp
        if stat is not None and stat[0] != "Z":
            members = out.get(int(stat[2]))
            if members is not None:
                members.append(int(entry.name))
    for members in out.values():
        members.sort()
    return out


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state ``T``); ``True`` for a gone process.

    A gone process cannot run, which is what the caller waiting for a stop wants to know.
    """
    stat = _stat_fields(pid)
    # T: stopped by a signal, t: stopped under a tracer; Z/X: finished.
    return stat is None or stat[0] in ("T", "t", "Z", "X")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses; everything after the last ")" is well-formed.
    end = raw.rfind(")")
    return raw[end + 2 :].split() if end >= 0 else None


# ---------------------------------------------------------------------------------------------------
# Facts of processes gpushare did not start (adoption)

# systemd puts a unit's processes in a cgroup named after it; services and scopes hold processes,
# slices only hold other cgroups.
_UNIT_SUFFIXES = (".service", ".scope")
_PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup v2 path in the text of a ``/proc/<pid>/cgroup`` file (its ``0::`` line)."""
    for line in text.splitlines():
        hierarchy, _controllers, path = line.split(":", 2)
        if hierarchy == "0":
            return path
    return None


def process_cgroup(pid: int) -> str | None:
    """The cgroup v2 path of ``pid`` from the hierarchy's root, or ``None`` (gone, or no v2)."""
    try:
        return cgroup_v2_path(Path(f"/proc/{pid}/cgroup").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def unit_of_cgroup(path: str | None) -> str | None:
    """The systemd unit whose cgroup ``path`` lies in: the deepest ``.service``/``.scope`` part.

    ``/system.slice/triton.service`` gives ``triton.service``; a user's unit under
    ``user@1000.service/app.slice/x.service`` gives ``x.service``; a client cgroup in a delegated
    subtree (``.../gpushare.service/client-7``) gives ``gpushare.service``.
    """
    if not path:
        return None
    for part in reversed(path.strip("/").split("/")):
        if part.endswith(_UNIT_SUFFIXES):
            return part
    return None


def read_environ(pid: int, names: Collection[str]) -> dict[str, str] | None:
    """The variables of ``names`` in ``/proc/<pid>/environ`` (the environment it started with).

    Only the named variables are returned: the rest may hold secrets.

    Returns:
        The variables found (empty for a zombie or a kernel thread), or ``None`` when the process
        is gone.

    Raises:
        PermissionError: another user's process, and we are not root.
    """
    raw = _read_proc(pid, "environ")
    if raw is None:
        return None
    # Look each wanted name up rather than split the whole environment: a scan reads every
    # process's. The first occurrence wins, as getenv(3) finds it.
    buf = b"\0" + raw
    out: dict[str, str] = {}
    for name in names:
        key = b"\0" + name.encode() + b"="
        at = buf.find(key)
        if at < 0:
            continue
        begin = at + len(key)
        stop = buf.find(b"\0", begin)
        out[name] = buf[begin : stop if stop >= 0 else len(buf)].decode(errors="replace")
    return out


def all_pids() -> list[int]:
    """Every process now in ``/proc`` (this pid namespace), in pid order."""
    return sorted(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())


def process_facts(
    pid: int, env_names: Collection[str], gpu_pids: Mapping[int, tuple[str, ...]] | None = None
) -> ProcessFacts | None:
    """What adoption needs to know about ``pid``; ``None`` when it is gone or a kernel thread.

    Read straight from ``/proc/<pid>/{stat,status,cgroup,environ}`` (the adoption scan reads every
    process of the host, ``bench/adopt_scan.py``). The start time is read first and checked again
    last, so facts of a process that exited (or a pid reused) while they were read are never
    returned as one process's facts.

    Args:
        pid: the process.
        env_names: the environment variables to keep (:func:`read_environ`).
        gpu_pids: pid to GPU UUIDs from NVML's compute-process lists; ``None`` where NVML is not
            available (``uses_gpu`` is then unknown, not false).
    """
    first = _comm_and_stat(pid)
    # Index 6 is field 9 (flags), index 19 field 22 (start time in clock ticks since boot).
    if first is None or int(first[1][6]) & _PF_KTHREAD:
        return None
    name, stat = first
    uid = _real_uid(pid)
    if uid is None:
        return None
    cgroup_text = _read_proc(pid, "cgroup")
    cgroup = cgroup_v2_path(cgroup_text.decode()) if cgroup_text is not None else None
    try:
        environ = read_environ(pid, env_names)
    except PermissionError:
        environ = None
    else:
        if environ is None:
            return None
    again = _comm_and_stat(pid)
    if again is None or again[1][19] != stat[19] or again[1][0] in ("Z", "X"):
        return None
    return ProcessFacts(
        pid=pid, ppid=int(stat[1]), uid=uid, user=user_name(uid), name=name,
        start_time=_boot_time() + int(stat[19]) / _CLK_TCK,
        cgroup=cgroup, unit=unit_of_cgroup(cgroup), environ=environ,
        gpu_uuids=None if gpu_pids is None else gpu_pids.get(pid, ()),
    )  # fmt: skip


_CLK_TCK = os.sysconf("SC_CLK_TCK")


class Stamp(NamedTuple):
    """What one read of ``/proc/<pid>/stat`` says about a process (:func:`process_stamp`)."""

    name: str
    ppid: int
    state: str
    kernel_thread: bool
    image: tuple[int, int, int]
    """Start time (clock ticks since boot) and the address range of the environment: a reused pid
    has another start time, and an ``exec`` lays out a new environment at another address."""


def process_stamp(pid: int) -> Stamp | None:
    """One read of ``/proc/<pid>/stat``: enough to tell whether cached facts still hold.

    The environment's addresses (fields 50 and 51) read as 0 where the reader may not trace the
    process; its environment is then unreadable anyway, and the name still changes on ``exec``.
    """
    first = _comm_and_stat(pid)
    if first is None:
        return None
    name, stat = first
    env = (int(stat[47]), int(stat[48])) if len(stat) > 48 else (0, 0)
    return Stamp(
        name, int(stat[1]), stat[0], bool(int(stat[6]) & _PF_KTHREAD), (int(stat[19]), *env)
    )


def process_owner(pid: int) -> tuple[int, str | None] | None:
    """The real uid and cgroup v2 path of ``pid`` (the facts that change without an ``exec``)."""
    uid = _real_uid(pid)
    cgroup_text = _read_proc(pid, "cgroup")
    if uid is None or cgroup_text is None:
        return None
    return uid, cgroup_v2_path(cgroup_text.decode())


@functools.cache
def _boot_time() -> float:
    # The same clock psutil's create_time uses (btime of /proc/stat), so start times compare.
    return float(psutil.boot_time())


def _read_proc(pid: int, name: str) -> bytes | None:
    # One open/read/close, without pathlib's overhead: the scan does this for every process.
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def _comm_and_stat(pid: int) -> tuple[str, list[str]] | None:
    raw = _read_proc(pid, "stat")
    if raw is None:
        return None
    start, end = raw.find(b"("), raw.rfind(b")")
    if not 0 <= start < end:
        return None
    return raw[start + 1 : end].decode(errors="replace"), raw[end + 2 :].decode().split()


def _real_uid(pid: int) -> int | None:
    raw = _read_proc(pid, "status")
    at = raw.find(b"\nUid:") if raw is not None else -1
    return int(raw[at + 5 :].split(None, 1)[0]) if raw is not None and at >= 0 else None


# ---------------------------------------------------------------------------------------------------
# Exit noticing


class ExitWatcher:
    """Notices process exits on its own thread and reports each one once.

    Every watched process is held by a pidfd (``os.pidfd_open``); one ``poll`` covers them all and
    a pipe wakes it for new processes and for :meth:`stop`. When a pidfd turns readable the process
    has exited: a child is reaped (``Popen.poll`` or ``waitpid``) and its exit code reported; for a
    non-child (adopted after a daemon restart, or a foreground client) the code is read from its
    zombie when its parent has not reaped it yet, and is ``None`` otherwise.

    Args:
        on_exit: called as ``on_exit(pid, exit_code)`` on the watcher thread; without it, exits
            are put on :attr:`exits` as :class:`Exit` tuples.
    """

    def __init__(self, on_exit: Callable[[int, int | None], None] | None = None) -> None:
        self.exits: queue.Queue[Exit] = queue.Queue()
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[int, subprocess.Popen[Any] | None, bool]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="exit-watcher", daemon=True)
        self._started = False

    def start(self) -> ExitWatcher:
        """Start the watcher thread; returns ``self``."""
        self._started = True
        self._thread.start()
        return self

    def watch(self, proc: subprocess.Popen[Any] | int, start_time: float | None = None) -> bool:
        """Report when ``proc`` exits.

        Args:
            proc: a ``Popen`` (its exit code is reaped through it) or a pid. A pid of our own child
                is reaped with ``waitpid``; for any other pid the exit code is best effort
                (see :class:`Exit`).
            start_time: for a pid, the start time recorded earlier; when it no longer matches (the
                pid was recycled) the exit is reported at once.

        Returns:
            True when the process is being watched; False when its exit was reported at once
            (already gone, or the pid no longer matches ``start_time``).

        Raises:
            RuntimeError: the watcher was stopped.
        """
        if self._stopping:
            raise RuntimeError("the exit watcher is stopped: create a new one")
        pid = proc if isinstance(proc, int) else proc.pid
        popen = None if isinstance(proc, int) else proc
        if popen is not None and popen.returncode is not None:
            # Already reaped elsewhere; its pid may belong to someone else by now.
            self._report(pid, popen.returncode)
            return False
        is_child = popen is not None or _is_child(pid)
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._report(pid, self._reap(pid, popen, is_child))
            return False
        if start_time is not None and not is_child and not is_same_process(pid, start_time):
            # The pidfd pins whatever holds the pid now, which is not the process we were asked
            # about: that one is already gone.
            os.close(pidfd)
            self._report(pid, None)
            return False
        with self._lock:
            old = self._watched.pop(pid, None)
            self._watched[pid] = (pidfd, popen, is_child)
        if old is not None:
            os.close(old[0])
        self._wake()
        return True

    def unwatch(self, pid: int) -> None:
        """Stop watching ``pid`` without reporting it."""
        with self._lock:
            entry = self._watched.pop(pid, None)
        if entry is not None:
            os.close(entry[0])
            self._wake()

    def watched(self) -> list[int]:
        """The pids being watched."""
        with self._lock:
            return sorted(self._watched)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close every pidfd; pending exits are no longer reported."""
        self._stopping = True
        self._wake()
        if self._started:
            self._thread.join(timeout_s)
        with self._lock:
            entries, self._watched = list(self._watched.values()), {}
        for pidfd, _popen, _child in entries:
            os.close(pidfd)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while not self._stopping:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                by_fd = {fd: pid for pid, (fd, _p, _c) in self._watched.items()}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _events in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                pid = by_fd[fd]
                with self._lock:
                    entry = self._watched.get(pid)
                    if entry is None or entry[0] != fd:
                        continue  # unwatched or replaced since the poll set was built
                    del self._watched[pid]
                os.close(fd)
                _pidfd, popen, is_child = entry
                self._report(pid, self._reap(pid, popen, is_child))

    @staticmethod
    def _reap(pid: int, popen: subprocess.Popen[Any] | None, is_child: bool) -> int | None:
        if popen is not None:
            return popen.wait()
        if not is_child:
            return _zombie_exit_code(pid)
        try:
            _pid, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return None  # someone else reaped it
        return os.waitstatus_to_exitcode(status)

    def _report(self, pid: int, exit_code: int | None) -> None:
        log.debug("process_exited", pid=pid, exit_code=exit_code)
        if self._on_exit is None:
            self.exits.put(Exit(pid, exit_code))
            return
        try:
            self._on_exit(pid, exit_code)
        except Exception:
            # A failing callback must not end exit noticing for every other client.
            log.exception("exit_callback_failed", pid=pid)


def _zombie_exit_code(pid: int) -> int | None:
    """The exit code of a non-child that its parent has not reaped yet, else ``None``.

    Best effort: a finished process keeps its wait status in ``/proc/<pid>/stat`` (field 52) until
    its parent reaps it, which a shell does within microseconds, an init process soon after.
    """
    stat = _stat_fields(pid)
    # Index 0 is field 3 (state), so field 52 (exit_code) is index 49.
    if stat is None or stat[0] != "Z" or len(stat) < 50:
        return None
    return os.waitstatus_to_exitcode(int(stat[49]))


def _is_child(pid: int) -> bool:
    stat = _stat_fields(pid)
    return stat is not None and int(stat[1]) == os.getpid()
