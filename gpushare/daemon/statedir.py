"""The state directory: its permissions, the client log directory, and opening the registry there.

Both directories are root's and closed to listing: mode 0711, or 0751 with group the admin group
(``daemon.admin_group``) when it exists. Nobody else can list them, so client ids and log names
cannot be browsed; the execute bit lets a user open their own client log by the path ``submit``
printed (each log is 0600 and owned by its client's user: :func:`gpushare.node.procs.spawning.open_log`).
The database and its ``-wal``/``-shm`` are 0600 root (:mod:`gpushare.daemon.registry.store`).

A directory another user could write to (world-writable, sticky, or not root's) is refused, not
"fixed": changing the mode of a shared directory such as ``/tmp`` would break the host.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from gpushare.config import Config
from gpushare.daemon.registry import EventRetention, Registry, RegistryError
from gpushare.daemon.registry.ids import highest_number

OTHERS_MODE = 0o711
GROUP_MODE = 0o751


class StateDirError(Exception):
    """The state or client log directory cannot be made safe; the message says which and why."""


def admin_gid(cfg: Config) -> int | None:
    """The admin group's gid, or ``None`` (not configured, or no such group on this host)."""
    name = cfg.daemon.admin_group
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def secure_dir(path: Path, gid: int | None) -> None:
    """Create ``path`` or make it root's 0711 (0751 with group ``gid``).

    Raises:
        StateDirError: it cannot be created, is not a directory, or others could write to it.
    """
    mode = GROUP_MODE if gid is not None else OTHERS_MODE
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(path)
    except OSError as exc:
        raise StateDirError(f"cannot create {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"{path} is not a directory (a symlink?); give it a directory")
    euid = os.geteuid()
    if st.st_uid != euid or st.st_mode & (stat.S_IWOTH | stat.S_ISVTX):
        raise StateDirError(
            f"{path} is owned by uid {st.st_uid} or writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): give gpushare a directory of its own"
        )
    try:
        if euid == 0:
            os.chown(path, 0, gid if gid is not None else 0, follow_symlinks=False)
        os.chmod(path, mode, follow_symlinks=False)
    except OSError as exc:
        raise StateDirError(f"cannot set {path} to mode {mode:o}: {exc.strerror or exc}") from exc


def open_registry(cfg: Config) -> Registry:
    """Make the state and client log directories safe, then open the registry in them.

    Raises:
        RegistryError: the cause in one line (a directory, the database, the id mark).
    """
    gid = admin_gid(cfg)
    log_dir = cfg.paths.resolved("client_log_dir")
    try:
        secure_dir(cfg.paths.state_dir, gid)
        secure_dir(log_dir, gid)
    except StateDirError as exc:
        raise RegistryError(str(exc)) from exc
    try:
        logs = [name.removesuffix(".log") for name in os.listdir(log_dir)]
    except OSError:
        logs = []
    return Registry.open(
        cfg.paths.resolved("database"),
        # Should the id mark be lost, no new client is given the name of a log still there.
        id_floor=highest_number(logs),
        retention=EventRetention(cfg.daemon.events_max_age_s, cfg.daemon.events_max_rows),
    )
