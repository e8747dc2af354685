"""Spawning a client as its submitter (gpushare.node.procs.spawning), with real processes.

As another uid (root runs the suite): exactly that user's ids and groups and no capabilities, a
new session, the log file owned by the user and never one the daemon did not make for them, the
working directory entered as the user, the environment kept but systemd's notify variables
dropped, argv without a shell, and launch failures as exit codes with a reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.node.procs.identity import process_uid
from gpushare.node.procs.spawning import SpawnError, launch_failure, spawn
from tests.support.processes import Procs
from tests.support.processes import wait_for as _wait

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


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}


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
