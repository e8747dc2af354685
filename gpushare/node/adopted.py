"""Pausing adopted processes where they are: their own cgroup's freezer, or SIGSTOP/SIGCONT.

A process gpushare launched sits in a cgroup (or process group) gpushare made for it. A process it
adopted (a systemd service, a container, a Slurm task) does not, and moving it would take it out of
its unit's or container's accounting and limits, so :class:`AdoptingPauser` leaves it where it is:

- **cgroup**: where :func:`gpushare.node.cgroups.route.freeze_route` allows it (the process's own cgroup,
  or a delegated subtree, holding nothing but the process and its descendants) the freezer of that
  cgroup is written, as for a launched client;
- **signal**: otherwise the process and its live descendants get SIGSTOP/SIGCONT (not its process
  group: a Slurm task or a service shares its group with processes that are not the client).

The route is decided when the client is adopted and says why in one line (``status`` shows it).
Launched clients go on to the daemon's own pauser; both sit behind the one ``Pauser`` interface
the daemon uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpushare.model import PauseMechanism
from gpushare.node.base import LaunchPauser, NodePauser

# The cgroup pauser's own helpers: the same checks and cgroupfs writes as for launched clients.
from gpushare.node.cgroups.files import wait_event, walk_pids, write_value
from gpushare.node.cgroups.pauser import DEFAULT_FREEZE_TIMEOUT_S
from gpushare.node.cgroups.route import FreezeRoute, freeze_route
from gpushare.node.pauser_base import (
    DEFAULT_SIGNAL_WAIT_S,
    FreezeTimeoutError,
    PauserError,
    check_client_id,
    check_pid,
)
from gpushare.node.procs.identity import (
    descendants,
    is_same_process,
    is_stopped,
    process_start_time,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Adopted:
    pid: int
    start_time: float | None
    route: FreezeRoute


class AdoptingPauser:
    """The daemon's pauser for launched clients (``inner``) and adopted ones (a ``NodePauser``).

    Args:
        inner: the pauser launched clients use (:func:`gpushare.node.cgroups.choice.make_pauser`).
        mount: the cgroup2 mount (found in ``/proc/self/mounts`` when ``None``).
        freeze_timeout_s: how long a cgroup freeze waits for ``frozen 1``.
        signal_wait_s: how long a SIGSTOP waits for every process to show state ``T``.
    """

    def __init__(
        self,
        inner: LaunchPauser,
        *,
        mount: Path | None = None,
        freeze_timeout_s: float = DEFAULT_FREEZE_TIMEOUT_S,
        signal_wait_s: float = DEFAULT_SIGNAL_WAIT_S,
    ) -> None:
        self.inner = inner
        self.mechanism: PauseMechanism = inner.mechanism
        #: Launched clients are only asked (the inner pauser's request, or a write of
        #: ``cgroup.freeze``/a signal for an adopted one): the gate waits with :meth:`freeze`.
        self.request_waits = False
        self._mount = mount
        self.freeze_timeout_s = freeze_timeout_s
        self.signal_wait_s = signal_wait_s
        self._adopted: dict[str, _Adopted] = {}

    # ------------------------------------------------------------------------- adopted ones

    def adopt(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> FreezeRoute:
        """Take ``pid`` (and its descendants) as client ``client_id`` without moving it.

        Also for re-adoption after a daemon restart: the route is decided again, since the
        process's cgroup may have changed while the daemon was down.

        Raises:
            PauserError: the process is gone, is init or the daemon, or belongs to another uid
                than ``owner_uid``.
        """
        check_client_id(client_id)
        check_pid(pid, owner_uid)
        started = process_start_time(pid)
        if started is None:
            raise PauserError(f"cannot adopt pid {pid}: no such process")
        route = freeze_route(pid, [pid, *descendants(pid)], self._mount)
        self._adopted[client_id] = _Adopted(pid, started, route)
        log.info("pauser_adopted", client_id=client_id, pid=pid, route=route.reason)
        return route

    def route(self, client_id: str) -> FreezeRoute | None:
        """How an adopted client is paused; ``None`` for a launched (or unknown) client."""
        found = self._adopted.get(client_id)
        return found.route if found is not None else None

    def mechanism_of(self, client_id: str) -> PauseMechanism:
        """The mechanism that pauses this client (the inner pauser's for a launched one)."""
        found = self._adopted.get(client_id)
        return found.route.mechanism if found is not None else self.inner.mechanism

    def _members(self, a: _Adopted) -> list[int]:
        if a.route.cgroup is not None:
            return sorted(set(walk_pids(a.route.cgroup)))
        if not is_same_process(a.pid, a.start_time):
            return []
        return [a.pid, *descendants(a.pid)]

    def _freeze_adopted(self, client_id: str, a: _Adopted) -> None:
        if a.route.cgroup is not None:
            self._write_freeze(a.route.cgroup, frozen=True)
            return
        members = self._members(a)
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + self.signal_wait_s
        while not all(is_stopped(pid) for pid in members):
            if time.monotonic() >= deadline:
                raise FreezeTimeoutError(
                    f"client {client_id}: pid {a.pid} and its children not stopped after "
                    f"{self.signal_wait_s} s"
                )
            time.sleep(0.001)

    def _thaw_adopted(self, a: _Adopted) -> None:
        if a.route.cgroup is not None:
            self._write_freeze(a.route.cgroup, frozen=False)
            return
        for pid in self._members(a):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _write_freeze(self, path: Path, *, frozen: bool) -> None:
        try:
            write_value(path / "cgroup.freeze", "1" if frozen else "0")
        except FileNotFoundError:
            return  # the unit or container is gone with its processes
        except OSError as exc:
            raise PauserError(f"cannot write {path}/cgroup.freeze: {exc.strerror or exc}") from exc
        want = "1" if frozen else "0"
        try:
            reached = wait_event(path / "cgroup.events", "frozen", want, self.freeze_timeout_s)
        except FileNotFoundError:
            return
        if not reached:
            raise FreezeTimeoutError(
                f"{path} not {'frozen' if frozen else 'thawed'} after {self.freeze_timeout_s} s"
            )

    # ------------------------------------------------------------------------- Pauser

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """A launched client joins the inner pauser; an adopted one is taken again where it is."""
        if client_id in self._adopted:
            self.adopt(client_id, pid, owner_uid=owner_uid)
        else:
            self.inner.attach(client_id, pid, owner_uid=owner_uid)

    def open_procs_fd(self, client_id: str) -> int | None:
        """The inner pauser's pre-exec cgroup handle for a client about to be launched."""
        return self.inner.open_procs_fd(client_id)

    def freeze(self, client_id: str) -> None:
        """Stop the client's processes (its own cgroup's freezer or SIGSTOP for an adopted one)."""
        found = self._adopted.get(client_id)
        if found is None:
            self.inner.freeze(client_id)
        else:
            self._freeze_adopted(client_id, found)

    def thaw(self, client_id: str) -> None:
        """Let the client's processes run again."""
        found = self._adopted.get(client_id)
        if found is None:
            self.inner.thaw(client_id)
        else:
            self._thaw_adopted(found)

    def freeze_many(self, client_ids: Sequence[str]) -> None:
        """Freeze several clients: the launched ones together (the inner pauser's way), then each adopted one."""
        launched = [c for c in client_ids if c not in self._adopted]
        self.inner.freeze_many(launched)
        for client_id in client_ids:
            if client_id in self._adopted:
                self._freeze_adopted(client_id, self._adopted[client_id])

    def thaw_many(self, client_ids: Sequence[str]) -> None:
        """Thaw several clients."""
        launched = [c for c in client_ids if c not in self._adopted]
        self.inner.thaw_many(launched)
        for client_id in client_ids:
            if client_id in self._adopted:
                self._thaw_adopted(self._adopted[client_id])

    def request_frozen(self, client_ids: Sequence[str], frozen: bool) -> list[str]:
        """Ask for each client to be frozen (or thawed) without waiting (request gating's path).

        Launched clients through the inner pauser's ``request_frozen`` (which waits where the
        inner pauser cannot only ask); an adopted one by a write of its cgroup's ``cgroup.freeze`` or a
        SIGSTOP/SIGCONT of its processes, as :meth:`freeze` does but without the wait.

        Returns:
            The clients that could not be asked (gone, or never attached).
        """
        failed: list[str] = []
        launched = [c for c in client_ids if c not in self._adopted]
        failed += self.inner.request_frozen(launched, frozen)
        for client_id in client_ids:
            found = self._adopted.get(client_id)
            if found is None:
                continue
            if found.route.cgroup is not None:
                try:
                    write_value(found.route.cgroup / "cgroup.freeze", "1" if frozen else "0")
                except OSError:
                    failed.append(client_id)
                continue
            sig = signal.SIGSTOP if frozen else signal.SIGCONT
            for pid in self._members(found):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        return failed

    def is_frozen(self, client_id: str) -> bool:
        """Whether every process of the client is stopped (``False`` when it has none)."""
        found = self._adopted.get(client_id)
        if found is None:
            return self.inner.is_frozen(client_id)
        if found.route.cgroup is not None:
            try:
                events = (found.route.cgroup / "cgroup.events").read_text()
            except FileNotFoundError:
                return False
            return "frozen 1" in events.splitlines()
        members = self._members(found)
        return bool(members) and all(is_stopped(pid) for pid in members)

    def kill(self, client_id: str) -> None:
        """SIGKILL every process of the client (an adopted one's cgroup is not removed: not ours)."""
        found = self._adopted.get(client_id)
        if found is None:
            self.inner.kill(client_id)
            return
        for pid in self._members(found):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # A frozen process dies only once it runs again.
        self._thaw_adopted(found)
        log.info("adopted_killed", client_id=client_id, pid=found.pid)

    def pids(self, client_id: str) -> Sequence[int]:
        """The client's live processes."""
        found = self._adopted.get(client_id)
        return self.inner.pids(client_id) if found is None else self._members(found)

    def members(self, client_id: str) -> Sequence[int]:
        """The client's processes read now (``inner.pids`` may lag a fork; node/cgroups/pid_tracker.py)."""
        found = self._adopted.get(client_id)
        if found is not None:
            return self._members(found)
        return list(self.inner.members(client_id))

    def owner_of(self, pid: int) -> str | None:
        """The launched client whose cgroup holds ``pid``, where the inner pauser can tell."""
        return self.inner.owner_of(pid)

    def release(self, client_id: str) -> None:
        """Forget the client; an adopted one is thawed first (released, never left frozen)."""
        found = self._adopted.pop(client_id, None)
        if found is None:
            self.inner.release(client_id)
            return
        with contextlib.suppress(PauserError):
            self._thaw_adopted(found)

    def clients(self) -> dict[str, list[int]]:
        """Every client (launched and adopted) and its live processes."""
        out: dict[str, list[int]] = dict(self.inner.clients())
        out.update({cid: self._members(a) for cid, a in self._adopted.items()})
        return dict(sorted(out.items()))


if TYPE_CHECKING:  # the adapter implements the Protocols the daemon holds it by

    def _conforms(p: AdoptingPauser) -> NodePauser:
        return p
