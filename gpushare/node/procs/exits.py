"""Exit noticing: :class:`ExitWatcher` reports each watched process's exit once, on its own thread.

Processes are held by pidfds (``poll``, no busy loop): children report their exit code, adopted
non-children report ``None`` (unknowable).
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog

from gpushare.node.procs.identity import is_same_process, stat_fields

log = structlog.get_logger(__name__)


class Exit(NamedTuple):
    """One exit noticed by :class:`ExitWatcher`.

    ``exit_code`` follows ``Popen.returncode``: the status for a normal exit, ``-N`` for death by
    signal N, and ``None`` when it is unknown: the process was not our child and its parent reaped
    it before we could read its status.
    """

    pid: int
    exit_code: int | None


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
        #: Times the watching loop failed and was run again, and the last failure's type.
        self.restarts = 0
        self.last_error: str | None = None

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

    def health(self) -> tuple[bool, int, str | None]:
        """The watcher thread's ``(alive, restarts, last_error)``."""
        return self._thread.is_alive(), self.restarts, self.last_error

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._watch()
            except Exception as exc:  # exits unreported would leave clients "running" for good
                self.restarts += 1
                self.last_error = type(exc).__name__
                log.exception("exit_watcher_failed", restarts=self.restarts)
                time.sleep(min(5.0, 0.01 * 2 ** min(self.restarts, 9)))

    def _watch(self) -> None:
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
    stat = stat_fields(pid)
    # Index 0 is field 3 (state), so field 52 (exit_code) is index 49.
    if stat is None or stat[0] != "Z" or len(stat) < 50:
        return None
    return os.waitstatus_to_exitcode(int(stat[49]))


def _is_child(pid: int) -> bool:
    stat = stat_fields(pid)
    return stat is not None and int(stat[1]) == os.getpid()
