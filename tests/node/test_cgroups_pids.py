"""A client's pids tracked on change (CgroupPauser.pids, gpushare.node.cgroups.pid_tracker).

Read once until the cgroup changes, forks and exits found at the next re-read, an emptied cgroup
seen at once through cgroup.events, ``owner_of`` naming the client of a just-forked process, and
the daemon's pauser stack passing ``members``/``owner_of`` through.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpushare.node.cgroups import pid_tracker
from gpushare.node.cgroups.pauser import CgroupPauser
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import FORK_ON_LINE, SLEEPER, Children
from tests.support.processes import wait_for as _wait_for


@needs_cgroup
def test_pids_are_read_once_until_the_cgroup_changes(
    cg_base: Path, children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauser = CgroupPauser(cg_base, pids_rescan_s=60.0)
    proc = children.start(SLEEPER)
    pauser.attach("idle", proc.pid)
    walks: list[Path] = []
    real_walk = pid_tracker.walk_pids

    def counting(path: Path) -> Iterator[int]:
        walks.append(path)
        return real_walk(path)

    monkeypatch.setattr(pid_tracker, "walk_pids", counting)
    for _ in range(100):
        assert pauser.pids("idle") == [proc.pid]
    # One read for a hundred looks: the control loop's every-tick question costs no cgroup walk.
    assert len(walks) == 1


@needs_cgroup
def test_a_process_forked_inside_is_found(cg_base: Path, children: Children) -> None:
    pauser = CgroupPauser(cg_base, pids_rescan_s=0.2)
    shell = children.start(FORK_ON_LINE, stdin=subprocess.PIPE)
    pauser.attach("forks", shell.pid)
    assert pauser.pids("forks") == [shell.pid]
    assert shell.stdin is not None
    shell.stdin.write(b"go\n")
    shell.stdin.flush()
    # A fork changes no cgroup file: it shows at the next re-read, within 1.5 pids_rescan_s.
    assert _wait_for(lambda: len(pauser.pids("forks")) == 2, timeout_s=3.0), pauser.pids("forks")
    kid = next(p for p in pauser.pids("forks") if p != shell.pid)
    assert psutil.Process(kid).ppid() == shell.pid


@needs_cgroup
def test_a_process_that_exits_is_dropped(cg_base: Path, children: Children) -> None:
    pauser = CgroupPauser(cg_base, pids_rescan_s=0.2)
    shell = children.start(FORK_ON_LINE, stdin=subprocess.PIPE)
    pauser.attach("tree", shell.pid)
    assert shell.stdin is not None
    shell.stdin.write(b"go\n")
    shell.stdin.flush()
    assert _wait_for(lambda: len(pauser.pids("tree")) == 2, timeout_s=3.0)
    kid = next(p for p in pauser.pids("tree") if p != shell.pid)
    os.kill(kid, signal.SIGKILL)
    # The shell reaps it; an exit beside a survivor is dropped at the next re-read.
    assert _wait_for(lambda: pauser.pids("tree") == [shell.pid], timeout_s=3.0), pauser.pids("tree")


@needs_cgroup
def test_an_emptied_cgroup_reads_empty_at_once(cg_base: Path, children: Children) -> None:
    # A re-read only every minute: what empties the list here is the kernel's cgroup.events.
    pauser = CgroupPauser(cg_base, pids_rescan_s=60.0)
    proc = children.start(SLEEPER)
    pauser.attach("gone", proc.pid)
    assert pauser.pids("gone") == [proc.pid]
    proc.kill()
    proc.wait(timeout=5)
    assert _wait_for(lambda: pauser.pids("gone") == [], timeout_s=2.0), pauser.pids("gone")
    # Attached again (a restart under the same id): the new process is seen at once too.
    again = children.start(SLEEPER)
    pauser.attach("gone", again.pid)
    assert pauser.pids("gone") == [again.pid]
    pauser.kill("gone")
    pauser.release("gone")
    assert pauser.pids("gone") == []


@needs_cgroup
def test_owner_of_names_the_client_of_a_just_forked_process(
    cg_base: Path, children: Children
) -> None:
    pauser = CgroupPauser(cg_base, pids_rescan_s=60.0)
    shell = children.start(FORK_ON_LINE, stdin=subprocess.PIPE)
    pauser.attach("worker", shell.pid)
    assert pauser.pids("worker") == [shell.pid]  # read now; the next re-read is a minute away
    assert shell.stdin is not None
    shell.stdin.write(b"go\n")
    shell.stdin.flush()
    assert _wait_for(lambda: len(psutil.Process(shell.pid).children()) == 1)
    kid = psutil.Process(shell.pid).children()[0].pid
    assert pauser.pids("worker") == [shell.pid]  # not re-read yet
    assert pauser.owner_of(kid) == "worker"
    assert pauser.owner_of(shell.pid) == "worker"
    assert pauser.owner_of(os.getpid()) is None
    assert pauser.owner_of(999_999_999) is None


@needs_cgroup
def test_the_daemons_pauser_stack_passes_members_and_owner_of_through(
    cg_base: Path, children: Children
) -> None:
    # The daemon wraps the cgroup pauser in AdoptingPauser (and, simulated, SimulatedPauser);
    # the lifecycle finds members()/owner_of() on the outermost one or falls back to pids().
    from gpushare.node.adopted import AdoptingPauser

    pauser = AdoptingPauser(CgroupPauser(cg_base, pids_rescan_s=60.0))
    shell = children.start(FORK_ON_LINE, stdin=subprocess.PIPE)
    pauser.attach("job", shell.pid)
    assert pauser.pids("job") == [shell.pid]
    assert shell.stdin is not None
    shell.stdin.write(b"go\n")
    shell.stdin.flush()
    assert _wait_for(lambda: len(pauser.members("job")) == 2)
    kid = next(p for p in pauser.members("job") if p != shell.pid)
    assert pauser.owner_of(kid) == "job"
    assert list(pauser.pids("job")) == [shell.pid]  # the tracked list catches up at its re-read
