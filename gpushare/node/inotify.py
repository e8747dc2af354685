"""Whether files were written since the last look: inotify(7), through libc.

The daemon's registry asks SQLite whether another connection committed only after a write reached
the database's files (``gpushare.daemon.registry``); this module is the one place that talks to
inotify. Where it is not available every look answers "written", which costs the caller a query,
never a missed write.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import weakref
from pathlib import Path

__all__ = ["WriteWatch"]

# inotify(7): the events that say a file was written or is no longer the watched one.
_IN_MODIFY, _IN_ATTRIB, _IN_MOVE_SELF, _IN_DELETE_SELF = 0x2, 0x4, 0x800, 0x400
_IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


class WriteWatch:
    """Whether any process wrote the database's files since the last look (inotify).

    In WAL mode every commit, by any connection of any process, writes frames to the ``-wal``
    file before it returns, and each write queues an ``IN_MODIFY`` here. A look finds the queue
    empty only when nothing was written since the previous look drained it; the registry then
    skips ``PRAGMA data_version``, which it asks after the drain otherwise (a commit after the
    drain queues an event for the next look). Where a file cannot be watched (no inotify, not
    there yet, the watch ended) the answer is "written", and every look asks SQLite, as before.
    """

    def __init__(self, paths: tuple[Path, ...]) -> None:
        self._paths = paths
        self._wds: dict[Path, int] = {}
        self._fd = -1
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._fd = int(self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        except (OSError, AttributeError):
            self._fd = -1
        # A registry dropped without close() must not keep its inotify instance (128 per user).
        self._closer = weakref.finalize(self, os.close, self._fd) if self._fd >= 0 else None
        # Asked first: a poll that finds nothing costs a fifth of a read that fails with EAGAIN
        # (an exception) on a tick's cold caches.
        self._poll = select.poll()
        if self._fd >= 0:
            self._poll.register(self._fd, select.POLLIN)

    def written(self) -> bool:
        """Whether a write may have reached the files since the last call (True: look)."""
        if self._fd < 0:
            return True
        fresh = False
        for path in self._paths:
            if path not in self._wds:
                mask = _IN_MODIFY | _IN_ATTRIB | _IN_MOVE_SELF | _IN_DELETE_SELF
                wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))
                if wd < 0:
                    return True  # not there yet (the -wal before the first write): look
                self._wds[path] = wd
                fresh = True  # written before the watch began, for all we know
        if not self._poll.poll(0):
            return fresh
        any_event = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return fresh or any_event
            any_event = True
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, at)
                at += _EVENT.size + size
                if mask & (_IN_IGNORED | _IN_MOVE_SELF | _IN_DELETE_SELF):
                    # That file is gone or replaced: watch whatever has its name at the next look.
                    self._wds = {p: w for p, w in self._wds.items() if w != wd}

    def close(self) -> None:
        """Stop watching."""
        if self._closer is not None:
            self._closer()
        self._fd = -1
