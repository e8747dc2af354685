"""Whether a process gpushare adopted can be frozen through its own cgroup, or needs SIGSTOP.

:class:`gpushare.node.adopted.AdoptingPauser` asks once, when it adopts a process, and keeps the
answer and its reason (``status`` shows it).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from gpushare.control.pods import ENV_CLIENT_SCOPE, POD_SCOPE, pod_cgroup
from gpushare.model import PauseMechanism
from gpushare.node.cgroups.discovery import cgroup2_mount, is_delegated, is_within
from gpushare.node.cgroups.files import walk_pids
from gpushare.node.procs.facts import process_cgroup, read_environ


class FreezeRoute(NamedTuple):
    """How an adopted process can be paused, and a one-line reason fit for ``status``."""

    mechanism: PauseMechanism
    cgroup: Path | None
    reason: str


def freeze_route(pid: int, client_pids: Collection[int], mount: Path | None = None) -> FreezeRoute:
    """Whether an adopted process may be frozen through its own cgroup, or needs SIGSTOP.

    Its cgroup (a service's, a container's, a delegated leaf) is used when it is not the root, has
    a writable ``cgroup.freeze`` and holds no process outside ``client_pids`` (the process and its
    descendants): a login session's scope also holds the user's shell. A process that asks for
    pod scope (:func:`_pod_route`) is frozen with its whole pod instead. Changes nothing.
    """
    mount = mount if mount is not None else cgroup2_mount()
    rel = process_cgroup(pid)
    if mount is not None and rel is not None and (pod := _pod_route(pid, rel, mount)) is not None:
        return pod
    path = mount / rel.lstrip("/") if mount is not None and rel is not None and rel != "/" else None
    others = sorted(set(walk_pids(path)) - set(client_pids)) if path is not None else []
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
            is_delegated(p) for p in (path, *path.parents) if p != mount and is_within(p, mount)
        )
        owner = "a delegated cgroup" if delegated else "its own cgroup"
        return FreezeRoute(PauseMechanism.CGROUP, path, f"cgroup freezer on {owner}: {path}")
    return FreezeRoute(PauseMechanism.SIGNAL, None, f"SIGSTOP/SIGCONT: {why}")


def _pod_route(pid: int, rel: str, mount: Path) -> FreezeRoute | None:
    """The pod's cgroup, for a process that asks for pod scope in a container of a pod.

    Rule: only with ``GPUSHARE_CLIENT_SCOPE=pod`` in its environment, only the pod cgroup that
    directly holds the process's container cgroup, and only when root owns that pod cgroup (the
    kubelet's; a cgroup subtree delegated to a user is that user's, so a user cannot name one of
    its own a pod and have gpushare freeze what root put there).
    """
    try:
        env = read_environ(pid, [ENV_CLIENT_SCOPE]) or {}
    except PermissionError:
        return None
    found = pod_cgroup(rel) if env.get(ENV_CLIENT_SCOPE) == POD_SCOPE else None
    if found is None:
        return None
    path = mount / found.lstrip("/")
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return None
    if owner != 0 or not os.access(path / "cgroup.freeze", os.W_OK):
        return None
    return FreezeRoute(
        PauseMechanism.CGROUP,
        path,
        f"cgroup freezer on its pod's cgroup ({ENV_CLIENT_SCOPE}=pod): {path}",
    )
