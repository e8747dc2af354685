"""Who a pid is (start time, uid, command), its descendants and group, and whether it is stopped.

:func:`process_start_time` and :func:`is_same_process` tell a live client from a recycled pid when
the daemon re-adopts clients after a restart (docs/design.md D6). The pausers ask for a process's
descendants, the members of a process group, and whether a process is stopped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import psutil

# psutil's create_time comes from /proc/<pid>/stat start ticks (10 ms on Linux) plus the boot
# time; allow a little more than one tick so that two readings of one process always match.
START_TIME_TOLERANCE_S = 0.02


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
        stat = stat_fields(int(entry.name))
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
    stat = stat_fields(pid)
    # T: stopped by a signal, t: stopped under a tracer; Z/X: finished.
    return stat is None or stat[0] in ("T", "t", "Z", "X")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``comm`` (state first); ``None`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses; everything after the last ")" is well-formed.
    end = raw.rfind(")")
    return raw[end + 2 :].split() if end >= 0 else None
