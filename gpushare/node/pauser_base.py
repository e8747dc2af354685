"""What both pausers share: their errors, their defaults, and the checks on what they are given.

:mod:`gpushare.node.cgroups` (the cgroup v2 freezer) and :mod:`gpushare.node.signal_pauser`
(SIGSTOP/SIGCONT where there is no writable cgroup v2) both raise these errors and check pids and
client ids the same way.
"""

from __future__ import annotations

import os
import re

from gpushare.node.procs.identity import process_uid

DEFAULT_SIGNAL_WAIT_S = 1.0
# How stale a client's pid list may get when only a fork or a partial exit changed it. Those pids
# attribute GPU memory to clients and find the client of a latency report; both look at seconds,
# not ticks (the controller settles over control.quiet_settle = 1 s, shares move every 60 s).
DEFAULT_PIDS_RESCAN_S = 2.0

_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class PauserError(RuntimeError):
    """A pause, thaw, kill, attach or release could not be done; the message says why."""


class FreezeTimeoutError(PauserError):
    """``cgroup.events`` did not reach the wanted ``frozen`` value before the deadline.

    The request stays written: the kernel finishes a freeze once the last task leaves the kernel
    (a task blocked in a driver call freezes late). :meth:`CgroupPauser.thaw` cancels it.
    """


def check_pid(pid: int, owner_uid: int | None) -> None:
    """Refuse init, the daemon itself, and (with ``owner_uid``) another user's process.

    Raises:
        PauserError: the pid may not be put under a client.
    """
    if pid <= 1 or pid == os.getpid():
        raise PauserError(f"refusing to put pid {pid} under a client: it is init or the daemon")
    if owner_uid is not None:
        actual = process_uid(pid)
        if actual is None:
            raise PauserError(f"cannot attach pid {pid}: no such process")
        if actual != owner_uid:
            raise PauserError(
                f"pid {pid} belongs to uid {actual}, not to the client's owner uid {owner_uid}"
            )


def check_client_id(client_id: str) -> str:
    """Return ``client_id`` when it is usable as a cgroup name part, else raise.

    Raises:
        ValueError: the id is empty, too long or has characters other than ``A-Za-z0-9_.-``.
    """
    if not _CLIENT_ID_RE.match(client_id):
        raise ValueError(
            f"client id {client_id!r} cannot name a cgroup: use 1-128 characters from "
            "A-Z a-z 0-9 _ . - starting with a letter or digit"
        )
    return client_id
