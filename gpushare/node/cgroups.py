"""Pausing and killing clients: the cgroup v2 freezer, or SIGSTOP/SIGCONT where there is none.

This module owns cgroupfs. Layout (``docs/cgroups.md``)::

    <base>/                  the daemon's subtree (its delegated unit cgroup, or <mount>/gpushare)
    <base>/daemon/           the daemon itself, when <base> is its own cgroup (no-internal-process rule)
    <base>/client-<id>/      one leaf per client; the freezer, cgroup.kill and membership act on it

The cgroup2 mount is found in ``/proc/self/mounts``; on hybrid hosts it is ``/sys/fs/cgroup/unified``,
so it is never hard-coded. Freezing is asynchronous in the kernel: :meth:`CgroupPauser.freeze` and
:meth:`CgroupPauser.thaw` write ``cgroup.freeze`` and then wait, with a deadline, for
``cgroup.events`` to say ``frozen 1``/``frozen 0`` (woken by ``poll`` on the events file).

Limit (docs/design.md §2): a frozen client issues no new GPU work, but kernels it already queued still run.

Where no writable cgroup v2 exists, :class:`SignalPauser` stops and continues the client's process
group; :func:`make_pauser` picks one of the two and says why.

The control loop asks every tick for each client's processes (:meth:`CgroupPauser.pids`); walking
every cgroup each time cost the daemon a third of its CPU. The pids are tracked on change
instead: the kernel reports each change of a client's ``cgroup.events`` (its last process gone,
its first one in) through one epoll set, which empties or refreshes that client's list at once;
a fork or an exit that leaves others behind changes no cgroup file, so each list is also re-read
every ``pids_rescan_s``. Killing and releasing always read the cgroup itself. Without cgroups,
:class:`SignalPauser` finds a group's members by reading every process's ``/proc/PID/stat``; one
such pass serves every client, at most every ``pids_rescan_s``.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import random
import re
import select
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import structlog

from gpushare.model import PauseMechanism
from gpushare.node import procs

# Re-exported: the pausers' shared errors and checks, and the fallback pauser, are part of this
# module's surface (callers import them from here).
from gpushare.node.pauser_base import DEFAULT_PIDS_RESCAN_S
from gpushare.node.pauser_base import FreezeTimeoutError as FreezeTimeoutError
from gpushare.node.pauser_base import PauserError as PauserError
from gpushare.node.pauser_base import check_client_id as check_client_id
from gpushare.node.pauser_base import check_pid as check_pid
from gpushare.node.signal_pauser import SignalPauser as SignalPauser

log = structlog.get_logger(__name__)

PROC_MOUNTS = Path("/proc/self/mounts")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

CLIENT_PREFIX = "client-"
DAEMON_LEAF = "daemon"
# Used as the base directory under the cgroup2 root when the daemon is not in a delegated cgroup
# of its own (started by hand, or a hybrid host where everything sits in the root).
DEFAULT_SUBTREE = "gpushare"

DEFAULT_FREEZE_TIMEOUT_S = 1.0
DEFAULT_KILL_TIMEOUT_S = 2.0

# Each round moves what the previous one missed; a workload forking faster than that is pathological.
_SWEEP_ROUNDS = 5
_OCTAL_ESCAPE_RE = re.compile(r"\\([0-7]{3})")


class PauserChoice(NamedTuple):
    """What :func:`make_pauser` picked, and a one-line reason fit for ``status`` and the log."""

    pauser: CgroupPauser | SignalPauser
    reason: str


# ---------------------------------------------------------------------------------------------------
# Discovery


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes (\040 …).
    return _OCTAL_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def cgroup2_mount(mounts_file: Path = PROC_MOUNTS) -> Path | None:
    """The mount point of the cgroup v2 hierarchy, or ``None`` where none is mounted.

    Args:
        mounts_file: the mount table to read; tests pass a copy of a hybrid host's table.
    """
    try:
        text = mounts_file.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(_unescape_mount_field(fields[1]))
    return None


def own_cgroup_path(cgroup_file: Path = PROC_SELF_CGROUP) -> str | None:
    """This process's cgroup v2 path relative to the mount (``/`` on a hybrid host), or ``None``.

    Args:
        cgroup_file: ``/proc/<pid>/cgroup`` of the process to ask about.
    """
    try:
        return procs.cgroup_v2_path(cgroup_file.read_text())
    except OSError:
        return None


def own_cgroup(mount: Path | None = None, cgroup_file: Path = PROC_SELF_CGROUP) -> Path | None:
    """This process's cgroup v2 directory (the ``0::`` line joined to the mount), or ``None``.

    Args:
        mount: the cgroup2 mount; discovered when not given.
        cgroup_file: ``/proc/<pid>/cgroup`` of the process to ask about.
    """
    mount = mount if mount is not None else cgroup2_mount()
    rel = own_cgroup_path(cgroup_file)
    if mount is None or rel is None:
        return None
    return mount / rel.lstrip("/") if rel != "/" else mount


def default_base_dir(mount: Path | None = None) -> Path | None:
    """Where the daemon puts client cgroups when the config names no directory.

    Under systemd with ``Delegate=yes`` the daemon's own cgroup is its unit's, and clients go beside
    it (the daemon itself moves into ``daemon/``, see :func:`move_self_to_leaf`); a daemon already
    in that leaf uses the leaf's parent. A daemon in the root cgroup (hybrid hosts, containers, a
    hand start) uses ``<mount>/gpushare``.

    Args:
        mount: the cgroup2 mount; discovered when not given.

    Returns:
        The directory, or ``None`` without cgroup v2.
    """
    mount = mount if mount is not None else cgroup2_mount()
    if mount is None:
        return None
    own = own_cgroup(mount)
    if own is None or own == mount:
        return mount / DEFAULT_SUBTREE
    if own.name == DAEMON_LEAF:
        return own.parent
    if not is_delegated(own):
        # Usable (root may write anywhere) but systemd owns this cgroup: say how to fix it.
        log.warning("cgroup_not_delegated", cgroup=str(own), fix="set Delegate=yes in the unit")
    return own


def is_delegated(path: Path) -> bool:
    """Whether systemd marked ``path`` as delegated (``Delegate=yes``) to its unit.

    systemd (v251 and later) sets the ``trusted.delegate`` (system units) or ``user.delegate``
    (user units) extended attribute on a delegated cgroup. Outside a delegated subtree a daemon
    should not create cgroups in its unit's cgroup (systemd owns it).
    """
    for attr in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(path, attr) == b"1":
                return True
        except OSError:
            continue
    return False


def move_self_to_leaf(base: Path, leaf: str = DAEMON_LEAF) -> Path | None:
    """Move this process (every thread) into ``<base>/<leaf>`` when it sits in ``base`` itself.

    cgroup v2 forbids processes in a cgroup whose ``subtree_control`` enables controllers for
    children, so with ``Delegate=yes`` the daemon must leave its unit cgroup before clients go
    beside it. A process elsewhere (an ancestor such as the root, which is exempt) is left alone.

    Args:
        base: the client base directory (see :func:`default_base_dir`).
        leaf: the name of the daemon's leaf.

    Returns:
        The leaf the process now lives in, or ``None`` when no move was needed.

    Raises:
        PauserError: the leaf cannot be created or joined (the message names the path).
    """
    own = own_cgroup()
    if own is None or own.resolve() != base.resolve():
        return None
    target = base / leaf
    try:
        target.mkdir(exist_ok=True)
        _write(target / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        raise PauserError(
            f"cannot move the daemon into {target}: {exc.strerror or exc}; "
            "run it with Delegate=yes (systemd) or as root"
        ) from exc
    log.info("cgroup_daemon_moved", leaf=str(target))
    return target


def _write(path: Path, text: str) -> None:
    # cgroupfs wants one write() per value; open without O_CREAT so a typo'd path is an error.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read_keyed(text: str) -> dict[str, str]:
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


# ---------------------------------------------------------------------------------------------------
# cgroup v2


class CgroupPauser:
    """The cgroup v2 freezer over ``<base>/client-<id>/`` leaves (implements ``Pauser``).

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
        self._tracker = _PidTracker(pids_rescan_s)
        self._paths: dict[str, Path] = {}
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
            path.mkdir(exist_ok=True)
            _write(path / "cgroup.procs", str(pid))
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
        """Create the client's cgroup and open its ``cgroup.procs`` for ``procs.spawn``.

        A child spawned with this descriptor joins the cgroup before it execs, which closes the
        window in which a workload could fork outside it. The caller closes the descriptor once
        the spawn returned (it is close-on-exec, so the workload never holds it).

        Raises:
            PauserError: the cgroup cannot be created or opened.
        """
        path = self.path(client_id)
        self._tracker.invalidate(client_id)  # the child joins after this returns
        try:
            path.mkdir(exist_ok=True)
            return os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PauserError(
                f"cannot open {path / 'cgroup.procs'}: {exc.strerror or exc}"
            ) from exc

    def _sweep_descendants(self, path: Path, pid: int) -> int:
        moved = 0
        for _ in range(_SWEEP_ROUNDS):
            inside = set(_walk_pids(path))
            outside = [kid for kid in procs.descendants(pid) if kid not in inside]
            if not outside:
                break
            for kid in outside:
                try:
                    _write(path / "cgroup.procs", str(kid))
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
                _write(path / "cgroup.freeze", want)
            except OSError:
                missing.append(client_id)
                continue
            pending.append((client_id, path))
        deadline = time.monotonic() + self.freeze_timeout_s
        late: list[str] = []
        for client_id, path in pending:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                if not _wait_event(path / "cgroup.events", "frozen", want, remaining):
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
            _write(path / "cgroup.freeze", want)
            done = _wait_event(path / "cgroup.events", "frozen", want, self.freeze_timeout_s)
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
            events = _read_keyed((self.path(client_id) / "cgroup.events").read_text())
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
                _write(path / "cgroup.kill", "1")
                emptied = _wait_event(path / "cgroup.events", "populated", "0", self.kill_timeout_s)
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
                f"{path} still has processes {sorted(_walk_pids(path))} after SIGKILL "
                f"and {self.kill_timeout_s} s (stuck in the kernel?)"
            )
        log.info("cgroup_killed", client_id=client_id)

    def _kill_each(self, path: Path, deadline: float) -> bool:
        # Without cgroup.kill a fork can race the loop, so repeat until the cgroup stays empty.
        while True:
            members = list(_walk_pids(path))
            if not members:
                return True
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() >= deadline:
                return not list(_walk_pids(path))
            time.sleep(0.005)

    def pids(self, client_id: str) -> Sequence[int]:
        """Processes in the client's cgroup and any sub-cgroup it made (empty without one).

        Tracked on change (module doc): empty as soon as the kernel reports the cgroup empty; a
        process forked or exited beside others shows within ``pids_rescan_s``.
        """
        return self._tracker.pids(client_id, self.path)

    def members(self, client_id: str) -> list[int]:
        """The processes in the client's cgroup now, read from the cgroup (for signalling them)."""
        return sorted(_walk_pids(self.path(client_id)))

    def owner_of(self, pid: int) -> str | None:
        """The client whose cgroup (or a sub-cgroup of it) holds ``pid`` now, from /proc/PID/cgroup.

        One read however many clients there are, and exact where :meth:`pids` may be
        ``pids_rescan_s`` behind a fork (a latency report from a just-forked worker).
        """
        if self._base_rel is None:
            mount = cgroup2_mount()
            if mount is None or not _is_within(self.base, mount):
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
            return
        left = self.members(client_id)
        if left:
            raise PauserError(f"cannot release {client_id}: processes {left} remain; kill first")
        # Depth first: a client may have created sub-cgroups of its own.
        for sub in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
            _rmdir(sub)
        _rmdir(path)
        self._paths.pop(client_id, None)
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
                out[entry.name[len(CLIENT_PREFIX) :]] = sorted(_walk_pids(entry))
        return out


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PauserError(f"cannot remove {path}: {exc.strerror or exc}") from exc


def _walk_pids(path: Path | str) -> Iterator[int]:
    try:
        with os.scandir(path) as entries:
            # The directory entry's type (d_type) says which are sub-cgroups: no stat per file.
            subs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    yield from _read_pids(os.path.join(path, "cgroup.procs"))
    for sub in subs:
        yield from _walk_pids(sub)


class _PidTracker:
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
                known = tuple(sorted(_walk_pids(path)))
                if not known and not path.is_dir():
                    self._unwatch(client_id)  # removed under us: stop watching its old file
                self._pids[client_id] = known
                self._due[client_id] = now + self.rescan_s * (0.5 + random.random())
            return list(known)

    def invalidate(self, client_id: str) -> None:
        with self._lock:
            self._due.pop(client_id, None)

    def forget(self, client_id: str) -> None:
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


def _wait_event(events: Path, key: str, want: str, timeout_s: float) -> bool:
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
            if _read_keyed(os.pread(fd, 4096, 0).decode()).get(key) == want:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(math.ceil(min(remaining, 0.05) * 1000))
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# Adopted processes


class FreezeRoute(NamedTuple):
    """How an adopted process can be paused, and a one-line reason fit for ``status``."""

    mechanism: PauseMechanism
    cgroup: Path | None
    reason: str


def freeze_route(pid: int, client_pids: Collection[int], mount: Path | None = None) -> FreezeRoute:
    """Whether an adopted process may be frozen through its own cgroup, or needs SIGSTOP.

    Its cgroup (a service's, a container's, a delegated leaf) is used when it is not the root, has
    a writable ``cgroup.freeze`` and holds no process outside ``client_pids`` (the process and its
    descendants): a login session's scope also holds the user's shell. Changes nothing.
    """
    mount = mount if mount is not None else cgroup2_mount()
    rel = procs.process_cgroup(pid)
    path = mount / rel.lstrip("/") if mount is not None and rel is not None and rel != "/" else None
    others = sorted(set(_walk_pids(path)) - set(client_pids)) if path is not None else []
    if mount is None or rel is None:
        why = "no cgroup v2 is mounted" if mount is None else f"pid {pid} has no cgroup v2 (gone?)"
    elif path is None:
        why = "it is in the root cgroup, which cannot be frozen"
    elif not (path / "cgroup.freeze").exists():
        why = f"{path} has no cgroup.freeze (kernel older than 5.2?)"
    elif not os.access(path / "cgroup.freeze", os.W_OK):
        why = f"{path}/cgroup.freeze is not writable (read-only cgroupfs?)"
    elif others:
        why = f"{path} also holds pid {others[0]}, which is not part of the client"
    else:
        delegated = any(
            is_delegated(p) for p in (path, *path.parents) if p != mount and _is_within(p, mount)
        )
        owner = "a delegated cgroup" if delegated else "its own cgroup"
        return FreezeRoute(PauseMechanism.CGROUP, path, f"cgroup freezer on {owner}: {path}")
    return FreezeRoute(PauseMechanism.SIGNAL, None, f"SIGSTOP/SIGCONT: {why}")


# ---------------------------------------------------------------------------------------------------
# Choice


def make_pauser(
    base: Path | None = None,
    *,
    freeze_timeout_s: float = DEFAULT_FREEZE_TIMEOUT_S,
    kill_timeout_s: float = DEFAULT_KILL_TIMEOUT_S,
) -> PauserChoice:
    """The cgroup freezer where a writable cgroup v2 exists, else the signal fallback, and why.

    The check is real: it creates and removes a probe cgroup under ``base`` and looks for
    ``cgroup.freeze`` in it (the root cgroup has none, and read-only or foreign trees refuse).

    Args:
        base: the client base directory; :func:`default_base_dir` when ``None``.
        freeze_timeout_s: passed to :class:`CgroupPauser`.
        kill_timeout_s: passed to :class:`CgroupPauser`.
    """
    mount = cgroup2_mount()
    chosen = base if base is not None else default_base_dir(mount)
    reason = _cgroup_unusable(chosen, mount, keep_base=True)
    if reason is None and chosen is not None:
        pauser = CgroupPauser(
            chosen, freeze_timeout_s=freeze_timeout_s, kill_timeout_s=kill_timeout_s
        )
        log.info("pauser_chosen", mechanism=pauser.mechanism.value, base=str(chosen))
        return PauserChoice(pauser, f"cgroup v2 freezer under {chosen}")
    log.warning("pauser_chosen", mechanism=PauseMechanism.SIGNAL.value, reason=reason)
    return PauserChoice(SignalPauser(), f"SIGSTOP/SIGCONT of process groups: {reason}")


def freezer_check(base: Path | None = None) -> tuple[bool, str]:
    """Whether the cgroup freezer is usable under ``base``, and what was seen; changes nothing.

    For ``gpushare doctor``: the same real check as :func:`make_pauser` (a probe cgroup is created
    and removed), but a base directory it had to create is removed again.

    Args:
        base: the client base directory; :func:`default_base_dir` when ``None``.
    """
    mount = cgroup2_mount()
    chosen = base if base is not None else default_base_dir(mount)
    reason = _cgroup_unusable(chosen, mount, keep_base=False)
    if reason is None:
        return True, f"cgroup v2 at {mount}; client cgroups under {chosen}"
    return False, reason


def _cgroup_unusable(base: Path | None, mount: Path | None, *, keep_base: bool) -> str | None:
    if mount is None or base is None:
        return "no cgroup2 filesystem in /proc/self/mounts"
    if not _is_within(base, mount):
        return f"{base} is not under the cgroup2 mount {mount}"
    if not base.parent.is_dir():
        return f"{base.parent} does not exist"
    created = False
    reason: str | None = None
    try:
        if not base.is_dir():
            base.mkdir()
            created = True
        probe = base / f".probe-{os.getpid()}"
        probe.mkdir()
        try:
            if not (probe / "cgroup.freeze").exists():
                reason = f"{base} has no cgroup.freeze (kernel older than 5.2?)"
            elif not os.access(base / "cgroup.procs", os.W_OK):
                reason = f"{base}/cgroup.procs is not writable"
        finally:
            probe.rmdir()
    except OSError as exc:
        reason = f"cannot create cgroups under {base}: {exc.strerror or exc}"
    finally:
        # A base made only for this check goes again; a usable one is kept for the pauser.
        if created and (reason is not None or not keep_base):
            with contextlib.suppress(OSError):
                base.rmdir()
    return reason


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
