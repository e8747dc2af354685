"""gpushare.node.cgroups against the real cgroup v2 hierarchy and real processes.

Every test that touches cgroupfs works under its own ``gpushare-test-<pid>-<rand>`` directory next to
this process's cgroup, and the fixture kills and removes everything under it at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from gpushare.model import PauseMechanism
from gpushare.node import signal_pauser
from gpushare.node.cgroups import pid_tracker
from gpushare.node.cgroups.choice import freezer_check, make_pauser
from gpushare.node.cgroups.discovery import (
    DAEMON_LEAF,
    DEFAULT_SUBTREE,
    cgroup2_mount,
    default_base_dir,
    is_delegated,
    move_self_to_leaf,
    own_cgroup,
)
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import FreezeTimeoutError, PauserError
from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.procs.identity import is_same_process
from gpushare.node.procs.spawning import SpawnError, spawn
from gpushare.node.signal_pauser import SignalPauser

BUSY = [sys.executable, "-c", "while True: pass"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


CGROUP_SKIP = cgroup_skip_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")


@pytest.fixture
def cg_base() -> Iterator[Path]:
    """A fresh directory beside this process's cgroup; killed and removed at teardown."""
    if CGROUP_SKIP is not None:
        pytest.skip(CGROUP_SKIP)
    base = unique_base("gpushare-test")
    yield base
    remove_tree(base)


@pytest.fixture
def pauser(cg_base: Path) -> CgroupPauser:
    # pids() read afresh on every call: these tests look at what the cgroup holds at each moment
    # (a transient subshell must be gone). Tracking pids on change has tests of its own below.
    return CgroupPauser(cg_base, freeze_timeout_s=2.0, pids_rescan_s=0.0)


class Children:
    """Processes started by a test; every one is killed and reaped at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    yield kids
    kids.cleanup()


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _cpu_over(pid: int, seconds: float) -> float:
    before = _cpu_s(pid)
    time.sleep(seconds)
    return _cpu_s(pid) - before


def _wait_running_cpu(pid: int, want_s: float = 0.05, limit_s: float = 10.0) -> float:
    # The machine is shared: wait for the child to get some CPU rather than assume a rate.
    start = _cpu_s(pid)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        gained = _cpu_s(pid) - start
        if gained >= want_s:
            return gained
    return _cpu_s(pid) - start


def _wait_for(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---------------------------------------------------------------------------------------------------
# Discovery (parsing fixtures: real file formats, written to disk)

HYBRID_MOUNTS = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_cgroup2_mount_finds_hybrid_unified(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(HYBRID_MOUNTS)
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")


def test_cgroup2_mount_unescapes_spaces(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\n")
    assert cgroup2_mount(mounts) == Path("/mnt/my cgroups")


def test_cgroup2_mount_none_on_v1_only_host(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/freezer cgroup rw,freezer 0 0\n")
    assert cgroup2_mount(mounts) is None
    assert cgroup2_mount(tmp_path / "missing") is None


def test_own_cgroup_joins_v2_line_to_mount(tmp_path: Path) -> None:
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/x\n0::/system.slice/gpushare.service\n")
    assert own_cgroup(Path("/sys/fs/cgroup"), cg) == Path(
        "/sys/fs/cgroup/system.slice/gpushare.service"
    )
    cg.write_text("1:cpu:/\n0::/\n")
    assert own_cgroup(Path("/sys/fs/cgroup/unified"), cg) == Path("/sys/fs/cgroup/unified")
    cg.write_text("1:cpu:/\n")
    assert own_cgroup(Path("/sys/fs/cgroup"), cg) is None


def test_real_mount_matches_proc_mounts() -> None:
    listed = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[2] == "cgroup2"
    ]
    found = cgroup2_mount()
    if not listed:
        assert found is None
    else:
        assert found == Path(listed[0].replace("\\040", " "))
        assert (found / "cgroup.procs").exists()
        own = own_cgroup(found)
        assert own is not None
        assert str(os.getpid()) in (own / "cgroup.procs").read_text().split()


def test_default_base_dir_layout(tmp_path: Path) -> None:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 filesystem is mounted")
    own = own_cgroup(mount)
    base = default_base_dir(mount)
    if own == mount:
        assert base == mount / DEFAULT_SUBTREE
    elif own is not None and own.name == DAEMON_LEAF:
        assert base == own.parent
    else:
        assert base == own


def test_bad_client_id_is_refused_and_creates_nothing(pauser: CgroupPauser) -> None:
    for bad in ["", "../escape", "a/b", ".hidden", "x" * 129, "sp ace"]:
        with pytest.raises(ValueError, match="cannot name a cgroup"):
            pauser.attach(bad, os.getpid())
    assert pauser.clients() == {}
    assert [p.name for p in pauser.base.iterdir() if p.is_dir()] == []


# ---------------------------------------------------------------------------------------------------
# The freezer on the real hierarchy


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
def test_move_self_to_leaf_in_subprocess(cg_base: Path, children: Children) -> None:
    # The daemon's situation under Delegate=yes: it starts in the base cgroup itself and must move
    # into a leaf before clients go beside it. Done in a child so the test runner stays put.
    CgroupPauser(cg_base)
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "import structlog\n"
        "structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))\n"
        "from gpushare.node.cgroups.discovery import default_base_dir, move_self_to_leaf, own_cgroup\n"
        "base = Path(sys.argv[1])\n"
        "(base / 'cgroup.procs').write_text(str(os.getpid()))\n"
        "before = own_cgroup()\n"
        "in_base_default = default_base_dir()\n"
        "moved = move_self_to_leaf(base)\n"
        "again = move_self_to_leaf(base)\n"
        "print(json.dumps([str(before), str(moved), str(again), str(own_cgroup()),\n"
        "                  str(default_base_dir()), str(in_base_default)]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = children.start(
        [sys.executable, "-c", script, str(cg_base)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    before, moved, again, after, default, in_base = json.loads(proc.stdout.readline())
    assert before == str(cg_base)
    assert moved == str(cg_base / "daemon")
    assert again == "None"
    assert after == str(cg_base / "daemon")
    assert default == str(cg_base)  # a daemon in its leaf still puts clients beside it
    assert in_base == str(cg_base)  # a daemon in its own (unit) cgroup puts clients there...
    assert (cg_base / "cgroup.procs").read_text() == ""
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=10)
    # ...and says that systemd did not delegate it (no trusted.delegate marker here).
    assert "cgroup_not_delegated" in proc.stderr.read().decode()


@needs_cgroup
def test_is_delegated_reads_systemds_marker(cg_base: Path) -> None:
    CgroupPauser(cg_base)
    assert not is_delegated(cg_base)
    try:
        os.setxattr(cg_base, "trusted.delegate", b"1")
    except OSError as exc:
        pytest.skip(f"cgroupfs here does not take trusted.* xattrs: {exc}")
    assert is_delegated(cg_base)


@needs_cgroup
def test_move_self_to_leaf_noop_outside_base(cg_base: Path) -> None:
    CgroupPauser(cg_base)
    assert move_self_to_leaf(cg_base) is None
    assert not (cg_base / "daemon").exists()


# ---------------------------------------------------------------------------------------------------
# make_pauser


@needs_cgroup
def test_make_pauser_picks_cgroup_when_writable(cg_base: Path) -> None:
    choice = make_pauser(cg_base)
    assert choice.pauser.mechanism is PauseMechanism.CGROUP
    assert isinstance(choice.pauser, CgroupPauser)
    assert str(cg_base) in choice.reason
    assert [p for p in cg_base.iterdir() if p.is_dir()] == []  # the probe cgroup is gone


@needs_cgroup
def test_freezer_check_changes_nothing(cg_base: Path, tmp_path: Path) -> None:
    ok, detail = freezer_check(cg_base)
    assert ok, detail
    assert str(cg_base) in detail
    assert not cg_base.exists()  # made for the check, removed again
    ok, detail = freezer_check(tmp_path / "x")
    assert not ok
    assert "not under the cgroup2 mount" in detail


def test_make_pauser_falls_back_outside_cgroupfs(tmp_path: Path) -> None:
    pauser, reason = make_pauser(tmp_path / "clients")
    assert pauser.mechanism is PauseMechanism.SIGNAL
    assert isinstance(pauser, SignalPauser)
    assert "not under the cgroup2 mount" in reason or "no cgroup2" in reason
    assert not (tmp_path / "clients").exists()


def test_make_pauser_falls_back_for_missing_parent() -> None:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 filesystem is mounted")
    base = mount / f"gpushare-no-such-{uuid.uuid4().hex[:8]}" / "clients"
    pauser, reason = make_pauser(base)
    assert pauser.mechanism is PauseMechanism.SIGNAL
    assert "does not exist" in reason
    assert not base.parent.exists()


def test_cgroup_pauser_refuses_plain_directory(tmp_path: Path) -> None:
    with pytest.raises(PauserError, match="not a cgroup v2 directory"):
        CgroupPauser(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Signal fallback


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def test_signal_pauser_stops_and_continues_group(children: Children) -> None:
    pauser = SignalPauser()
    script = "import os\nif os.fork() == 0:\n    while True: pass\nwhile True: pass\n"
    proc = children.start([sys.executable, "-c", script])
    assert pauser.pids("x") == []
    pauser.attach("x", proc.pid)
    assert _wait_for(lambda: len(pauser.pids("x")) == 2)
    members = list(pauser.pids("x"))
    assert _wait_running_cpu(members[1]) >= 0.05

    pauser.freeze("x")
    assert all(_state(pid) == "T" for pid in members)
    assert pauser.is_frozen("x")
    before = [_cpu_s(pid) for pid in members]
    time.sleep(0.4)
    frozen_delta = sum(_cpu_s(pid) for pid in members) - sum(before)
    assert frozen_delta <= 0.01

    pauser.thaw("x")
    assert not pauser.is_frozen("x")
    assert _wait_running_cpu(members[1]) >= 0.05

    pauser.kill("x")
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert _wait_for(lambda: all(_gone(pid) for pid in members))
    assert pauser.pids("x") == []
    pauser.release("x")
    assert pauser.clients() == {}


def test_signal_pauser_refuses_own_group() -> None:
    pauser = SignalPauser()
    same_group = subprocess.Popen(["sleep", "60"])  # no new session: our process group
    try:
        with pytest.raises(PauserError, match="daemon's own process group"):
            pauser.attach("me", same_group.pid)
    finally:
        same_group.kill()
        same_group.wait()
    with pytest.raises(PauserError, match="attach it first"):
        pauser.freeze("me")


def test_signal_pauser_gone_pid(children: Children) -> None:
    pauser = SignalPauser()
    proc = children.start(["true"])
    proc.wait(timeout=5)
    with pytest.raises(PauserError, match="no such process"):
        pauser.attach("gone", proc.pid)


def test_signal_pauser_readoption(children: Children) -> None:
    # A daemon restarted while a client was stopped: a new pauser attaches the recorded pid,
    # sees the group stopped and continues it.
    first = SignalPauser()
    proc = children.start(BUSY)
    first.attach("c", proc.pid)
    first.freeze("c")
    del first

    second = SignalPauser()
    assert second.clients() == {}
    second.attach("c", proc.pid)
    assert second.clients() == {"c": [proc.pid]}
    assert second.is_frozen("c")
    second.thaw("c")
    assert _wait_for(lambda: _state(proc.pid) != "T")
    assert _wait_running_cpu(proc.pid) >= 0.05


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
def test_configured_cgroup_base_is_used(cg_base: Path) -> None:
    from gpushare import config

    cfg = config.loads(f'[paths]\ncgroup_base = "{cg_base}"\n')
    assert cfg.paths.cgroup_base == cg_base
    pauser, reason = make_pauser(cfg.paths.cgroup_base)
    assert isinstance(pauser, CgroupPauser)
    assert pauser.base == cg_base
    assert str(cg_base) in reason


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


def test_signal_freeze_many(children: Children) -> None:
    pauser = SignalPauser()
    kids = [children.start(BUSY) for _ in range(2)]
    for i, kid in enumerate(kids):
        pauser.attach(f"s{i}", kid.pid)
    with pytest.raises(PauserError, match="attach it first"):
        pauser.freeze_many(["s0", "nope"])
    assert not pauser.is_frozen("s0")  # nothing was signalled
    pauser.freeze_many(["s0", "s1"])
    assert all(_state(k.pid) == "T" for k in kids)
    pauser.thaw_many(["s0", "s1"])
    assert _wait_for(lambda: all(_state(k.pid) != "T" for k in kids))


# Pids tracked on change (CgroupPauser.pids) ---------------------------------------------------

# Forks one child on the first line of input, then waits for a second line (so it outlives the child).
FORK_ON_LINE = ["sh", "-c", "read line; sleep 60 & read line"]


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


def test_signal_pauser_reads_proc_once_for_every_client(
    children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauser = SignalPauser(pids_rescan_s=0.2)
    shells = [children.start(FORK_ON_LINE, stdin=subprocess.PIPE) for _ in range(3)]
    for i, shell in enumerate(shells):
        pauser.attach(f"s{i}", shell.pid)
    passes: list[object] = []
    real = signal_pauser.groups_members

    def counting(pgids: object) -> dict[int, list[int]]:
        passes.append(pgids)
        return real(pgids)  # type: ignore[arg-type]

    monkeypatch.setattr(signal_pauser, "groups_members", counting)
    for i, shell in enumerate(shells):
        assert pauser.pids(f"s{i}") == [shell.pid]
    assert len(passes) == 1  # one pass over /proc answered all three
    stdin = shells[0].stdin
    assert stdin is not None
    stdin.write(b"go\n")
    stdin.flush()
    # The fork shows at the next pass, within pids_rescan_s.
    assert _wait_for(lambda: len(pauser.pids("s0")) == 2, timeout_s=3.0), pauser.pids("s0")
    assert pauser.pids("s1") == [shells[1].pid]


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
