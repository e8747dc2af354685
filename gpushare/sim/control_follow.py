"""Simulated jobs that follow the daemon's control file (``gpushare daemon --simulate``, issue 32).

On a host the in-flight library of a live ``--queue auto`` client reads its GPU's control file
(``GPUSHARE_INFLIGHT_CONTROL``, 4 bytes little-endian, 0 = unbounded) at every launch, so the bound
follows request gating without a restart (:mod:`gpushare.daemon.inflight_control`). The real-time
simulated node gives each such client a simulated twin; :class:`ControlFollower` is what makes
the twin read the same file: the twin of a process launched with the library preloaded and a
control path follows that file, and the node reads it each time it advances
(:meth:`gpushare.sim.realtime.RealTimeSimNode.advance`), so a rewrite reaches the twin within the
node's next advance (a tick at most), as the library sees it at its next launch.

The path is in the process's environment, which its owner controls, and the daemon is root: only
the daemon's own file for the twin's GPU is followed (``[paths] runtime_dir``/inflight), opened
``O_NOFOLLOW`` and non-blocking, and only a regular file owned by the daemon's user is read.
Anything else leaves the twin with the bound its variables say, as before.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpushare import native
from gpushare.daemon.inflight_control import control_path

log = structlog.get_logger("gpushare.sim")


class ControlFollower:
    """Which simulated clients follow which control file, and the bound each last got."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: Following clients: their control path.
        self._path: dict[str, str] = {}
        #: The bound each following client was last given.
        self._given: dict[str, int] = {}
        #: Each followed file's clients, and the bound last read from it: an advance reads each
        #: file once and looks at its clients only when the file changed (8 x 200 at idle).
        self._clients: dict[str, dict[str, None]] = {}  # insertion-ordered, as before
        self._read_bound: dict[str, int] = {}
        self._fds: dict[str, int] = {}

    @property
    def following(self) -> bool:
        """Whether any client follows a file (the node's advance reads nothing otherwise)."""
        return bool(self._path)

    def follow(self, client_id: str, gpu_uuid: str, env: Mapping[str, str]) -> int | None:
        """Follow the file ``env`` names, if it is the daemon's for ``gpu_uuid``: its bound now.

        ``None``: not followed (no library preloaded, no control path, another file, unreadable).
        """
        raw = env.get(native.CONTROL_ENV, "")
        preload = env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
        if not raw or not any(e.rsplit("/", 1)[-1] == native.LIBRARY_NAME for e in preload):
            return None
        path = str(control_path(self.directory, gpu_uuid))
        if os.path.normpath(raw) != path:
            log.info("sim_control_file_not_followed", client_id=client_id, path=raw[:200])
            return None
        bound = self._read(path)
        if bound is None:
            return None
        self._path[client_id] = path
        self._given[client_id] = bound
        self._clients.setdefault(path, {})[client_id] = None
        log.info("sim_control_file_followed", client_id=client_id, path=path, bound=bound)
        return bound

    def forget(self, client_id: str) -> None:
        """The client is gone: stop reading its file (closed once nobody follows it)."""
        path = self._path.pop(client_id, None)
        self._given.pop(client_id, None)
        if path is None:
            return
        clients = self._clients.get(path, {})
        clients.pop(client_id, None)
        if not clients:
            self._clients.pop(path, None)
            self._read_bound.pop(path, None)
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)

    def changed(self) -> list[tuple[str, int]]:
        """The following clients whose file holds another bound than they were given, and it."""
        out = []
        for path, clients in self._clients.items():
            bound = self._read(path)
            if bound is None or bound == self._read_bound.get(path):
                continue
            self._read_bound[path] = bound
            for cid in clients:
                if bound != self._given.get(cid):
                    self._given[cid] = bound
                    out.append((cid, bound))
        return out

    def close(self) -> None:
        """Close every file."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _read(self, path: str) -> int | None:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._open(path)
            if fd is None:
                return None
            self._fds[path] = fd
        try:
            data = os.pread(fd, 4, 0)
        except OSError:
            return None
        if len(data) < 4:
            return None
        return max(0, int(struct.unpack("<i", data)[0]))

    @staticmethod
    def _open(path: str) -> int | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.info("sim_control_file_unreadable", path=path, error=exc.strerror)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            log.info("sim_control_file_not_followed", path=path, why="not the daemon's file")
            return None
        return fd
