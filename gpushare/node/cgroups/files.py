"""cgroupfs files as the kernel wants them read and written.

One ``write()`` per value, keyed files (``cgroup.events``), the pids of a cgroup and every
sub-cgroup it holds, and a wait, with a deadline, for a key of ``cgroup.events`` to reach a value
(freezing and emptying are asynchronous in the kernel). The client pauser, the freeze route of an
adopted process and :mod:`gpushare.node.adopted` all go through these.
"""

from __future__ import annotations

import errno
import math
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path


def write_value(path: Path, text: str) -> None:
    """Write ``text`` to an existing cgroupfs file in one ``write()``."""
    # cgroupfs wants one write() per value; open without O_CREAT so a typo'd path is an error.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_keyed(text: str) -> dict[str, str]:
    """The ``key value`` lines of a keyed cgroupfs file (``cgroup.events``) as a dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value.strip()
    return out


def _read_pids(path: Path | str) -> list[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError as exc:
        if exc.errno == errno.ENODEV:  # the cgroup was removed while open
            return []
        raise
    finally:
        os.close(fd)
    return [int(x) for x in b"".join(chunks).split()]


def walk_pids(path: Path | str) -> Iterator[int]:
    """The pids in the cgroup ``path`` and every sub-cgroup of it (none when it is gone)."""
    try:
        with os.scandir(path) as entries:
            # The directory entry's type (d_type) says which are sub-cgroups: no stat per file.
            subs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    yield from _read_pids(os.path.join(path, "cgroup.procs"))
    for sub in subs:
        yield from walk_pids(sub)


def wait_event(events: Path, key: str, want: str, timeout_s: float) -> bool:
    """Wait until ``key`` in ``cgroup.events`` reads ``want``; False at the deadline.

    The kernel signals every change of the file with POLLPRI|POLLERR; a read re-arms it, so the
    loop reads before each poll. Each poll is capped so that a missed wake-up costs 50 ms, not
    the whole timeout.
    """
    deadline = time.monotonic() + timeout_s
    fd = os.open(events, os.O_RDONLY | os.O_CLOEXEC)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        while True:
            if read_keyed(os.pread(fd, 4096, 0).decode()).get(key) == want:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(math.ceil(min(remaining, 0.05) * 1000))
    finally:
        os.close(fd)
