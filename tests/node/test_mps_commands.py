"""Every MpsControl command's round trip, on the real MPS control binary.

The binary is nvidia-cuda-mps-control 535.261.03, which runs without a GPU. Defaults set and read
back, values checked before they are sent and echoes compared, each daemon answer typed (unknown
command, missing server, not reachable, setup error, timeout), and the command and server events
the supervisor reports.

Every fixture (tests/node/conftest.py) stops what it started: supervisors are stopped, and any
process whose environment still names a test's pipe directory is killed in teardown.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpushare.model import MpsEvent, MpsEventKind
from gpushare.node.mps import (
    CommandTimeout,
    DaemonNotReachable,
    InvalidValue,
    MpsControl,
    MpsSetupError,
    MpsSupervisor,
    ServerNotFound,
    UnknownCommand,
)
from gpushare.node.mps import commands as mps_commands
from tests.support.mps_real import GIB, GPU_A, MIB
from tests.support.mps_real import events as _events
from tests.support.mps_real import wait_event as _wait_event
from tests.support.mps_real import wait_until as _wait_until

# Daemon output is logged at debug from background threads: quiet_logs (conftest.py) keeps the
# test output readable.
pytestmark = [pytest.mark.mps, pytest.mark.usefixtures("quiet_logs")]


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
