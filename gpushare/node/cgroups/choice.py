"""Choosing a pauser: the cgroup v2 freezer where a writable cgroup v2 exists, else SIGSTOP/SIGCONT.

:func:`make_pauser` picks one of the two and says why; :func:`freezer_check` runs the same real
check for ``gpushare doctor`` and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import NamedTuple

import structlog

from gpushare.model import PauseMechanism
from gpushare.node.cgroups.discovery import cgroup2_mount, default_base_dir, is_within
from gpushare.node.cgroups.pauser import (
    DEFAULT_FREEZE_TIMEOUT_S,
    DEFAULT_KILL_TIMEOUT_S,
    CgroupPauser,
)
from gpushare.node.signal_pauser import SignalPauser

log = structlog.get_logger(__name__)


class PauserChoice(NamedTuple):
    """What :func:`make_pauser` picked, and a one-line reason fit for ``status`` and the log."""

    pauser: CgroupPauser | SignalPauser
    reason: str


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
    if not is_within(base, mount):
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
