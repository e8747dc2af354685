"""The cgroup v2 freezer over one leaf cgroup per client: attach, freeze, thaw, kill, release.

Freezing is asynchronous in the kernel: :meth:`CgroupPauser.freeze` and :meth:`CgroupPauser.thaw`
write ``cgroup.freeze`` and then wait, with a deadline, for ``cgroup.events`` to say
``frozen 1``/``frozen 0`` (woken by ``poll`` on the events file). Each client's pids are tracked on
change (:mod:`gpushare.node.cgroups.pid_tracker`).

Limit (docs/design.md §2): a frozen client issues no new GPU work, but kernels it already queued still run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpushare.model import PauseMechanism
from gpushare.node.cgroups.discovery import cgroup2_mount, is_within, own_cgroup_path
from gpushare.node.cgroups.files import read_keyed, wait_event, walk_pids, write_value
from gpushare.node.cgroups.pid_tracker import PidTracker
from gpushare.node.pauser_base import (
    DEFAULT_PIDS_RESCAN_S,
    FreezeTimeoutError,
    PauserError,
    check_client_id,
    check_pid,
)
from gpushare.node.pauser_defaults import PauserDefaults
from gpushare.node.procs.identity import descendants

if TYPE_CHECKING:
    from gpushare.node.base import NodePauser

log = structlog.get_logger(__name__)

CLIENT_PREFIX = "client-"

DEFAULT_FREEZE_TIMEOUT_S = 1.0
DEFAULT_KILL_TIMEOUT_S = 2.0

# Each round moves what the previous one missed; a workload forking faster than that is pathological.
_SWEEP_ROUNDS = 5


class CgroupPauser(PauserDefaults):
    """The cgroup v2 freezer over ``<base>/client-<id>/`` leaves (a ``NodePauser``).

    Every capability but adoption is its own; adoption is the null one (an adopted process is
    attached, i.e. moved into a client cgroup): the daemon wraps it in
    :class:`~gpushare.node.adopted.AdoptingPauser`, which pauses a process where it is.

    Args:
        base: the daemon's subtree; created (one level) if missing.
        freeze_timeout_s: how long :meth:`freeze`/:meth:`thaw` wait for ``cgroup.events``.
        kill_timeout_s: how long :meth:`kill` waits for the cgroup to empty.
        pids_rescan_s: how old a pid list :meth:`pids` may return when the kernel reported no
            change of the cgroup (see the module doc).

    Raises:
        PauserError: ``base`` cannot be created or is not a cgroup v2 directory.
    """

    mechanism: PauseMechanism = PauseMechanism.CGROUP
    #: :meth:`request_frozen` only writes ``cgroup.freeze`` (``BatchPauser.request_waits``).
    request_waits = False

    def __init__(
        self,
        base: Path,
        *,
        freeze_timeout_s: float = DEFAULT_FREEZE_TIMEOUT_S,
        kill_timeout_s: float = DEFAULT_KILL_TIMEOUT_S,
        pids_rescan_s: float = DEFAULT_PIDS_RESCAN_S,
    ) -> None:
        self.base = base
        self.freeze_timeout_s = freeze_timeout_s
        self.kill_timeout_s = kill_timeout_s
        self._fd_lock = threading.Lock()
        self._freeze_fds: dict[str, int] = {}
        self.pids_rescan_s = pids_rescan_s
        self._tracker = PidTracker(pids_rescan_s)
        self._paths: dict[str, Path] = {}
        # Clients whose cgroup this pauser made (or re-adopted with its recorded process): the
        # only populated cgroups a process is ever put into (_claim).
        self._own: set[str] = set()
        self._base_rel: str | None = None  # the base as /proc/PID/cgroup writes it
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            raise PauserError(
                f"cannot create the client cgroup base {base}: {exc.strerror or exc}"
            ) from exc
        if not (base / "cgroup.procs").exists():
            raise PauserError(f"{base} is not a cgroup v2 directory (no cgroup.procs)")

    def path(self, client_id: str) -> Path:
        """The client's cgroup directory (whether or not it exists yet)."""
        # Asked for every client every tick: the checked id and its Path are kept until release.
        path = self._paths.get(client_id)
        if path is None:
            path = self.base / f"{CLIENT_PREFIX}{check_client_id(client_id)}"
            self._paths[client_id] = path
        return path

    def _existing(self, client_id: str) -> Path:
        path = self.path(client_id)
        if not path.is_dir():
            raise PauserError(f"client {client_id} has no cgroup ({path}): attach it first")
        return path

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        """Move ``pid`` and its descendants into the client's cgroup, creating it.

        Children forked after the move are born inside. A workload can fork between its start
        and this call (a shell wrapper does within a millisecond), so the descendants that exist
        already are moved too, until a scan finds none outside. Idempotent, so it also re-creates
        membership for a re-adopted client after a daemon restart. On failure nothing is left
        behind.

        Args:
            client_id: the client.
            pid: its main process.
            owner_uid: when given, the process must belong to this uid (a pid received from a
                caller must be the caller's own, or freezing and killing would reach others).

        Raises:
            PauserError: the process is gone, is the daemon or init, belongs to another uid, or
                the cgroup cannot be joined.
        """
        path = self.path(client_id)
        check_pid(pid, owner_uid)
        created = not path.is_dir()
        try:
            self._claim(client_id, path, pid)
            write_value(path / "cgroup.procs", str(pid))
        except OSError as exc:
            if created:
                with contextlib.suppress(OSError):
                    path.rmdir()
            if exc.errno == errno.ESRCH:
                raise PauserError(
                    f"cannot attach pid {pid} to {client_id}: no such process"
                ) from exc
            raise PauserError(f"cannot attach pid {pid} to {path}: {exc.strerror or exc}") from exc
        moved = self._sweep_descendants(path, pid)
        self._tracker.invalidate(client_id)
        log.debug("cgroup_attached", client_id=client_id, pid=pid, descendants_moved=moved)

    def open_procs_fd(self, client_id: str) -> int:
        """Create the client's cgroup and open its ``cgroup.procs`` for ``spawning.spawn``.

        A child spawned with this descriptor joins the cgroup before it execs, which closes the
        window in which a workload could fork outside it. The caller closes the descriptor once
        the spawn returned (it is close-on-exec, so the workload never holds it).

        Raises:
            PauserError: the cgroup cannot be created or opened.
        """
        path = self.path(client_id)
        self._tracker.invalidate(client_id)  # the child joins after this returns
        try:
            self._claim(client_id, path)
            return os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PauserError(
                f"cannot open {path / 'cgroup.procs'}: {exc.strerror or exc}"
            ) from exc

    def _claim(self, client_id: str, path: Path, pid: int | None = None) -> None:
        """Make the client's cgroup, or take one that is already this client's.

        A cgroup of that name that this pauser did not make holds processes of no client it
        knows (an earlier client of the same id, before a registry reset): joining it would let
        the new client freeze and kill them. It is refused unless it holds ``pid`` (a re-adopted
        client's own process); an empty one is made anew, so no frozen state carries over.

        Raises:
            PauserError: the cgroup holds processes that are not this client's.
            OSError: it cannot be made.
        """
        try:
            path.mkdir()
        except FileExistsError:
            if client_id not in self._own:
                inside = set(walk_pids(path))
                if inside and (pid is None or pid not in inside):
                    raise PauserError(
                        f"{path} already holds processes {sorted(inside)} that this daemon did "
                        f"not start for {client_id}; not joined (kill them or remove the cgroup)"
                    ) from None
                if not inside:
                    for sub in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
                        _rmdir(sub)
                    _rmdir(path)
                    path.mkdir()
        self._own.add(client_id)

    def _sweep_descendants(self, path: Path, pid: int) -> int:
        moved = 0
        for _ in range(_SWEEP_ROUNDS):
            inside = set(walk_pids(path))
            outside = [kid for kid in descendants(pid) if kid not in inside]
            if not outside:
                break
            for kid in outside:
                try:
                    write_value(path / "cgroup.procs", str(kid))
                    moved += 1
                except ProcessLookupError:
                    continue
                except OSError as exc:
                    log.warning("cgroup_attach_descendant_failed", pid=kid, error=exc.strerror)
        return moved

    def freeze(self, client_id: str) -> None:
        """Freeze the client's cgroup and wait until the kernel reports it frozen.

        Raises:
            FreezeTimeoutError: not frozen within ``freeze_timeout_s`` (the freeze stays requested).
            PauserError: the client has no cgroup.
        """
        self._set_frozen(client_id, True)

    def thaw(self, client_id: str) -> None:
        """Thaw the client's cgroup and wait until the kernel reports it thawed.

        Raises:
            FreezeTimeoutError: still frozen after ``freeze_timeout_s``.
            PauserError: the client has no cgroup.
        """
        self._set_frozen(client_id, False)

    def freeze_many(self, client_ids: Sequence[str]) -> None:
        """Freeze several clients at once: all requests first, then one shared deadline.

        The kernel freezes the cgroups in parallel, so N busy clients cost about one freeze
        latency instead of N (a duty cycle over many offline clients needs that).

        Raises:
            FreezeTimeoutError: some were not frozen in time (named; the others are frozen).
            PauserError: some had no cgroup (named; the others are frozen).
        """
        self._set_frozen_many(client_ids, True)

    def thaw_many(self, client_ids: Sequence[str]) -> None:
        """Thaw several clients at once (see :meth:`freeze_many`).

        Raises:
            FreezeTimeoutError: some were still frozen after the deadline.
            PauserError: some had no cgroup.
        """
        self._set_frozen_many(client_ids, False)

    def request_frozen(self, client_ids: Sequence[str], frozen: bool) -> list[str]:
        """Write ``cgroup.freeze`` of each client and return without waiting for the kernel.

        Request gating's fast path: once the write returns, no task of the cgroup runs user code
        again (the kernel stops each on its way back to user space; one running on another CPU is
        interrupted), so it issues no new GPU work, although ``cgroup.events`` says ``frozen 1``
        only when every task got there. The descriptor of each ``cgroup.freeze`` is kept open
        (one write instead of a path lookup per client), and reopened once if the cgroup was
        made anew.

        Returns:
            The clients whose cgroup could not be written (gone or never attached).
        """
        want = b"1" if frozen else b"0"
        failed: list[str] = []
        with self._fd_lock:
            for client_id in client_ids:
                for attempt in (0, 1):
                    fd = self._freeze_fds.get(client_id)
                    try:
                        if fd is None:
                            fd = os.open(self.path(client_id) / "cgroup.freeze", os.O_WRONLY)
                            self._freeze_fds[client_id] = fd
                        os.pwrite(fd, want, 0)
                        break
                    except (OSError, PauserError):
                        self._close_fd(client_id)
                        if attempt:
                            failed.append(client_id)
        return failed

    def _close_fd(self, client_id: str) -> None:
        fd = self._freeze_fds.pop(client_id, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _set_frozen_many(self, client_ids: Sequence[str], frozen: bool) -> None:
        want = "1" if frozen else "0"
        missing: list[str] = []
        pending: list[tuple[str, Path]] = []
        # Validate every id before touching any cgroup.
        paths = [(client_id, self.path(client_id)) for client_id in client_ids]
        for client_id, path in paths:
            try:
                write_value(path / "cgroup.freeze", want)
            except OSError:
                missing.append(client_id)
                continue
            pending.append((client_id, path))
        deadline = time.monotonic() + self.freeze_timeout_s
        late: list[str] = []
        for client_id, path in pending:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                if not wait_event(path / "cgroup.events", "frozen", want, remaining):
                    late.append(client_id)
            except OSError:
                missing.append(client_id)
        if late:
            raise FreezeTimeoutError(
                f"clients {late} not {'frozen' if frozen else 'thawed'} after "
                f"{self.freeze_timeout_s} s" + (f"; no cgroup for {missing}" if missing else "")
            )
        if missing:
            raise PauserError(f"clients {missing} have no cgroup: attach them first")

    def _set_frozen(self, client_id: str, frozen: bool) -> None:
        path = self._existing(client_id)
        want = "1" if frozen else "0"
        start = time.monotonic()
        try:
            write_value(path / "cgroup.freeze", want)
            done = wait_event(path / "cgroup.events", "frozen", want, self.freeze_timeout_s)
        except OSError as exc:
            # The cgroup vanished under us (released concurrently) or cgroupfs refused.
            raise PauserError(f"cannot set {path / 'cgroup.freeze'} to {want}: {exc}") from exc
        if not done:
            raise FreezeTimeoutError(
                f"{path} not {'frozen' if frozen else 'thawed'} after {self.freeze_timeout_s} s "
                "(a task blocked in the kernel freezes when it returns)"
            )
        log.debug(
            "cgroup_frozen" if frozen else "cgroup_thawed",
            client_id=client_id,
            wait_ms=round((time.monotonic() - start) * 1e3, 3),
        )

    def is_frozen(self, client_id: str) -> bool:
        """Whether the kernel reports the client's cgroup frozen (``False`` without a cgroup)."""
        try:
            events = read_keyed((self.path(client_id) / "cgroup.events").read_text())
        except FileNotFoundError:
            return False
        return events.get("frozen") == "1"

    def kill(self, client_id: str) -> None:
        """SIGKILL every process in the client's cgroup (also when frozen) and wait for it to empty.

        Uses ``cgroup.kill`` (race-free against fork); on kernels without it, SIGKILLs the members
        until none is left. Does nothing when the client has no cgroup.

        Raises:
            PauserError: the cgroup still has processes after ``kill_timeout_s``.
        """
        path = self.path(client_id)
        if not path.is_dir():
            return
        deadline = time.monotonic() + self.kill_timeout_s
        try:
            if (path / "cgroup.kill").exists():
                write_value(path / "cgroup.kill", "1")
                emptied = wait_event(path / "cgroup.events", "populated", "0", self.kill_timeout_s)
            else:
                emptied = self._kill_each(path, deadline)
        except FileNotFoundError:
            return  # released concurrently: nothing left to kill
        except OSError as exc:
            raise PauserError(f"cannot kill {path}: {exc}") from exc
        finally:
            self._tracker.invalidate(client_id)  # pids() right after a kill reads the cgroup
        if not emptied:
            raise PauserError(
                f"{path} still has processes {sorted(walk_pids(path))} after SIGKILL "
                f"and {self.kill_timeout_s} s (stuck in the kernel?)"
            )
        log.info("cgroup_killed", client_id=client_id)

    def _kill_each(self, path: Path, deadline: float) -> bool:
        # Without cgroup.kill a fork can race the loop, so repeat until the cgroup stays empty.
        while True:
            members = list(walk_pids(path))
            if not members:
                return True
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() >= deadline:
                return not list(walk_pids(path))
            time.sleep(0.005)

    def pids(self, client_id: str) -> Sequence[int]:
        """Processes in the client's cgroup and any sub-cgroup it made (empty without one).

        Tracked on change (module doc): empty as soon as the kernel reports the cgroup empty; a
        process forked or exited beside others shows within ``pids_rescan_s``.
        """
        return self._tracker.pids(client_id, self.path)

    def members(self, client_id: str) -> list[int]:
        """The processes in the client's cgroup now, read from the cgroup (for signalling them)."""
        return sorted(walk_pids(self.path(client_id)))

    def owner_of(self, pid: int) -> str | None:
        """The client whose cgroup (or a sub-cgroup of it) holds ``pid`` now, from /proc/PID/cgroup.

        One read however many clients there are, and exact where :meth:`pids` may be
        ``pids_rescan_s`` behind a fork (a latency report from a just-forked worker).
        """
        if self._base_rel is None:
            mount = cgroup2_mount()
            if mount is None or not is_within(self.base, mount):
                return None
            self._base_rel = "/" + str(self.base.relative_to(mount)).strip("/.")
        where = own_cgroup_path(Path(f"/proc/{pid}/cgroup"))
        prefix = self._base_rel.rstrip("/") + "/" + CLIENT_PREFIX
        if where is None or not where.startswith(prefix):
            return None
        client_id = where[len(prefix) :].split("/", 1)[0]
        with contextlib.suppress(ValueError):
            return check_client_id(client_id)
        return None

    def release(self, client_id: str) -> None:
        """Remove the client's (empty) cgroup; nothing to do when it does not exist.

        Raises:
            PauserError: processes are still in it (kill them first).
        """
        with self._fd_lock:
            self._close_fd(client_id)
        path = self.path(client_id)
        self._tracker.forget(client_id)
        if not path.is_dir():
            self._paths.pop(client_id, None)
            self._own.discard(client_id)
            return
        left = self.members(client_id)
        if left:
            raise PauserError(f"cannot release {client_id}: processes {left} remain; kill first")
        # Depth first: a client may have created sub-cgroups of its own.
        for sub in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
            _rmdir(sub)
        _rmdir(path)
        self._paths.pop(client_id, None)
        self._own.discard(client_id)
        log.debug("cgroup_released", client_id=client_id)

    def clients(self) -> dict[str, list[int]]:
        """Existing client cgroups and their processes, for re-adoption after a daemon restart."""
        out: dict[str, list[int]] = {}
        try:
            entries = sorted(self.base.iterdir())
        except FileNotFoundError:
            return out
        for entry in entries:
            if entry.is_dir() and entry.name.startswith(CLIENT_PREFIX):
                out[entry.name[len(CLIENT_PREFIX) :]] = sorted(walk_pids(entry))
        return out


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PauserError(f"cannot remove {path}: {exc.strerror or exc}") from exc


if TYPE_CHECKING:  # the adapter implements the Protocols the daemon holds it by

    def _conforms(p: CgroupPauser) -> NodePauser:
        return p
