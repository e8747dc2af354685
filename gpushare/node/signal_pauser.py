"""The pauser where no writable cgroup v2 exists: SIGSTOP and SIGCONT of a client's process group.

:func:`gpushare.node.cgroups.choice.make_pauser` picks it and says why. A stopped process issues no new GPU
work, like a frozen cgroup, but a process that leaves its group (``setsid``) escapes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from gpushare.model import PauseMechanism
from gpushare.node.pauser_base import (
    DEFAULT_PIDS_RESCAN_S,
    DEFAULT_SIGNAL_WAIT_S,
    FreezeTimeoutError,
    PauserError,
    check_client_id,
    check_pid,
)
from gpushare.node.pauser_defaults import PauserDefaults
from gpushare.node.procs.identity import group_members, groups_members, is_stopped

if TYPE_CHECKING:
    from gpushare.node.base import NodePauser

log = structlog.get_logger(__name__)


class SignalPauser(PauserDefaults):
    """SIGSTOP/SIGCONT of each client's process group (a ``NodePauser``).

    The fallback where no writable cgroup v2 exists. Weaker than the freezer: a process that leaves
    its group (``setsid``) escapes, and a stopped process is visible as state ``T`` and can be
    continued by its owner. Never signals the daemon's own process group. Adoption is the null
    one (the process's group is attached); :class:`~gpushare.node.adopted.AdoptingPauser` adds
    the real one.

    Args:
        wait_s: how long :meth:`freeze` waits for every member to show state ``T``.
        pids_rescan_s: how old the member lists :meth:`pids` returns may be. Finding a group's
            members reads every process's ``/proc/PID/stat``; one pass serves every client, and
            it is repeated at most this often (the loop asks every tick; module doc).
    """

    mechanism: PauseMechanism = PauseMechanism.SIGNAL
    #: :meth:`request_frozen` only sends the signal (``BatchPauser.request_waits``).
    request_waits = False

    def __init__(
        self, *, wait_s: float = DEFAULT_SIGNAL_WAIT_S, pids_rescan_s: float = DEFAULT_PIDS_RESCAN_S
    ) -> None:
        self.wait_s = wait_s
        self.pids_rescan_s = pids_rescan_s
        self._groups: dict[str, int] = {}
        self._members: dict[int, list[int]] = {}
        self._members_due = 0.0

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Remember ``pid``'s process group as the client's (also for re-adoption).

        Args:
            client_id: the client.
            pid: its main process (normally its group leader: spawn starts a new session).
            owner_uid: when given, the process must belong to this uid.

        Raises:
            PauserError: the process is gone, is the daemon or init, belongs to another uid, or
                shares the daemon's own process group.
        """
        check_client_id(client_id)
        check_pid(pid, owner_uid)
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError as exc:
            raise PauserError(f"cannot attach pid {pid} to {client_id}: no such process") from exc
        if pgid == os.getpgrp():
            # Stopping that group would stop the daemon itself.
            raise PauserError(
                f"pid {pid} is in the daemon's own process group {pgid}: "
                "start clients in a new session (spawn(..., new_session=True))"
            )
        self._groups[client_id] = pgid
        self._members_due = 0.0  # a new group: the next pids() reads /proc again
        log.debug("signal_attached", client_id=client_id, pid=pid, pgid=pgid)

    def open_procs_fd(self, client_id: str) -> int | None:
        """No cgroup to join before exec with signals: ``None`` (the client id is still checked)."""
        check_client_id(client_id)
        return None

    def _pgid(self, client_id: str) -> int:
        try:
            return self._groups[client_id]
        except KeyError:
            raise PauserError(f"client {client_id} is not attached: attach it first") from None

    def _signal(self, client_id: str, sig: signal.Signals) -> bool:
        try:
            os.killpg(self._pgid(client_id), sig)
        except ProcessLookupError:
            return False
        return True

    def freeze(self, client_id: str) -> None:
        """SIGSTOP the client's group and wait until every member is stopped.

        Raises:
            FreezeTimeoutError: a member is not stopped after ``wait_s``.
            PauserError: the client is not attached.
        """
        if not self._signal(client_id, signal.SIGSTOP):
            return
        pgid = self._pgid(client_id)
        deadline = time.monotonic() + self.wait_s
        while not all(is_stopped(pid) for pid in group_members(pgid)):
            if time.monotonic() >= deadline:
                raise FreezeTimeoutError(f"process group {pgid} not stopped after {self.wait_s} s")
            time.sleep(0.001)
        log.debug("signal_frozen", client_id=client_id, pgid=pgid)

    def freeze_many(self, client_ids: Sequence[str]) -> None:
        """SIGSTOP several clients' groups, then wait for all (see ``CgroupPauser.freeze_many``).

        Raises:
            FreezeTimeoutError: some group was not stopped in time.
            PauserError: some client is not attached.
        """
        pgids = [self._pgid(client_id) for client_id in client_ids]
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGSTOP)
        deadline = time.monotonic() + self.wait_s
        for pgid in pgids:
            while not all(is_stopped(pid) for pid in group_members(pgid)):
                if time.monotonic() >= deadline:
                    raise FreezeTimeoutError(
                        f"process group {pgid} not stopped after {self.wait_s} s"
                    )
                time.sleep(0.001)

    def request_frozen(self, client_ids: Sequence[str], frozen: bool) -> list[str]:
        """SIGSTOP (or SIGCONT) each client's group without waiting (see the cgroup pauser's).

        Returns:
            The clients not attached or whose group is gone.
        """
        sig = signal.SIGSTOP if frozen else signal.SIGCONT
        failed: list[str] = []
        for client_id in client_ids:
            pgid = self._groups.get(client_id)
            if pgid is None:
                failed.append(client_id)
                continue
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                failed.append(client_id)
        return failed

    def thaw_many(self, client_ids: Sequence[str]) -> None:
        """SIGCONT several clients' process groups.

        Raises:
            PauserError: some client is not attached.
        """
        for client_id in client_ids:
            self._signal(client_id, signal.SIGCONT)

    def thaw(self, client_id: str) -> None:
        """SIGCONT the client's process group.

        Raises:
            PauserError: the client is not attached.
        """
        self._signal(client_id, signal.SIGCONT)
        log.debug("signal_thawed", client_id=client_id)

    def kill(self, client_id: str) -> None:
        """SIGKILL the client's process group (a stopped process dies too).

        Raises:
            PauserError: the client is not attached.
        """
        self._signal(client_id, signal.SIGKILL)
        self._members_due = 0.0
        log.info("signal_killed", client_id=client_id)

    def is_frozen(self, client_id: str) -> bool:
        """Whether every live member of the client's group is stopped (``False`` if none)."""
        pgid = self._groups.get(client_id)
        if pgid is None:
            return False
        members = group_members(pgid)
        return bool(members) and all(is_stopped(pid) for pid in members)

    def pids(self, client_id: str) -> Sequence[int]:
        """Live members of the client's process group (empty when not attached).

        As of the last pass over /proc, at most ``pids_rescan_s`` old (one pass for every client).
        """
        pgid = self._groups.get(client_id)
        if pgid is None:
            return []
        now = time.monotonic()
        if now >= self._members_due or pgid not in self._members:
            self._members = groups_members(set(self._groups.values()))
            self._members_due = now + self.pids_rescan_s
        return list(self._members.get(pgid, ()))

    def members(self, client_id: str) -> list[int]:
        """Live members of the client's process group now, from /proc (for signalling them)."""
        pgid = self._groups.get(client_id)
        return [] if pgid is None else group_members(pgid)

    def owner_of(self, pid: int) -> str | None:
        """Cannot tell from a pid alone (a group is not a cgroup): ``None``."""
        return None

    def release(self, client_id: str) -> None:
        """Forget the client."""
        self._groups.pop(client_id, None)

    def clients(self) -> dict[str, list[int]]:
        """Attached clients and their live processes (empty after a daemon restart)."""
        return {cid: group_members(pgid) for cid, pgid in sorted(self._groups.items())}


if TYPE_CHECKING:  # the adapter implements the Protocols the daemon holds it by

    def _conforms(p: SignalPauser) -> NodePauser:
        return p
