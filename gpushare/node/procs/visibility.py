"""Whether the host's ``/proc`` shows a user other users' processes (``hidepid``).

``ps`` shows every process's command line to every user unless ``/proc`` is mounted with
``hidepid=1|2|noaccess|invisible`` (or ``subset=pid`` with ``hidepid``); the daemon shows another
user's client no more than ``ps`` would (gpushare/daemon/rights.py). The mount that counts is the
one users see: the host's, read from pid 1's mount namespace (``/proc/1/mountinfo``), not the
daemon's own (a unit's ``ProtectProc=`` changes the daemon's view only).
"""

from __future__ import annotations

import time

_CACHE_S = 30.0  # mount options change rarely; status must not read a file per client
_cached: tuple[float, bool] | None = None
_VISIBLE = ("0", "off")


def hides_others(mountinfo: str | None = None) -> bool:
    """True when the host's ``/proc`` hides other users' processes from unprivileged users.

    Args:
        mountinfo: the text of a ``mountinfo`` file (tests); by default ``/proc/1/mountinfo``,
            read at most every 30 s. Unreadable counts as hiding (the cautious answer).
    """
    global _cached
    if mountinfo is None:
        now = time.monotonic()
        if _cached is not None and now - _cached[0] < _CACHE_S:
            return _cached[1]
        try:
            with open("/proc/1/mountinfo", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = None
        hidden = True if text is None else _parse(text)
        _cached = (now, hidden)
        return hidden
    return _parse(mountinfo)


def _parse(text: str) -> bool:
    hidden = False
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or fields[4] != "/proc" or not rest or rest[0] != "proc":
            continue
        # Per-mount options, then the superblock's (where newer kernels show hidepid). A later
        # line is a mount on top of an earlier one: the last /proc is the one users see.
        options = fields[5].split(",") + (rest[2].split(",") if len(rest) > 2 else [])
        values = [o.partition("=")[2] for o in options if o.startswith("hidepid=")]
        hidden = bool(values) and values[-1] not in _VISIBLE
    return hidden
