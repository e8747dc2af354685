"""Re-adopting clients after a daemon restart with CgroupPauser on the real hierarchy.

A new pauser finds the clients an old one left (frozen or running), a client outlives its killed
daemon and is watched and killed by the next one, and a populated cgroup this pauser did not make
is never joined by a new client of the same id (issue 27).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.procs.identity import is_same_process
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import BUSY, SLEEPER, Children
from tests.support.processes import wait_running_cpu as _wait_running_cpu


@needs_cgroup
def test_readoption_after_restart(cg_base: Path, children: Children) -> None:
    # One pauser "dies" with a frozen client; a new one over the same base sees it, attaches the
    # recorded pid again and can thaw and kill it.
    first = CgroupPauser(cg_base)
    proc = children.start(BUSY)
    first.attach("survivor", proc.pid)
    first.freeze("survivor")
    del first

    second = CgroupPauser(cg_base)
    assert second.clients() == {"survivor": [proc.pid]}
    assert second.is_frozen("survivor")
    second.attach("survivor", proc.pid)
    second.thaw("survivor")
    assert _wait_running_cpu(proc.pid) >= 0.05
    second.kill("survivor")
    assert proc.wait(timeout=5) == -signal.SIGKILL
    second.release("survivor")
    assert second.clients() == {}


@needs_cgroup
def test_daemon_killed_then_new_daemon_readopts(cg_base: Path, children: Children) -> None:
    # A stand-in "daemon" process spawns a client into its cgroup, reports pid and start time,
    # and dies by SIGKILL. The client keeps running; this process then re-adopts it the way the
    # restarted daemon does: identity check, cgroup membership, pidfd exit watching.
    script = (
        "import json, os, sys, time\n"
        "from pathlib import Path\n"
        "import structlog\n"
        "structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))\n"
        "from gpushare.node.cgroups.pauser import CgroupPauser\n"
        "from gpushare.node.procs.identity import process_start_time\n"
        "from gpushare.node.procs.spawning import spawn\n"
        "pauser = CgroupPauser(Path(sys.argv[1]))\n"
        "fd = pauser.open_procs_fd('c1')\n"
        "proc = spawn(['sleep', '60'], uid=0, gid=0, cwd='/', env={'PATH': '/usr/bin:/bin'},\n"
        "             log_path=None, cgroup_procs_fd=fd)\n"
        "os.close(fd)\n"
        "print(json.dumps([proc.pid, process_start_time(proc.pid)]), flush=True)\n"
        "time.sleep(60)\n"
    )
    old = children.start([sys.executable, "-c", script, str(cg_base)], stdout=subprocess.PIPE)
    assert old.stdout is not None
    pid, start = json.loads(old.stdout.readline())
    os.kill(old.pid, signal.SIGKILL)
    assert old.wait(timeout=5) == -signal.SIGKILL
    try:
        assert is_same_process(pid, start), "the client must survive its daemon"
        assert psutil.Process(pid).ppid() != old.pid

        pauser = CgroupPauser(cg_base)
        assert pauser.clients() == {"c1": [pid]}
        pauser.attach("c1", pid)
        watcher = ExitWatcher().start()
        try:
            watcher.watch(pid, start_time=start)
            pauser.freeze("c1")
            assert pauser.is_frozen("c1")
            pauser.thaw("c1")
            assert watcher.exits.empty()
            pauser.kill("c1")
            # Not our child: the code is unknown (None) unless its reaper was slower than us.
            assert watcher.exits.get(timeout=5) in {(pid, None), (pid, -signal.SIGKILL)}
        finally:
            watcher.stop()
        pauser.release("c1")
        assert pauser.clients() == {}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@needs_cgroup
def test_a_populated_cgroup_this_pauser_did_not_make_is_never_joined(
    cg_base: Path, children: Children
) -> None:
    # Issue 27: after a registry reset, a new c1 joined the live cgroup of an old c1 (another
    # user's), so its pause froze and its cancel killed the old client's processes.
    before = CgroupPauser(cg_base, pids_rescan_s=0.0)  # the daemon before its restart
    old = children.start(SLEEPER)
    before.attach("c1", old.pid)
    after = CgroupPauser(cg_base, pids_rescan_s=0.0)  # the daemon after it
    new = children.start(SLEEPER)
    with pytest.raises(PauserError, match="did not start for c1"):
        after.attach("c1", new.pid)
    with pytest.raises(PauserError, match="did not start for c1"):
        after.open_procs_fd("c1")
    assert after.members("c1") == [old.pid]
    # The recorded process itself is taken back (re-adoption), and then the cgroup is its.
    after.attach("c1", old.pid)
    os.close(after.open_procs_fd("c1"))
    # An empty leftover is made anew: a frozen one would freeze whatever joins it.
    after.kill("c1")
    old.wait(timeout=5)
    (after.path("c1") / "cgroup.freeze").write_text("1")
    fresh = CgroupPauser(cg_base, pids_rescan_s=0.0)
    fresh.attach("c1", new.pid)
    assert (fresh.path("c1") / "cgroup.freeze").read_text().strip() == "0"
    assert fresh.members("c1") == [new.pid]
