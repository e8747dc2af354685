"""Killing a client's whole cgroup with CgroupPauser, frozen or not, with or without cgroup.kill.

Each test works under its own cgroup (``cg_base`` in conftest.py), removed at teardown.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

import psutil

from gpushare.node.cgroups.pauser import CgroupPauser
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import Children
from tests.support.processes import gone as _gone
from tests.support.processes import wait_for as _wait_for


@needs_cgroup
def test_kill_kills_whole_tree_even_when_frozen(pauser: CgroupPauser, children: Children) -> None:
    # The shell forks only after attach (it waits for a line): the orphaned "(sleep &)" is no
    # longer a descendant of the shell, and the cgroup still holds and kills it.
    proc = children.start(
        ["sh", "-c", "read go; sleep 60 & sleep 60 & (sleep 60 &) ; wait"], stdin=subprocess.PIPE
    )
    pauser.attach("tree", proc.pid)
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()

    def orphans() -> list[int]:
        out = []
        for pid in pauser.pids("tree"):
            with contextlib.suppress(psutil.NoSuchProcess):
                if pid != proc.pid and psutil.Process(pid).ppid() != proc.pid:
                    out.append(pid)
        return out

    # Settled: the shell, its two sleeps, and the sleep whose subshell parent has exited.
    assert _wait_for(lambda: len(pauser.pids("tree")) == 4 and len(orphans()) == 1), pauser.pids(
        "tree"
    )
    members = list(pauser.pids("tree"))
    pauser.freeze("tree")
    pauser.kill("tree")
    assert pauser.pids("tree") == []
    assert "populated 0" in (pauser.path("tree") / "cgroup.events").read_text()
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert _wait_for(lambda: all(_gone(pid) for pid in members))
    pauser.release("tree")
    assert not pauser.path("tree").exists()


@needs_cgroup
def test_kill_without_cgroup_kill_file_falls_back_to_sigkill(
    pauser: CgroupPauser, children: Children
) -> None:
    proc = children.start(["sh", "-c", "read go; sleep 60 & wait"], stdin=subprocess.PIPE)
    pauser.attach("old", proc.pid)
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert _wait_for(lambda: len(pauser.pids("old")) == 2)
    # Exercise the per-pid path as on kernels before 5.14 (no cgroup.kill).
    assert pauser._kill_each(pauser.path("old"), time.monotonic() + 5)
    assert pauser.pids("old") == []
    assert proc.wait(timeout=5) == -signal.SIGKILL
