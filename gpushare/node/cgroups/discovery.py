"""Finding the cgroup v2 hierarchy, this process's place in it, and where client cgroups go.

The cgroup2 mount is found in ``/proc/self/mounts``; on hybrid hosts it is
``/sys/fs/cgroup/unified``, so it is never hard-coded. Under systemd with ``Delegate=yes`` the
daemon puts clients beside itself in its unit's cgroup and moves itself into a ``daemon/`` leaf
(``docs/cgroups.md``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import structlog

from gpushare.node.cgroups.files import write_value
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.facts import cgroup_v2_path

log = structlog.get_logger(__name__)

PROC_MOUNTS = Path("/proc/self/mounts")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

DAEMON_LEAF = "daemon"
# Used as the base directory under the cgroup2 root when the daemon is not in a delegated cgroup
# of its own (started by hand, or a hybrid host where everything sits in the root).
DEFAULT_SUBTREE = "gpushare"

_OCTAL_ESCAPE_RE = re.compile(r"\\([0-7]{3})")


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
        return cgroup_v2_path(cgroup_file.read_text())
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
        write_value(target / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        raise PauserError(
            f"cannot move the daemon into {target}: {exc.strerror or exc}; "
            "run it with Delegate=yes (systemd) or as root"
        ) from exc
    log.info("cgroup_daemon_moved", leaf=str(target))
    return target


def is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` lies under ``root`` once both are resolved (``root`` itself counts)."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
