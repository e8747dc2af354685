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

import structlog

from gpushare.model import PauseMechanism

log = structlog.get_logger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_SCRUBBED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22).

    None when there is no such process or it is a zombie (it has exited).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def is_same_process(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is alive and is the process that had ``start_time`` (not a reused pid)."""
    return start_time is not None and process_start_time(pid) == start_time


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


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the systemd variables meant for the daemon alone."""
    return {k: v for k, v in env.items() if k not in _SCRUBBED_ENV}


_children: dict[int, subprocess.Popen[bytes]] = {}
_children_lock = threading.Lock()


def spawn(
    argv: Sequence[str],
    *,
    uid: int,
    gid: int,
    cwd: str,
    env: Mapping[str, str],
    log_fd: int,
    groups: Sequence[int] | None = None,
) -> int:
    """Start ``argv`` (no shell) as ``uid``/``gid`` in its own session; stdout/stderr to ``log_fd``.

    Returns the pid. The child is reaped by :class:`ExitWatcher`.

    Raises:
        OSError: the program or ``cwd`` does not exist, or is not accessible.
    """
    switch = uid != os.geteuid() or gid != os.getegid()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=scrub_env(env),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=log_fd,
        start_new_session=True,
        close_fds=True,
        user=uid if switch else None,
        group=gid if switch else None,
        extra_groups=list(groups) if switch and groups is not None else None,
    )
    with _children_lock:
        _children[proc.pid] = proc
    return proc.pid


class ExitWatcher:
    """Reports each watched pid's exit promptly through pidfds: ``on_exit(pid, exit_code)``.

    ``exit_code`` is the wait status as :func:`os.waitstatus_to_exitcode` gives it (negative for
    a signal) for the daemon's own children, and None for processes it only adopted.
    """

    def __init__(self, on_exit: Callable[[int, int | None], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="exit-watcher", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> bool:
        """Start watching ``pid``; False when it is already gone (its exit is reported at once)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._on_exit(pid, self._reap(pid))
            return False
        with self._lock:
            self._fds[fd] = pid
        self._wake()
        return True

    def close(self) -> None:
        """Stop watching everything."""
        self._closed = True
        self._wake()
        self._thread.join(timeout=2.0)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    @staticmethod
    def _reap(pid: int) -> int | None:
        with _children_lock:
            proc = _children.pop(pid, None)
        if proc is None:
            return None
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status)

    def _run(self) -> None:
        while not self._closed:
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
                    pid = self._fds.pop(fd, None)
                os.close(fd)
                if pid is None:
                    continue
                code = self._reap(pid)
                try:
                    self._on_exit(pid, code)
                except Exception:  # the watcher must outlive a failing callback
                    log.exception("exit_callback_failed", pid=pid)


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
        return [pid] if pid is not None and process_start_time(pid) is not None else []

    def release(self, client_id: str) -> None:
        """Forget the client."""
        self._pids.pop(client_id, None)


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
