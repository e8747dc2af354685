"""gpushare.node.procs with real processes: spawning as another uid, identity, exit noticing."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.procs.identity import (
    descendants,
    group_members,
    is_same_process,
    is_stopped,
    process_start_time,
    process_uid,
)
from gpushare.node.procs.spawning import SpawnError, launch_failure, spawn
from gpushare.node.procs.users import user_groups, user_in_group, user_name

NOBODY_UID = 65534


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwuid(NOBODY_UID)
    except KeyError:
        pytest.skip(f"this machine has no passwd entry for uid {NOBODY_UID} (nobody)")
    return entry.pw_uid, entry.pw_gid


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to another uid needs root (run the suite as root)"
)


class Procs:
    """Every process a test starts, killed (group first) and reaped at teardown."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = []

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.popens.append(proc)
        return proc

    def cleanup(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(ChildProcessError):
                proc.wait(timeout=10)


@pytest.fixture
def started() -> Iterator[Procs]:
    kids = Procs()
    yield kids
    kids.cleanup()


@pytest.fixture
def watcher() -> Iterator[ExitWatcher]:
    w = ExitWatcher().start()
    yield w
    w.stop()


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}


# ---------------------------------------------------------------------------------------------------
# Spawning


@needs_root
def test_spawn_as_nobody_has_its_ids_groups_and_no_more(tmp_path: Path, started: Procs) -> None:
    uid, gid = _nobody()
    log_path = tmp_path / "client.log"
    proc = started.add(
        spawn(["sleep", "30"], uid=uid, gid=gid, cwd="/", env=_env(), log_path=log_path)
    )
    status = _status(proc.pid)
    assert status["Uid"].split() == [str(uid)] * 4  # real, effective, saved, filesystem
    assert status["Gid"].split() == [str(gid)] * 4
    assert sorted(int(g) for g in status["Groups"].split()) == sorted(
        set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    )
    assert status["CapEff"] == status["CapPrm"] == status["CapAmb"] == "0000000000000000"
    assert os.getsid(proc.pid) == proc.pid  # new session, own process group
    assert os.getpgid(proc.pid) == proc.pid
    assert os.readlink(f"/proc/{proc.pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{proc.pid}/fd/1") == str(log_path)
    assert os.readlink(f"/proc/{proc.pid}/fd/2") == str(log_path)
    assert process_uid(proc.pid) == uid
    # env(1) entered the directory and exec'd the workload in the same process.
    assert _wait(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes() == b"sleep\x0030\x00")
    assert os.readlink(f"/proc/{proc.pid}/cwd") == "/"


@needs_root
def test_spawn_explicit_groups(started: Procs) -> None:
    uid, gid = _nobody()
    extra = 4242  # a gid need not have a group entry to be held
    proc = started.add(
        spawn(
            ["sleep", "30"],
            uid=uid,
            gid=gid,
            groups=[gid, extra],
            cwd="/",
            env=_env(),
            log_path=None,
        )
    )
    assert sorted(int(g) for g in _status(proc.pid)["Groups"].split()) == sorted({gid, extra})
    assert os.readlink(f"/proc/{proc.pid}/fd/1") == "/dev/null"


@needs_root
def test_spawned_nobody_cannot_read_root_only_file(world_dir: Path) -> None:
    uid, gid = _nobody()
    for mode, code in [(0o600, 1), (0o644, 0)]:  # the 0644 run is the control
        secret = world_dir / f"secret-{mode:o}"
        secret.write_text("root's data\n")
        secret.chmod(mode)
        log_path = world_dir / f"out-{mode:o}.log"
        proc = spawn(["cat", str(secret)], uid=uid, gid=gid, cwd="/", env=_env(), log_path=log_path)
        assert proc.wait(timeout=10) == code
        assert ("root's data" in log_path.read_text()) == (code == 0)


@needs_root
def test_spawn_log_file_gets_stdout_and_stderr_owned_by_user(tmp_path: Path) -> None:
    uid, gid = _nobody()
    log_path = tmp_path / "client.log"
    argv = ["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 7"]
    proc = spawn(argv, uid=uid, gid=gid, cwd="/", env=_env(), log_path=log_path)
    assert proc.wait(timeout=10) == 7
    info = log_path.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (uid, gid, 0o600)
    # A relaunch of the same user's client appends to the log it left.
    spawn(argv, uid=uid, gid=gid, cwd="/", env=_env(), log_path=log_path).wait(timeout=10)
    assert log_path.read_text() == "to-stdout\nto-stderr\n" * 2


@needs_root
def test_a_log_the_daemon_did_not_make_for_this_user_is_never_used(tmp_path: Path) -> None:
    # Issue 27: after a registry reset a new c1 of another user was handed root's c1.log, chowned.
    uid, gid = _nobody()
    old = tmp_path / "c1.log"
    old.write_text("root's output\n")
    old.chmod(0o600)
    with pytest.raises(SpawnError, match="not this user's"):
        spawn(["true"], uid=uid, gid=gid, cwd="/", env=_env(), log_path=old)
    info = old.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), old.read_text()) == (
        0,
        0o600,
        "root's output\n",
    )
    # Nor through a symlink, nor a hard link to someone else's file.
    (tmp_path / "link.log").symlink_to(old)
    (tmp_path / "hard.log").hardlink_to(old)
    for name in ("link.log", "hard.log"):
        with pytest.raises(SpawnError):
            spawn(["true"], uid=0, gid=0, cwd="/", env=_env(), log_path=tmp_path / name)
    assert old.read_text() == "root's output\n"


def test_spawn_strips_notify_vars_and_keeps_env(tmp_path: Path) -> None:
    log_path = tmp_path / "env.log"
    env = {
        **_env(),
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "1000000",
        "WATCHDOG_PID": "1",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpushare/mps/GPU-x",
    }
    proc = spawn(
        ["env"], uid=os.geteuid(), gid=os.getegid(), cwd=tmp_path, env=env, log_path=log_path
    )
    assert proc.wait(timeout=10) == 0
    lines = set(log_path.read_text().splitlines())
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/gpushare/mps/GPU-x" in lines
    assert "LANG=C" in lines
    assert not any(line.split("=")[0] in procs_notify_vars() for line in lines)


def procs_notify_vars() -> set[str]:
    return {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"}


def test_spawn_uses_cwd_and_argv_without_shell(tmp_path: Path) -> None:
    log_path = tmp_path / "argv.log"
    weird = "$(touch pwned); `id` ; *"
    proc = spawn(
        ["sh", "-c", 'pwd; printf "%s\\n" "$1"', "sh", weird],
        uid=os.geteuid(),
        gid=os.getegid(),
        cwd=tmp_path,
        env=_env(),
        log_path=log_path,
    )
    assert proc.wait(timeout=10) == 0
    assert log_path.read_text().splitlines() == [str(tmp_path), weird]
    assert not (tmp_path / "pwned").exists()


def test_spawn_bad_input_is_refused(tmp_path: Path) -> None:
    me = {"uid": os.geteuid(), "gid": os.getegid(), "env": _env(), "log_path": None}
    with pytest.raises(ValueError, match="empty command"):
        spawn([], cwd=tmp_path, **me)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="absolute"):
        spawn(["true"], cwd="relative/dir", **me)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contains '='"):
        spawn(["A=B", "true"], cwd=tmp_path, **me)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "cwd_name", "code", "message"),
    [
        (["no-such-program-xyz"], ".", 127, "No such file or directory"),
        (["true"], "missing", 125, "cannot change directory"),
        (["./noexec.sh"], ".", 126, "Permission denied"),
    ],
)
def test_spawn_launch_failures_are_exit_codes_with_reason(
    tmp_path: Path, argv: list[str], cwd_name: str, code: int, message: str
) -> None:
    (tmp_path / "noexec.sh").write_text("#!/bin/sh\n")
    log_path = tmp_path / "client.log"
    proc = spawn(
        argv,
        uid=os.geteuid(),
        gid=os.getegid(),
        cwd=tmp_path / cwd_name,
        env=_env(),
        log_path=log_path,
    )
    assert proc.wait(timeout=10) == code
    assert message in log_path.read_text()
    reason = launch_failure(code)
    assert reason is not None
    assert launch_failure(0) is None
    assert launch_failure(None) is None


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A temporary directory every user may traverse (pytest's own tree is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="gpushare-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
@pytest.mark.parametrize(("locked_mode", "code"), [(0o700, 125), (0o755, 0)])
def test_spawn_enters_cwd_as_the_user(world_dir: Path, locked_mode: int, code: int) -> None:
    # cwd inside a directory nobody may traverse: entering it as root first would let the
    # workload read files there through relative paths. The 0755 case is the control.
    uid, gid = _nobody()
    locked = world_dir / "locked"
    inner = locked / "inner"
    inner.mkdir(parents=True)
    locked.chmod(locked_mode)
    inner.chmod(0o755)
    (inner / "secret").write_text("readable file\n")
    (inner / "secret").chmod(0o644)
    log_path = world_dir / "client.log"
    proc = spawn(["cat", "secret"], uid=uid, gid=gid, cwd=inner, env=_env(), log_path=log_path)
    assert proc.wait(timeout=10) == code
    if code:
        assert "readable file" not in log_path.read_text()
        assert "Permission denied" in log_path.read_text()
    else:
        assert log_path.read_text() == "readable file\n"


def test_spawn_log_dir_missing(tmp_path: Path) -> None:
    with pytest.raises(SpawnError, match="client_log_dir"):
        spawn(
            ["true"],
            uid=os.geteuid(),
            gid=os.getegid(),
            cwd=tmp_path,
            env=_env(),
            log_path=tmp_path / "no-such-dir" / "client.log",
        )


def test_spawn_log_refuses_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep\n")
    link = tmp_path / "client.log"
    link.symlink_to(target)
    with pytest.raises(SpawnError, match="cannot open client log"):
        spawn(
            ["true"],
            uid=os.geteuid(),
            gid=os.getegid(),
            cwd=tmp_path,
            env=_env(),
            log_path=link,
        )
    assert target.read_text() == "keep\n"


@needs_root
def test_spawn_refuses_other_uid_when_not_root(tmp_path: Path) -> None:
    uid, gid = _nobody()
    # Become nobody (effective ids only) for the call, as a daemon not running as root would be.
    os.setegid(gid)
    os.seteuid(uid)
    try:
        with pytest.raises(SpawnError, match="must run as root"):
            spawn(["true"], uid=0, gid=0, cwd="/", env=_env(), log_path=None)
    finally:
        os.seteuid(0)
        os.setegid(0)


# ---------------------------------------------------------------------------------------------------
# Users and groups


def test_user_name_and_groups() -> None:
    root = pwd.getpwuid(0)
    assert user_name(0) == root.pw_name
    unused = max(e.pw_uid for e in pwd.getpwall()) + 12345
    assert user_name(unused) == str(unused)
    primary = grp.getgrgid(root.pw_gid).gr_name
    assert user_in_group(0, primary)
    assert not user_in_group(0, "no-such-group-xyz")
    assert not user_in_group(unused, primary)
    assert user_groups(unused, 4242) == [4242]
    assert user_groups(0, root.pw_gid)[0] == root.pw_gid


def test_user_in_group_supplementary_only() -> None:
    # Find a real (user, group) pair where the group is supplementary, from this machine's files.
    for group in grp.getgrall():
        for member in group.gr_mem:
            try:
                entry = pwd.getpwnam(member)
            except KeyError:
                continue
            if entry.pw_gid != group.gr_gid:
                assert user_in_group(entry.pw_uid, group.gr_name)
                others = [
                    g.gr_name
                    for g in grp.getgrall()
                    if g.gr_gid not in os.getgrouplist(member, entry.pw_gid)
                ]
                if others:
                    assert not user_in_group(entry.pw_uid, others[0])
                return
    pytest.skip("no user on this machine has a supplementary group listed in /etc/group")


# ---------------------------------------------------------------------------------------------------
# Identity


def test_start_time_identity(started: Procs) -> None:
    proc = started.add(subprocess.Popen(["sleep", "30"]))
    start = process_start_time(proc.pid)
    assert start is not None
    assert abs(start - psutil.Process(proc.pid).create_time()) < 1e-6
    assert abs(start - time.time()) < 60
    assert is_same_process(proc.pid, start)
    assert not is_same_process(proc.pid, start - 5.0)  # a recycled pid started at another time
    proc.kill()
    # A zombie has finished: not the live process any more.
    assert _wait(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    assert not is_same_process(proc.pid, start)
    proc.wait()
    assert process_start_time(proc.pid) is None
    assert not is_same_process(proc.pid, start)


def test_identity_of_missing_records() -> None:
    for pid in (0, -1):
        assert process_start_time(pid) is None
        assert not is_same_process(pid, time.time())
        assert process_uid(pid) is None
        assert descendants(pid) == []
    assert not is_same_process(os.getpid(), None)
    assert is_same_process(os.getpid(), process_start_time(os.getpid()))


def test_descendants_and_group_members(started: Procs) -> None:
    proc = started.add(
        subprocess.Popen(
            ["sh", "-c", "sleep 30 & sleep 30 & wait"],
            start_new_session=True,
        )
    )
    assert _wait(lambda: len(descendants(proc.pid)) == 2)
    assert group_members(proc.pid) == sorted([proc.pid, *descendants(proc.pid)])
    assert group_members(os.getpgrp()) != group_members(proc.pid)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert _wait(lambda: all(is_stopped(p) for p in group_members(proc.pid)))
    os.killpg(proc.pid, signal.SIGCONT)
    assert _wait(lambda: not is_stopped(proc.pid))


def _wait(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------------------------------------------
# ExitWatcher


def test_watcher_reports_child_exit_codes(watcher: ExitWatcher, started: Procs) -> None:
    ok = started.add(subprocess.Popen(["sh", "-c", "exit 0"]))
    three = started.add(subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"]))
    killed = started.add(subprocess.Popen(["sleep", "30"]))
    for proc in (ok, three, killed):
        watcher.watch(proc)
    killed.send_signal(signal.SIGTERM)
    got = {watcher.exits.get(timeout=10) for _ in range(3)}
    assert got == {(ok.pid, 0), (three.pid, 3), (killed.pid, -signal.SIGTERM)}
    assert watcher.watched() == []
    assert three.returncode == 3  # reaped through the Popen, which keeps its code


def test_watcher_reaps_child_given_by_pid(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 0.1; exit 5"])
    watcher.watch(proc.pid)
    assert watcher.exits.get(timeout=10) == (proc.pid, 5)
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # already reaped: no zombie left behind


def test_watcher_child_already_exited(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 9"])
    assert _wait(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    watcher.watch(proc)
    assert watcher.exits.get(timeout=10) == (proc.pid, 9)


def _grandchild(started: Procs, seconds: float = 30) -> int:
    """Start a process that is not our child (its parent exits at once) and return its pid."""
    out = subprocess.run(
        ["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    pid = int(out.stdout.strip())
    started.pids.append(pid)
    return pid


def test_watcher_notices_non_child_exit_promptly(watcher: ExitWatcher, started: Procs) -> None:
    pid = _grandchild(started)
    assert psutil.Process(pid).ppid() != os.getpid()
    start = process_start_time(pid)
    assert start is not None
    assert watcher.watch(pid, start_time=start)
    time.sleep(0.2)
    assert watcher.exits.empty()  # still running: nothing reported
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    got = watcher.exits.get(timeout=5)
    noticed_s = time.monotonic() - t0
    # Unknown (None) once its reaper was faster than us, else read from the zombie.
    assert got in {(pid, None), (pid, -signal.SIGKILL)}
    # Generous bound: event-driven noticing is sub-millisecond; polling every few seconds fails.
    assert noticed_s < 2.0


def test_watcher_non_child_recycled_or_gone(watcher: ExitWatcher, started: Procs) -> None:
    pid = _grandchild(started)
    start = process_start_time(pid)
    assert start is not None
    assert not watcher.watch(pid, start_time=start - 10.0)  # recorded start differs
    assert watcher.exits.get(timeout=5) == (pid, None)
    assert watcher.watched() == []

    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not watcher.watch(proc.pid)  # gone and reaped before watch: reported at once
    assert watcher.exits.get(timeout=5) == (proc.pid, None)


def test_watcher_unwatch_and_stop(started: Procs) -> None:
    got: list[tuple[int, int | None]] = []
    done = threading.Event()

    def on_exit(pid: int, code: int | None) -> None:
        got.append((pid, code))
        done.set()

    w = ExitWatcher(on_exit).start()
    try:
        quiet = started.add(subprocess.Popen(["sleep", "30"]))
        loud = started.add(subprocess.Popen(["sleep", "30"]))
        w.watch(quiet)
        w.watch(loud)
        w.unwatch(quiet.pid)
        quiet.kill()
        loud.kill()
        assert done.wait(5)
        time.sleep(0.1)
        assert got == [(loud.pid, -signal.SIGKILL)]
    finally:
        w.stop()
    assert not w._thread.is_alive()
    assert w.watched() == []


def test_watcher_survives_failing_callback(started: Procs) -> None:
    seen: queue.Queue[int] = queue.Queue()

    def on_exit(pid: int, code: int | None) -> None:
        seen.put(pid)
        raise RuntimeError("callback bug")

    w = ExitWatcher(on_exit).start()
    try:
        a = started.add(subprocess.Popen(["true"]))
        w.watch(a)
        assert seen.get(timeout=5) == a.pid
        b = started.add(subprocess.Popen(["true"]))
        w.watch(b)
        assert seen.get(timeout=5) == b.pid  # still watching after the first callback raised
    finally:
        w.stop()


def test_watcher_many_processes(watcher: ExitWatcher, started: Procs) -> None:
    kids = [
        started.add(subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({i})"]))
        for i in range(20)
    ]
    for kid in kids:
        watcher.watch(kid)
    got = dict(watcher.exits.get(timeout=20) for _ in kids)
    assert got == {kid.pid: i for i, kid in enumerate(kids)}


def test_watcher_thread_sleeps_while_nothing_exits(watcher: ExitWatcher, started: Procs) -> None:
    # Exit noticing is event-driven: a watcher with live processes uses no CPU while they run.
    for _ in range(5):
        watcher.watch(started.add(subprocess.Popen(["sleep", "30"])))
    native_id = watcher._thread.native_id

    def thread_cpu() -> float:
        for t in psutil.Process().threads():
            if t.id == native_id:
                return t.user_time + t.system_time
        raise AssertionError("watcher thread not found")

    before = thread_cpu()
    time.sleep(1.0)
    assert thread_cpu() - before <= 0.01
    assert len(watcher.watched()) == 5
    assert watcher.exits.empty()


@pytest.mark.parametrize(("how", "code"), [("exit 4", 4), ("kill -9 $$", -signal.SIGKILL)])
def test_watcher_reads_code_of_unreaped_non_child(
    watcher: ExitWatcher, started: Procs, how: str, code: int
) -> None:
    # The grandchild finishes while its parent (now `sleep 5`, which never waits) keeps it a
    # zombie: its status is still in /proc and the watcher reports it.
    parent = started.add(
        subprocess.Popen(
            ["sh", "-c", f"sh -c 'sleep 0.3; {how}' & echo $!; exec sleep 5"],
            stdout=subprocess.PIPE,
        )
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert psutil.Process(pid).ppid() == parent.pid
    watcher.watch(pid)
    assert watcher.exits.get(timeout=5) == (pid, code)


def test_watcher_popen_already_waited(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 6"])
    assert proc.wait(timeout=10) == 6
    watcher.watch(proc)
    assert watcher.exits.get(timeout=5) == (proc.pid, 6)
    assert watcher.watched() == []


def test_watcher_refuses_watch_after_stop() -> None:
    w = ExitWatcher().start()
    w.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        w.watch(os.getpid())
