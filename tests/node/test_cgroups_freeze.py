"""Freezing and thawing clients with CgroupPauser on the real cgroup v2 freezer.

A frozen busy process uses no CPU and a thawed one runs again, children forked later included;
a freeze that misses its deadline, an unknown client, and freezing or thawing several at once.
Each test works under its own cgroup (``cg_base`` in conftest.py), removed at teardown.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import FreezeTimeoutError, PauserError
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import BUSY, Children
from tests.support.processes import cpu_over as _cpu_over
from tests.support.processes import cpu_s as _cpu_s
from tests.support.processes import wait_for as _wait_for
from tests.support.processes import wait_running_cpu as _wait_running_cpu


@needs_cgroup
def test_freeze_stops_and_thaw_resumes_busy_child(pauser: CgroupPauser, children: Children) -> None:
    proc = children.start(BUSY)
    pauser.attach("busy", proc.pid)
    assert pauser.pids("busy") == [proc.pid]
    assert _wait_running_cpu(proc.pid) >= 0.05, "busy child never got CPU"

    pauser.freeze("busy")
    assert pauser.is_frozen("busy")
    assert (pauser.path("busy") / "cgroup.events").read_text().split("frozen ")[1][0] == "1"
    frozen_cpu = _cpu_over(proc.pid, 0.5)

    pauser.thaw("busy")
    assert not pauser.is_frozen("busy")
    thawed_cpu = _wait_running_cpu(proc.pid, want_s=0.05)

    # One 10 ms clock tick of slack for the accounting; a running busy loop gets far more.
    assert frozen_cpu <= 0.01, f"frozen child used {frozen_cpu:.3f} s CPU in 0.5 s"
    assert thawed_cpu >= 0.05, f"thawed child used only {thawed_cpu:.3f} s CPU"
    assert proc.poll() is None


@needs_cgroup
def test_freeze_covers_children_forked_later(pauser: CgroupPauser, children: Children) -> None:
    # The parent forks a busy child after attach: cgroup membership is inherited.
    script = (
        "import os, sys, time\n"
        "sys.stdin.readline()\n"
        "if os.fork() == 0:\n"
        "    while True: pass\n"
        "time.sleep(60)\n"
    )
    proc = children.start([sys.executable, "-c", script], stdin=subprocess.PIPE)
    pauser.attach("tree", proc.pid)
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert _wait_for(lambda: len(pauser.pids("tree")) == 2)
    kid = next(p for p in pauser.pids("tree") if p != proc.pid)
    assert _wait_running_cpu(kid) >= 0.05
    pauser.freeze("tree")
    assert _cpu_over(kid, 0.4) <= 0.01
    pauser.thaw("tree")
    assert _wait_running_cpu(kid) >= 0.05


@needs_cgroup
def test_freeze_timeout_when_events_never_flip(pauser: CgroupPauser, children: Children) -> None:
    # A zero deadline cannot be met by a running busy task; the error says what happened and the
    # request stays in place, so a later thaw is what cancels it.
    proc = children.start(BUSY)
    pauser.attach("slow", proc.pid)
    quick = CgroupPauser(pauser.base, freeze_timeout_s=0.0)
    timed_out = False
    try:
        quick.freeze("slow")
    except FreezeTimeoutError as exc:
        timed_out = "not frozen" in str(exc)
    # The kernel may freeze it before our first read: allowed, but then it must be real.
    assert timed_out or quick.is_frozen("slow")
    assert (pauser.path("slow") / "cgroup.freeze").read_text().strip() == "1"
    pauser.thaw("slow")
    assert not pauser.is_frozen("slow")


@needs_cgroup
def test_freeze_unknown_client_is_an_error(pauser: CgroupPauser) -> None:
    with pytest.raises(PauserError, match="attach it first"):
        pauser.freeze("nobody-here")
    with pytest.raises(PauserError, match="attach it first"):
        pauser.thaw("nobody-here")
    assert not pauser.is_frozen("nobody-here")


@needs_cgroup
def test_freeze_many_and_thaw_many(pauser: CgroupPauser, children: Children) -> None:
    kids = [children.start(BUSY) for _ in range(3)]
    for i, kid in enumerate(kids):
        pauser.attach(f"m{i}", kid.pid)
    ids = [f"m{i}" for i in range(3)]
    pauser.freeze_many(ids)
    assert all(pauser.is_frozen(cid) for cid in ids)
    before = [_cpu_s(k.pid) for k in kids]
    time.sleep(0.4)
    assert all(_cpu_s(k.pid) - b <= 0.01 for k, b in zip(kids, before, strict=True))
    pauser.thaw_many(ids)
    assert not any(pauser.is_frozen(cid) for cid in ids)
    assert all(_wait_running_cpu(k.pid, want_s=0.03) >= 0.03 for k in kids)

    # An unknown client is named; the known ones are still frozen.
    with pytest.raises(PauserError, match="absent"):
        pauser.freeze_many(["m0", "absent", "m2"])
    assert pauser.is_frozen("m0")
    assert pauser.is_frozen("m2")
    assert not pauser.is_frozen("m1")
    with pytest.raises(ValueError, match="cannot name a cgroup"):
        pauser.thaw_many(["m0", "../x"])
    assert pauser.is_frozen("m0")  # a bad id changes nothing
    pauser.thaw_many(["m0", "m2"])
    assert not pauser.is_frozen("m0")
