"""Putting a client's processes into its cgroup: attach, spawning straight into it, release.

What attach refuses (bad client ids, a gone pid, init, the daemon, another user's process),
descendants forked before attach, a spawn that joins the cgroup before exec, and releasing a
client's cgroup once it is empty. Each test works under its own cgroup (``cg_base`` in
conftest.py), removed at teardown.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.spawning import SpawnError, spawn
from gpushare.node.signal_pauser import SignalPauser
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import SLEEPER, Children
from tests.support.processes import wait_for as _wait_for


def test_bad_client_id_is_refused_and_creates_nothing(pauser: CgroupPauser) -> None:
    for bad in ["", "../escape", "a/b", ".hidden", "x" * 129, "sp ace"]:
        with pytest.raises(ValueError, match="cannot name a cgroup"):
            pauser.attach(bad, os.getpid())
    assert pauser.clients() == {}
    assert [p.name for p in pauser.base.iterdir() if p.is_dir()] == []


@needs_cgroup
def test_attach_pids_release_and_clients(pauser: CgroupPauser, children: Children) -> None:
    a = children.start(SLEEPER)
    b = children.start(SLEEPER)
    pauser.attach("a", a.pid)
    pauser.attach("b", b.pid)
    pauser.attach("a", a.pid)  # idempotent
    assert pauser.pids("a") == [a.pid]
    assert pauser.clients() == {"a": [a.pid], "b": [b.pid]}
    own = f"0::/{pauser.path('a').relative_to(cgroup2_mount() or Path('/'))}"
    assert own in Path(f"/proc/{a.pid}/cgroup").read_text()

    with pytest.raises(PauserError, match="kill first"):
        pauser.release("a")
    assert pauser.path("a").exists()

    pauser.kill("a")
    a.wait(timeout=5)
    pauser.release("a")
    pauser.release("a")  # nothing left: a no-op
    assert not pauser.path("a").exists()
    assert pauser.clients() == {"b": [b.pid]}
    assert pauser.pids("a") == []


@needs_cgroup
def test_attach_moves_descendants_forked_before_attach(
    pauser: CgroupPauser, children: Children
) -> None:
    # The race attach closes: the workload forked before the daemon wrote its pid.
    proc = children.start(
        ["sh", "-c", "sleep 60 & sleep 60 & echo forked; wait"], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"forked\n"
    kids = [c.pid for c in psutil.Process(proc.pid).children()]
    assert len(kids) == 2
    pauser.attach("early", proc.pid)
    assert pauser.pids("early") == sorted([proc.pid, *kids])


@needs_cgroup
def test_spawn_joins_cgroup_before_exec(pauser: CgroupPauser, children: Children) -> None:
    # With the cgroup's procs fd, even a process orphaned in the workload's first instant (which
    # attach's descendant sweep could miss) starts inside; the ids are dropped after joining.
    try:
        nobody = pwd.getpwuid(65534)
    except KeyError:
        pytest.skip("this machine has no passwd entry for uid 65534 (nobody)")
    fd = pauser.open_procs_fd("born-inside")
    try:
        proc = spawn(
            ["sh", "-c", "(sleep 60 &); sleep 60 & wait"],
            uid=nobody.pw_uid,
            gid=nobody.pw_gid,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            log_path=None,
            cgroup_procs_fd=fd,
        )
    finally:
        os.close(fd)
    children.procs.append(proc)
    assert _wait_for(lambda: len(pauser.pids("born-inside")) == 3), pauser.pids("born-inside")
    for pid in pauser.pids("born-inside"):
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"Uid:\t{nobody.pw_uid}\t{nobody.pw_uid}\t{nobody.pw_uid}" in status
        assert sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]  # the procs fd is not held
    pauser.kill("born-inside")
    assert proc.wait(timeout=5) == -signal.SIGKILL


@needs_cgroup
def test_spawn_into_removed_cgroup_fails_cleanly(pauser: CgroupPauser) -> None:
    fd = pauser.open_procs_fd("vanished")
    try:
        pauser.release("vanished")
        with pytest.raises(SpawnError, match="joining its cgroup"):
            spawn(
                ["sleep", "60"],
                uid=os.geteuid(),
                gid=os.getegid(),
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
                log_path=None,
                cgroup_procs_fd=fd,
            )
    finally:
        os.close(fd)


@needs_cgroup
def test_attach_gone_pid_is_an_error(pauser: CgroupPauser, children: Children) -> None:
    proc = children.start(["true"])
    proc.wait(timeout=5)
    with pytest.raises(PauserError, match="no such process"):
        pauser.attach("gone", proc.pid)
    assert not pauser.path("gone").exists()  # a refused attach leaves nothing behind


@needs_cgroup
def test_attach_refuses_daemon_init_and_foreign_pids(
    pauser: CgroupPauser, children: Children
) -> None:
    for pid in (os.getpid(), 1):
        with pytest.raises(PauserError, match="init or the daemon"):
            pauser.attach("bad", pid)
    proc = children.start(["sleep", "60"], user=65534)
    with pytest.raises(PauserError, match="belongs to uid 65534"):
        pauser.attach("bad", proc.pid, owner_uid=0)
    assert pauser.clients() == {}
    pauser.attach("good", proc.pid, owner_uid=65534)
    assert pauser.pids("good") == [proc.pid]
    signals = SignalPauser()
    with pytest.raises(PauserError, match="belongs to uid 65534"):
        signals.attach("bad", proc.pid, owner_uid=0)
    with pytest.raises(PauserError, match="init or the daemon"):
        signals.attach("bad", 1)
    assert signals.clients() == {}
