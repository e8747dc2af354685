"""Stand-ins for the OS adapters of ``gpushare.node`` (procs, cgroups, notify) the daemon uses.

The real modules (``node/procs.py``, ``node/cgroups.py``, ``node/notify.py``) are built on another
branch; this module gives the daemon the same small surface until they land, and is meant to be
replaced by re-exports of them. Each function follows the documented behaviour in
``reference/systemd-cgroups.md``.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import select
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import psutil
import structlog

from gpushare.model import PauseMechanism
from gpushare.node.base import Pauser

log = structlog.get_logger(__name__)

_SCRUBBED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
START_TIME_TOLERANCE_S = 0.02


class PauserChoice(NamedTuple):
    """The pauser the node gets and why (``node.cgroups.make_pauser``'s answer)."""

    pauser: Pauser
    reason: str


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch, psutil ``create_time``), or None if gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_same_process(pid: int, start_time: float) -> bool:
    """Whether ``pid`` still runs and is the process that started at ``start_time``.

    A recycled pid has another start time; a zombie has finished and does not count.
    """
    try:
        proc = psutil.Process(pid)
        same = abs(proc.create_time() - start_time) <= START_TIME_TOLERANCE_S
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


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
    return [gid, *sorted(set(os.getgrouplist(name, gid)) - {gid})]


def user_in_group(uid: int, group: str) -> bool:
    """Whether the user ``uid`` is a member of ``group`` (primary or supplementary)."""
    if not group:
        return False
    try:
        gr = grp.getgrnam(group)
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    return pw.pw_gid == gr.gr_gid or pw.pw_name in gr.gr_mem


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` without systemd's notify and watchdog variables."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if k not in _SCRUBBED_ENV}


def open_log(log_path: Path, uid: int, gid: int) -> int:
    """Open (append, create 0640, no symlink) a client log owned by ``uid:gid``; the descriptor.

    Raises:
        OSError: the file cannot be opened or handed to the user.
    """
    fd = os.open(
        log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640
    )
    try:
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
    except OSError:
        os.close(fd)
        raise
    return fd


def launch_failure(exit_code: int | None) -> str | None:
    """What an exit status of a process started by :func:`spawn` may mean (none here)."""
    return None


def spawn(
    argv: Sequence[str],
    *,
    uid: int,
    gid: int,
    groups: Sequence[int] | None = None,
    cwd: str,
    env: Mapping[str, str],
    log_path: Path | None,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (no shell) as ``uid``/``gid`` in its own session; output to ``log_path``.

    Raises:
        OSError: the program or ``cwd`` does not exist, or is not accessible.
    """
    switch = os.geteuid() == 0
    out_fd = open_log(log_path, uid, gid) if log_path is not None else None
    try:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=clean_env(env),
            stdin=subprocess.DEVNULL,
            stdout=out_fd if out_fd is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
            close_fds=True,
            user=uid if switch else None,
            group=gid if switch else None,
            extra_groups=(list(groups) if groups is not None else user_groups(uid, gid))
            if switch
            else None,
        )
    finally:
        if out_fd is not None:
            os.close(out_fd)


class ExitWatcher:
    """Reports each watched process's exit promptly through pidfds: ``on_exit(pid, exit_code)``.

    ``exit_code`` follows ``Popen.returncode`` for the daemon's own children (negative for a
    signal) and is None for processes it only adopted.
    """

    def __init__(self, on_exit: Callable[[int, int | None], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, tuple[int, subprocess.Popen[bytes] | None]] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="exit-watcher", daemon=True)

    def start(self) -> ExitWatcher:
        """Start the watcher thread; returns ``self``."""
        self._thread.start()
        return self

    def watch(self, proc: subprocess.Popen[bytes] | int, start_time: float | None = None) -> None:
        """Report when ``proc`` (a Popen, or a pid) exits; at once if it is already gone."""
        pid = proc if isinstance(proc, int) else proc.pid
        popen = None if isinstance(proc, int) else proc
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._report(pid, self._reap(pid, popen))
            return
        if start_time is not None and popen is None and not is_same_process(pid, start_time):
            os.close(fd)
            self._report(pid, None)
            return
        with self._lock:
            self._fds[fd] = (pid, popen)
        self._wake()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop watching everything."""
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    @staticmethod
    def _reap(pid: int, popen: subprocess.Popen[bytes] | None) -> int | None:
        if popen is not None:
            return popen.wait()
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status)

    def _report(self, pid: int, code: int | None) -> None:
        try:
            self._on_exit(pid, code)
        except Exception:  # the watcher must outlive a failing callback
            log.exception("exit_callback_failed", pid=pid)

    def _run(self) -> None:
        while not self._stopping:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                for fd in self._fds:
                    poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    entry = self._fds.pop(fd, None)
                if entry is None:
                    continue
                os.close(fd)
                self._report(entry[0], self._reap(*entry))


class SignalPauser:
    """Pauses a client with SIGSTOP/SIGCONT of its process group (the fallback without cgroup v2).

    A detached client leads its own session, so its process group holds its children too; an
    adopted foreground client shares its shell's process group, so only its own pid is signalled.
    """

    mechanism = PauseMechanism.SIGNAL

    def __init__(self) -> None:
        self._pids: dict[str, int] = {}

    def attach(self, client_id: str, pid: int) -> None:
        """Remember the client's process."""
        self._pids[client_id] = pid

    def _signal(self, client_id: str, sig: int) -> None:
        pid = self._pids.get(client_id)
        if pid is None:
            return
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def freeze(self, client_id: str) -> None:
        """SIGSTOP the client."""
        self._signal(client_id, signal.SIGSTOP)

    def thaw(self, client_id: str) -> None:
        """SIGCONT the client."""
        self._signal(client_id, signal.SIGCONT)

    def kill(self, client_id: str) -> None:
        """SIGKILL the client."""
        self._signal(client_id, signal.SIGKILL)

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's pid while it lives."""
        pid = self._pids.get(client_id)
        return [pid] if pid is not None and psutil.pid_exists(pid) else []

    def release(self, client_id: str) -> None:
        """Forget the client."""
        self._pids.pop(client_id, None)


def make_pauser(base: Path | None = None) -> PauserChoice:
    """The pauser for this node: here always the signal fallback (no cgroup code in the shim)."""
    return PauserChoice(SignalPauser(), "SIGSTOP/SIGCONT of process groups")


def default_base_dir(mount: Path | None = None) -> Path | None:
    """Where client cgroups go by default: none without the cgroup module."""
    return None


def move_self_to_leaf(base: Path, leaf: str = "daemon") -> Path | None:
    """Move the daemon into its cgroup leaf: nothing to do without the cgroup module."""
    return None


def notify(*fields: str) -> bool:
    """Send KEY=VALUE fields to systemd in one datagram; False when there is no systemd socket."""
    target = os.environ.get("NOTIFY_SOCKET", "")
    if target.startswith("@"):
        target = "\0" + target[1:]
    elif not target.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), target)
    except OSError as exc:
        log.warning("sd_notify_failed", error=str(exc))
        return False
    return True


def watchdog_period_s() -> float | None:
    """Half of WatchdogSec= when the watchdog is meant for this process, else None."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
