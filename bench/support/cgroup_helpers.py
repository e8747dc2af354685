"""Helpers for tests that use the real cgroup v2 hierarchy (reusable by the daemon's tests).

``unique_base()`` names a fresh directory beside this process's cgroup; ``remove_tree()`` kills
every process under it and removes it, depth first. Use them in a fixture::

    @pytest.fixture
    def cg_base():
        if (reason := cgroup_skip_reason()) is not None:
            pytest.skip(reason)
        base = unique_base("gpushare-test")
        yield base
        remove_tree(base)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

from gpushare.node.cgroups.discovery import cgroup2_mount, own_cgroup


def cgroup_skip_reason() -> str | None:
    """Why this machine cannot run real-cgroup tests, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "needs root to create cgroups (run the suite as root)"
    mount = cgroup2_mount()
    if mount is None:
        return "no cgroup2 filesystem is mounted (see /proc/self/mounts)"
    own = own_cgroup(mount)
    if own is None or not os.access(own, os.W_OK):
        return f"this process's cgroup {own} is not writable"
    return None


def unique_base(prefix: str) -> Path:
    """A not-yet-created directory beside this process's cgroup, unique to this call."""
    own = own_cgroup()
    assert own is not None, "call cgroup_skip_reason() first"
    return own / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_tree(path: Path, timeout_s: float = 5.0) -> None:
    """SIGKILL every process under ``path`` and remove its cgroups, depth first."""
    if not path.exists():
        return
    tree = [*sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True), path]
    for sub in tree:
        if (sub / "cgroup.freeze").exists():
            with contextlib.suppress(OSError):
                (sub / "cgroup.freeze").write_text("0")
        if (sub / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (sub / "cgroup.kill").write_text("1")
        with contextlib.suppress(FileNotFoundError):
            for line in (sub / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line), signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for sub in tree:
        while True:
            try:
                sub.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
