"""MpsSupervisor's life with its control daemon, on the real MPS control binary.

The binary is nvidia-cuda-mps-control 535.261.03, which runs without a GPU. Start, ready and stop
leaving nothing behind, the daemon's environment, restarts after a kill or a hang with the defaults
re-applied, a removed or stale pipe directory, adopting a running daemon, detaching, and recovering
a server fault that has already cleared.

Every fixture (tests/node/conftest.py) stops what it started: supervisors are stopped, and any
process whose environment still names a test's pipe directory is killed in teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from gpushare.config import Config
from gpushare.model import MpsEventKind, MpsState
from gpushare.node.mps import DaemonNotReachable, MpsControl, MpsSupervisor
from tests.support.mps_real import GIB, GPU_A
from tests.support.mps_real import events as _events
from tests.support.mps_real import procs_using as _procs_using
from tests.support.mps_real import wait_event as _wait_event
from tests.support.mps_real import wait_until as _wait_until

# Daemon output is logged at debug from background threads: quiet_logs (conftest.py) keeps the
# test output readable.
pytestmark = [pytest.mark.mps, pytest.mark.usefixtures("quiet_logs")]


def _answers(ctl: MpsControl, value: float) -> bool:
    try:
        return ctl.get_default_active_thread_percentage() == value
    except DaemonNotReachable:
        return False


def test_start_ready_stop_leaves_nothing(make_supervisor: Callable[..., MpsSupervisor]) -> None:
    s = make_supervisor()
    q = _events(s)
    s.start()
    assert s.state() is MpsState.UP
    pid = s.child_pid
    assert pid is not None
    assert psutil.pid_exists(pid)
    assert stat.S_ISSOCK((s.pipe_dir / "control").stat().st_mode)
    for d in (s.pipe_dir, s.log_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
    # The configured default was applied before start() returned.
    assert s.control.get_default_active_thread_percentage() == 40.0
    assert _wait_event(q, MpsEventKind.DAEMON_STARTED).text == "started"
    env = psutil.Process(pid).environ()
    assert env["CUDA_VISIBLE_DEVICES"] == GPU_A
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(s.pipe_dir)
    assert "NOTIFY_SOCKET" not in env

    s.stop()
    assert s.state() is MpsState.DOWN
    assert not psutil.pid_exists(pid)
    assert _procs_using(s.pipe_dir) == []
    assert list(s.pipe_dir.iterdir()) == []
    exited = _wait_event(q, MpsEventKind.DAEMON_EXITED)
    assert exited.status == 0
    with pytest.raises(DaemonNotReachable):
        s.control.get_server_list()


def test_child_env_drops_notify_and_bad_defaults(
    make_supervisor: Callable[..., MpsSupervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000")
    # The daemon refuses to start with a bad value here; the supervisor must not pass it on.
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "250")
    s = make_supervisor()
    s.start()
    pid = s.child_pid
    assert pid is not None
    env = psutil.Process(pid).environ()
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        assert name not in env


def test_kill_9_restarts_with_defaults_within_2s(
    make_supervisor: Callable[..., MpsSupervisor],
) -> None:
    s = make_supervisor(pinned_limits={0: "2G"}, client_priority=1)
    s.start()
    q = _events(s)
    old = s.child_pid
    assert old is not None
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    assert _wait_event(q, MpsEventKind.DAEMON_EXITED).status == -signal.SIGKILL
    # DAEMON_RESTARTED is emitted once the new daemon answers and the defaults are re-applied.
    _wait_event(q, MpsEventKind.DAEMON_RESTARTED, timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0
    assert s.child_pid not in (None, old)
    # A fresh daemon starts at 100 / no limit / priority 0: these came from the re-apply.
    assert s.control.get_default_active_thread_percentage() == 40.0
    assert s.control.get_default_device_pinned_mem_limit(0) == 2 * GIB
    assert s.control.get_default_client_priority() == 1
    _wait_until(lambda: s.state() is MpsState.UP, 1.0)
    assert s.restarts == 1


def test_silent_daemon_is_replaced(
    make_supervisor: Callable[..., MpsSupervisor], make_config: Callable[..., Config]
) -> None:
    s = make_supervisor(config=make_config(command_timeout_s=0.3))
    s.start()
    old = s.child_pid
    assert old is not None
    os.kill(old, signal.SIGSTOP)  # alive, holding its socket, but answering nothing
    _wait_until(lambda: s.child_pid not in (None, old) and _answers(s.control, 40.0), 4.0)
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE


def test_removed_pipe_dir_is_recreated(sup: MpsSupervisor) -> None:
    old = sup.child_pid
    shutil.rmtree(sup.pipe_dir)
    _wait_until(lambda: sup.child_pid not in (None, old) and _answers(sup.control, 40.0), 2.0)
    assert stat.S_ISSOCK((sup.pipe_dir / "control").stat().st_mode)


def test_stale_pipe_dir_is_cleaned(
    make_supervisor: Callable[..., MpsSupervisor], mps_control: Path
) -> None:
    s = make_supervisor()
    s.pipe_dir.mkdir(parents=True)
    s.log_dir.mkdir(parents=True)
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(s.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(s.log_dir),
    }
    stale = subprocess.Popen([str(mps_control), "-f"], env=env, stdout=subprocess.DEVNULL)
    entries = {"control", "control_privileged", "control_lock", "log"}
    try:
        # The daemon makes the log FIFO before its sockets: wait for all of them (on a loaded
        # machine the kill could otherwise come between the two).
        _wait_until(lambda: entries <= {p.name for p in s.pipe_dir.iterdir()}, 5.0)
    finally:
        stale.kill()
        stale.wait()
    # What a SIGKILLed daemon leaves: sockets, the lock file and the log FIFO.
    left = {p.name for p in s.pipe_dir.iterdir()}
    assert entries <= left
    (s.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(str(stale.pid))
    s.start()
    assert not (s.pipe_dir / "nvidia-cuda-mps-control.pid").exists()
    assert s.control.get_default_active_thread_percentage() == 40.0
    s.stop()
    assert list(s.pipe_dir.iterdir()) == []


def test_running_daemon_is_adopted_and_quit(
    make_supervisor: Callable[..., MpsSupervisor], mps_control: Path
) -> None:
    s = make_supervisor()
    s.pipe_dir.mkdir(parents=True)
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(s.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(s.pipe_dir.parent),
    }
    subprocess.run([str(mps_control), "-d"], env=env, check=True, timeout=10)
    s.start()
    assert s.child_pid is None  # not ours
    assert s.control.get_default_active_thread_percentage() == 40.0
    s.stop()
    with pytest.raises(DaemonNotReachable):
        s.control.get_server_list()


def test_detach_keeps_daemon_for_next_start(make_supervisor: Callable[..., MpsSupervisor]) -> None:
    s = make_supervisor()
    s.start()
    pid = s.child_pid
    time.sleep(0.5)  # the start's command output is read: only the wake-up can end the select
    t0 = time.monotonic()
    s.stop(quit_daemon=False)
    # The output reader sleeps until output or its wake-up pipe; stop wakes it at once instead of
    # waiting out its 5 s select() fallback.
    assert time.monotonic() - t0 < 2.5
    assert not any(t.name.startswith("mps-out-") and t.is_alive() for t in threading.enumerate())
    assert pid is not None
    assert psutil.pid_exists(pid)
    assert s.control.get_default_active_thread_percentage() == 40.0
    again = make_supervisor()
    again.start()
    assert again.child_pid is None
    again.stop()
    _wait_until(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        5.0,
    )


def test_recover_without_fault_clears_state(sup: MpsSupervisor) -> None:
    q = _events(sup)
    # The line a faulted server writes; the supervisor turns it into FAULT.
    sup._handle_line(
        "[2026-01-01 00:00:00.000 Legacy Server  4242] Server encountered a fatal exception. Shutting down\n"
    )
    assert sup.state() is MpsState.FAULT
    assert _wait_event(q, MpsEventKind.FATAL_EXCEPTION).server_pid == 4242
    # The server is gone already (no GPU): nothing to terminate, the fault is cleared.
    assert sup.recover([1], [2]) is True
    step = _wait_event(q, MpsEventKind.RECOVERY_STEP)
    assert step.text.startswith("no_faulted_server")
    assert sup.state() is MpsState.UP
