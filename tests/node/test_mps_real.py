"""gpushare.node.mps against the real nvidia-cuda-mps-control (535.261.03 runs without a GPU).

Every fixture stops what it started: supervisors are stopped, and any process whose environment
still names a test's pipe directory is killed in teardown.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import structlog

from bench.support.helpers import mps_server_dir
from gpushare.config import Config, MpsConfig, PathsConfig
from gpushare.model import MpsEvent, MpsEventKind, MpsState
from gpushare.node import mps
from gpushare.node.mps import (
    CommandTimeout,
    DaemonNotReachable,
    InvalidValue,
    MpsControl,
    MpsNodeManager,
    MpsSetupError,
    MpsSupervisor,
    ServerNotFound,
    UnknownCommand,
)
from gpushare.node.mps import commands as mps_commands
from tests.fakes.fake_compute_mode import FakeComputeMode

pytestmark = pytest.mark.mps

GPU_A = "GPU-74d43ed3-1234-5678-9abc-bf5b4f46ed65"
GPU_B = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    # Daemon output is logged at debug from background threads; keep test output readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _procs_using(pipe_root: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(str(pipe_root)):
            found.append(proc)
    return found


@pytest.fixture
def short_root() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path plus a GPU UUID is too long.
    root = Path(tempfile.mkdtemp(prefix="gsm", dir="/tmp"))
    yield root
    for proc in _procs_using(root):
        proc.kill()
        proc.wait(5)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_config(mps_control: Path, short_root: Path) -> Callable[..., Config]:
    def make(**mps_kw: object) -> Config:
        kw: dict[str, object] = {
            "control_binary": str(mps_control),
            "command_timeout_s": 2.0,
            "health_period_s": 0.2,
            "ready_timeout_s": 5.0,
            "restart_backoff_min_s": 0.05,
            "restart_backoff_max_s": 0.4,
            "quit_timeout_s": 1.0,
            "default_active_thread_pct": 40.0,
            "multiuser": "auto",
        }
        kw.update(mps_kw)
        return Config(
            paths=PathsConfig(runtime_dir=short_root, state_dir=short_root / "state"),
            mps=MpsConfig(**kw),  # type: ignore[arg-type]
        )

    return make


@pytest.fixture
def make_supervisor(make_config: Callable[..., Config]) -> Iterator[Callable[..., MpsSupervisor]]:
    made: list[MpsSupervisor] = []
    server_dir = mps_server_dir()

    def make(uuid: str = GPU_A, config: Config | None = None, **kw: object) -> MpsSupervisor:
        sup = MpsSupervisor(
            uuid,
            config or make_config(),
            extra_path=[server_dir] if server_dir else [],
            **kw,  # type: ignore[arg-type]
        )
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop()


@pytest.fixture
def sup(make_supervisor: Callable[..., MpsSupervisor]) -> MpsSupervisor:
    s = make_supervisor()
    s.start()
    return s


def _events(s: MpsSupervisor) -> queue.Queue[MpsEvent]:
    q: queue.Queue[MpsEvent] = queue.Queue()
    s.subscribe(q.put)
    return q


def _wait_event(q: queue.Queue[MpsEvent], kind: MpsEventKind, timeout_s: float = 2.0) -> MpsEvent:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} event within {timeout_s}s")
        try:
            ev = q.get(timeout=left)
        except queue.Empty:
            continue
        if ev.kind is kind:
            return ev


def _wait_until(pred: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout_s}s")


def _answers(ctl: MpsControl, value: float) -> bool:
    try:
        return ctl.get_default_active_thread_percentage() == value
    except DaemonNotReachable:
        return False


# Start, ready, stop ---------------------------------------------------------------------------


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


# Every command's round trip -------------------------------------------------------------------


def test_default_active_thread_percentage_round_trip(sup: MpsSupervisor) -> None:
    ctl = sup.control
    assert ctl.set_default_active_thread_percentage(25) == 25.0
    assert ctl.get_default_active_thread_percentage() == 25.0
    assert ctl.set_default_active_thread_percentage(33.33) == 33.3
    assert ctl.get_default_active_thread_percentage() == 33.3


@pytest.mark.parametrize("bad", [0, 101, -5, float("nan"), float("inf"), True, "50"])
def test_invalid_percentage_rejected_before_sending(sup: MpsSupervisor, bad: object) -> None:
    ctl = sup.control
    with pytest.raises(InvalidValue):
        ctl.set_default_active_thread_percentage(bad)  # type: ignore[arg-type]
    assert ctl.get_default_active_thread_percentage() == 40.0


def test_invalid_percentage_echo_detected(
    sup: MpsSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon answers an invalid value with the *unchanged* value; the echo check catches it.
    ctl = sup.control
    assert ctl.command("set_default_active_thread_percentage", "0").split() == ["40.0"]
    # MpsControl looks check_pct up in its own module.
    monkeypatch.setattr(mps_commands, "check_pct", float)
    with pytest.raises(InvalidValue, match="holds 40.0"):
        ctl.set_default_active_thread_percentage(150.0)
    assert ctl.get_default_active_thread_percentage() == 40.0


def test_default_pinned_mem_limit_round_trip(sup: MpsSupervisor) -> None:
    ctl = sup.control
    assert ctl.get_default_device_pinned_mem_limit(0) is None
    assert ctl.set_default_device_pinned_mem_limit(0, "2G") == 2 * GIB
    assert ctl.get_default_device_pinned_mem_limit(0) == 2 * GIB
    assert ctl.set_default_device_pinned_mem_limit(1, 512 * MIB) == 512 * MIB
    assert ctl.get_default_device_pinned_mem_limit("1") == 512 * MIB
    # >= 1 GiB reads back floored to whole GiB; that is not a mismatch.
    assert ctl.set_default_device_pinned_mem_limit(0, "1536M") == GIB
    # A UUID is accepted but cannot be read back without a GPU the daemon can see.
    assert ctl.set_default_device_pinned_mem_limit(GPU_A, "1G") is None


@pytest.mark.parametrize("bad", ["2GB", "0M", "abc", "512", 0, -1, 1000, True, "1.5G"])
def test_invalid_pinned_size_rejected(sup: MpsSupervisor, bad: object) -> None:
    with pytest.raises(InvalidValue):
        sup.control.set_default_device_pinned_mem_limit(0, bad)  # type: ignore[arg-type]
    assert sup.control.get_default_device_pinned_mem_limit(0) is None


@pytest.mark.parametrize("bad", ["bogus", "GPU-", "-1", "0 1", True, 1.0])
def test_invalid_device_rejected(sup: MpsSupervisor, bad: object) -> None:
    with pytest.raises(InvalidValue):
        sup.control.set_default_device_pinned_mem_limit(bad, "1G")  # type: ignore[arg-type]


def test_client_priority_round_trip(sup: MpsSupervisor) -> None:
    ctl = sup.control
    assert ctl.get_default_client_priority() == 0
    ctl.set_default_client_priority(1)
    assert ctl.get_default_client_priority() == 1
    ctl.set_default_client_priority(0)
    assert ctl.get_default_client_priority() == 0
    with pytest.raises(InvalidValue):
        ctl.set_default_client_priority(2)
    # The daemon's own rejection is typed too.
    with pytest.raises(InvalidValue, match="must be 0 or 1"):
        ctl.command("set_default_client_priority", "2")
    assert ctl.get_default_client_priority() == 0


def test_unknown_command_is_typed(sup: MpsSupervisor) -> None:
    with pytest.raises(UnknownCommand, match="bogus_cmd"):
        sup.control.command("bogus_cmd")
    # R535 has no get_server_status, nor the R6xx lspart.
    with pytest.raises(UnknownCommand):
        sup.control.get_server_status(12345)
    with pytest.raises(UnknownCommand):
        sup.control.lspart()


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.set_active_thread_percentage(12345, 50),
        lambda c: c.get_active_thread_percentage(12345),
        lambda c: c.get_client_list(12345),
        lambda c: c.get_device_client_list(12345),
        lambda c: c.shutdown_server(12345),
        lambda c: c.shutdown_server(12345, force=True),
        lambda c: c.set_device_pinned_mem_limit(12345, 0, "1G"),
        lambda c: c.get_device_pinned_mem_limit(12345, 0),
        lambda c: c.terminate_client(12345, 1),
        lambda c: c.ps(12345),
    ],
)
def test_missing_server_is_typed(sup: MpsSupervisor, call: Callable[[MpsControl], object]) -> None:
    with pytest.raises(ServerNotFound) as info:
        call(sup.control)
    assert info.value.server_pid == 12345


def test_empty_lists_without_servers(sup: MpsSupervisor) -> None:
    ctl = sup.control
    assert ctl.get_server_list() == ()
    assert ctl.get_device_client_list() == ()
    assert ctl.ps() == ()


def test_start_server_requires_uid(sup: MpsSupervisor) -> None:
    with pytest.raises(InvalidValue, match="user id"):
        sup.control.command("start_server")
    with pytest.raises(InvalidValue):
        sup.control.start_server(-1)


def test_start_server_produces_server_events(sup: MpsSupervisor) -> None:
    q = _events(sup)
    uid = os.getuid()
    sup.control.start_server(uid)
    started = _wait_event(q, MpsEventKind.SERVER_STARTED)
    assert started.uid == uid
    assert started.server_pid
    exited = _wait_event(q, MpsEventKind.SERVER_EXITED)
    # No GPU here: the server exits at once, with status 1.
    assert exited.server_pid == started.server_pid
    assert exited.status == 1
    assert sup.control.get_server_list() == ()


def test_command_events_skip_health_probe(sup: MpsSupervisor) -> None:
    seen: list[MpsEvent] = []

    def startup_seen() -> bool:
        seen.extend(sup.drain_events())
        return any(e.text.startswith("set_default_active_thread_percentage") for e in seen)

    # The start-up commands are read asynchronously; let them arrive before counting.
    _wait_until(startup_seen, 2.0)
    sup.control.get_default_client_priority()
    time.sleep(0.5)  # at least two health periods
    commands = [e.text for e in sup.drain_events() if e.kind is MpsEventKind.COMMAND]
    assert commands == ["get_default_client_priority"]


def test_no_daemon_is_not_reachable(mps_control: Path, short_root: Path) -> None:
    ctl = MpsControl(mps_control, short_root / "nothing", timeout_s=2)
    with pytest.raises(DaemonNotReachable, match="Cannot find"):
        ctl.get_server_list()


def test_missing_binary_is_a_setup_error(short_root: Path) -> None:
    ctl = MpsControl(short_root / "no-such-binary", short_root, timeout_s=2)
    with pytest.raises(MpsSetupError, match="mps.control_binary"):
        ctl.get_server_list()


def test_hung_daemon_times_out(sup: MpsSupervisor) -> None:
    pid = sup.child_pid
    assert pid is not None
    ctl = MpsControl(sup.control.control_binary, sup.pipe_dir, timeout_s=0.3)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(CommandTimeout):
            ctl.get_server_list()
    finally:
        os.kill(pid, signal.SIGCONT)


# Supervision ----------------------------------------------------------------------------------


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


# Multiuser, compute mode, paths ---------------------------------------------------------------


def test_multiuser_detection(
    mps_control: Path,
    make_supervisor: Callable[..., MpsSupervisor],
    make_config: Callable[..., Config],
) -> None:
    has = mps.supports_multiuser(mps_control)
    assert has is (b"-multiuser-server" in mps_control.read_bytes())
    s = make_supervisor()
    s.start()
    assert s.multiuser is (has and os.geteuid() == 0)
    if not has:
        with pytest.raises(MpsSetupError, match="multiuser"):
            make_supervisor(GPU_B, config=make_config(multiuser="on")).start()


def test_compute_mode_set_and_restored(make_supervisor: Callable[..., MpsSupervisor]) -> None:
    cm = FakeComputeMode("default")
    s = make_supervisor(compute_mode=cm)
    s.start()
    assert cm.calls == [(GPU_A, "exclusive_process")]
    s.stop()
    assert cm.calls == [(GPU_A, "exclusive_process"), (GPU_A, "default")]


def test_compute_mode_leave(
    make_supervisor: Callable[..., MpsSupervisor], make_config: Callable[..., Config]
) -> None:
    cm = FakeComputeMode("default")
    s = make_supervisor(config=make_config(compute_mode="leave"), compute_mode=cm)
    s.start()
    s.stop()
    assert cm.calls == []


def test_too_long_pipe_path_is_a_clear_error(mps_control: Path) -> None:
    config = Config(
        paths=PathsConfig(runtime_dir=Path("/tmp/" + "x" * 80)),
        mps=MpsConfig(control_binary=str(mps_control)),
    )
    with pytest.raises(MpsSetupError, match="paths.mps_pipe_dir"):
        MpsSupervisor(GPU_A, config)


# Recovery and the node manager ----------------------------------------------------------------


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


def test_node_manager_two_gpus(make_config: Callable[..., Config]) -> None:
    server_dir = mps_server_dir()
    mgr = MpsNodeManager(
        make_config(),
        [GPU_A, GPU_B],
        extra_path=[server_dir] if server_dir else [],
        client_priority=1,
    )
    mgr.start()
    try:
        for sup in mgr.supervisors.values():
            assert sup.control.get_default_client_priority() == 1
        assert mgr.pipe_dir(GPU_A) != mgr.pipe_dir(GPU_B)
        assert mgr.state(GPU_A) is MpsState.UP
        assert mgr.state(GPU_B) is MpsState.UP
        pid_b = mgr.supervisors[GPU_B].child_pid
        assert pid_b is not None
        os.kill(mgr.supervisors[GPU_A].child_pid or 0, signal.SIGKILL)
        _wait_until(
            lambda: any(e.kind is MpsEventKind.DAEMON_RESTARTED for e in mgr.drain_events(GPU_A)),
            2.0,
        )
        # One GPU's restart leaves the other's daemon alone (docs/design.md D1).
        assert mgr.supervisors[GPU_B].child_pid == pid_b
        assert mgr.terminate_client(GPU_A, 999_999) is False
        mgr.recover(GPU_B, [], [])  # on a worker: the caller's loop goes on
        assert mgr.wait_recovery(GPU_B, 5.0)
        assert any(e.kind is MpsEventKind.RECOVERY_STEP for e in mgr.drain_events(GPU_B))
        with pytest.raises(KeyError, match="shared GPUs"):
            mgr.state("GPU-nope")
    finally:
        mgr.stop()
    assert mgr.state(GPU_A) is MpsState.DOWN
    assert list(mgr.pipe_dir(GPU_A).iterdir()) == []


def test_compute_mode_through_the_real_nvml_adapter(
    make_supervisor: Callable[..., MpsSupervisor],
) -> None:
    # The NVML adapter and the supervisor must agree on mode names end to end.
    from bench.support import fake_nvml
    from gpushare.node.nvml import NvmlBackend

    lib = fake_nvml.healthy(1)
    backend = NvmlBackend(nvml=lib, events=False)
    try:
        s = make_supervisor(GPU_A, compute_mode=_RenamedGpu(backend, fake_nvml.uuid_of(0)))
        s.start()
        assert backend.get_compute_mode(fake_nvml.uuid_of(0)) == "exclusive_process"
        s.stop()
        assert backend.get_compute_mode(fake_nvml.uuid_of(0)) == "default"
    finally:
        backend.close()


class _RenamedGpu:
    """Maps the supervisor's GPU UUID onto the fake NVML's one."""

    def __init__(self, backend: object, uuid: str) -> None:
        self.backend, self.uuid = backend, uuid

    def get_compute_mode(self, gpu_uuid: str) -> str | None:
        return self.backend.get_compute_mode(self.uuid)  # type: ignore[attr-defined]

    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        self.backend.set_compute_mode(self.uuid, mode)  # type: ignore[attr-defined]
