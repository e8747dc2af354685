"""Each client's pids, tracked on change of its cgroup instead of read every tick.

The control loop asks every tick for each client's processes
(:meth:`~gpushare.node.cgroups.pauser.CgroupPauser.pids`); walking every cgroup each time cost the
daemon a third of its CPU. The pids are tracked on change instead: the kernel reports each change
of a client's ``cgroup.events`` (its last process gone, its first one in) through one epoll set,
which empties or refreshes that client's list at once; a fork or an exit that leaves others behind
changes no cgroup file, so each list is also re-read every ``pids_rescan_s``. Killing and
releasing always read the cgroup itself. Without cgroups,
:class:`~gpushare.node.signal_pauser.SignalPauser` finds a group's members by reading every
process's ``/proc/PID/stat``; one such pass serves every client, at most every ``pids_rescan_s``.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpushare.node.cgroups.files import walk_pids


class PidTracker:
    """Each client's pid list, re-read when its ``cgroup.events`` changes or it gets too old.

    One epoll set holds an open ``cgroup.events`` per tracked client; the kernel marks it ready
    (EPOLLPRI) when ``populated`` or ``frozen`` changes, and a read re-arms it. A look at the set
    costs one ``epoll_wait`` however many clients there are. Every re-read is due again after a
    random 0.5-1.5 ``rescan_s``, so the re-reads of clients attached together spread out.
    """

    def __init__(self, rescan_s: float) -> None:
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._fds: dict[str, int] = {}
        self._by_fd: dict[int, str] = {}
        self._pids: dict[str, tuple[int, ...]] = {}
        self._due: dict[str, float] = {}
        self._drain_at = 0.0

    def pids(self, client_id: str, path_of: Callable[[str], Path]) -> list[int]:
        """The client's pids, re-read from ``path_of(client_id)`` when changed or due."""
        with self._lock:
            now = time.monotonic()
            if now >= self._drain_at:
                # Once per millisecond is at once for a loop that ticks every 100 ms, and a tick
                # asking for every client pays one epoll_wait instead of one per client.
                self._drain_at = now + 0.001
                self._drain()
            known = self._pids.get(client_id)
            if known is None or now >= self._due.get(client_id, 0.0):
                path = path_of(client_id)
                self._watch(client_id, path)
                known = tuple(sorted(walk_pids(path)))
                if not known and not path.is_dir():
                    self._unwatch(client_id)  # removed under us: stop watching its old file
                self._pids[client_id] = known
                self._due[client_id] = now + self.rescan_s * (0.5 + random.random())
            return list(known)

    def invalidate(self, client_id: str) -> None:
        """Make the next :meth:`pids` of the client read its cgroup."""
        with self._lock:
            self._due.pop(client_id, None)

    def forget(self, client_id: str) -> None:
        """Drop the client's list and stop watching its ``cgroup.events``."""
        with self._lock:
            self._pids.pop(client_id, None)
            self._due.pop(client_id, None)
            self._unwatch(client_id)

    def close(self) -> None:
        """Close every watched file and the epoll set."""
        with self._lock:
            for client_id in list(self._fds):
                self._unwatch(client_id)
            if self._epoll is not None:
                self._epoll.close()
                self._epoll = None

    def __del__(self) -> None:
        # Raw descriptors are not closed by the garbage collector; a pauser dropped without
        # close() (tests make many) must not leak them.
        with contextlib.suppress(Exception):
            self.close()

    def _unwatch(self, client_id: str) -> None:
        fd = self._fds.pop(client_id, None)
        if fd is None:
            return
        self._by_fd.pop(fd, None)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        os.close(fd)

    def _watch(self, client_id: str, path: Path) -> None:
        if client_id in self._fds:
            return
        try:
            fd = os.open(path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # no cgroup (yet): re-read at the next rescan, as before tracking
        if self._epoll is None:
            self._epoll = select.epoll()
        # A file just opened reads as changed until its first read; read it before the walk
        # that follows, so a change after this read is reported and none is lost.
        with contextlib.suppress(OSError):
            os.pread(fd, 4096, 0)
        self._epoll.register(fd, select.EPOLLPRI | select.EPOLLERR)
        self._fds[client_id] = fd
        self._by_fd[fd] = client_id

    def _drain(self) -> None:
        if self._epoll is None or not self._fds:
            return
        for fd, _ in self._epoll.poll(0):
            client_id = self._by_fd.get(fd)
            if client_id is None:
                continue
            with contextlib.suppress(OSError):
                os.pread(fd, 4096, 0)  # re-arms the notification
            self._due.pop(client_id, None)
