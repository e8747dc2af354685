"""FAULT recovery of MpsSupervisor, and the FakeMpsNode other tests use.

No GPU means no real FAULT, so recovery runs here against a scripted control front end that
answers like the daemon does (R555 with get_server_status, R535 without); the real-binary path of
recover() is in test_mps_supervisor.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpushare.config import Config, MpsConfig, PathsConfig
from gpushare.model import MpsEvent, MpsEventKind, MpsState
from gpushare.node.base import MpsNode
from gpushare.node.mps import (
    DaemonNotReachable,
    MpsNodeManager,
    MpsSupervisor,
    ServerNotFound,
    ServerStatus,
    UnknownCommand,
)
from tests.fakes.fake_mps import FakeMpsNode

GPU = "GPU-74d43ed3-1234-5678-9abc-bf5b4f46ed65"


class ScriptedControl:
    """Answers like one control daemon with one server in FAULT and some clients."""

    def __init__(self, clients: list[int], *, has_status: bool, recovers: bool = True) -> None:
        self.server = 100
        self.clients = list(clients)
        self.has_status = has_status
        self.recovers = recovers
        self.status = ServerStatus.FAULT
        self.calls: list[tuple[object, ...]] = []
        self.running = True

    def get_server_list(self) -> tuple[int, ...]:
        return (self.server,) if self.running else ()

    def get_server_status(self, pid: int) -> ServerStatus:
        self.calls.append(("status", pid))
        if not self.has_status:
            raise UnknownCommand('Unknown command "get_server_status"')
        if not self.running:
            raise ServerNotFound(f"Server {pid} not found", server_pid=pid)
        return self.status

    def get_client_list(self, pid: int) -> tuple[int, ...]:
        return tuple(self.clients)

    def terminate_client(self, spid: int, cpid: int) -> None:
        self.calls.append(("terminate", cpid))
        self.clients.remove(cpid)
        if not self.clients and self.recovers:
            self.status = ServerStatus.ACTIVE

    def shutdown_server(self, pid: int, *, force: bool = False) -> None:
        self.calls.append(("shutdown", pid, force))
        self.running = False


@pytest.fixture
def sup(tmp_path: Path) -> MpsSupervisor:
    config = Config(
        paths=PathsConfig(runtime_dir=Path("/tmp/gsrec"), state_dir=tmp_path),
        mps=MpsConfig(control_binary="/nonexistent/nvidia-cuda-mps-control", ready_timeout_s=0.5),
    )
    return MpsSupervisor(GPU, config, clock=lambda: 7.0)


def _steps(sup: MpsSupervisor) -> list[str]:
    return [
        e.text.split(":")[0] for e in sup.drain_events() if e.kind is MpsEventKind.RECOVERY_STEP
    ]


def test_r555_offline_first_then_active(sup: MpsSupervisor) -> None:
    ctl = ScriptedControl([11, 12, 13, 14], has_status=True)
    sup.control = ctl  # type: ignore[assignment]
    assert sup.recover(offline_pids=[13, 11], online_pids=[12]) is True
    terminated = [c[1] for c in ctl.calls if c[0] == "terminate"]
    assert terminated == [13, 11, 12, 14]
    assert not any(c[0] == "shutdown" for c in ctl.calls)
    steps = _steps(sup)
    assert steps[0] == "server_faulted"
    assert steps.count("client_terminated") == 4
    assert steps[-1] == "server_active"


def test_r555_no_return_to_active_shuts_down(sup: MpsSupervisor) -> None:
    ctl = ScriptedControl([11], has_status=True, recovers=False)
    sup.control = ctl  # type: ignore[assignment]
    assert sup.recover([11], [], wait_s=0.2) is True
    assert ("shutdown", 100, True) in ctl.calls
    assert _steps(sup)[-2:] == ["server_shutdown", "server_gone"]


def test_r535_uses_fatal_events_and_shuts_down(sup: MpsSupervisor) -> None:
    ctl = ScriptedControl([21, 22], has_status=False)
    sup.control = ctl  # type: ignore[assignment]
    sup._handle_line(
        "[2026-01-01 00:00:00.000 Legacy Server   100] Server encountered a fatal exception. Shutting down"
    )
    assert sup.drain_events()[0].kind is MpsEventKind.FATAL_EXCEPTION
    assert sup.recover(offline_pids=[22], online_pids=[21]) is True
    assert [c[1] for c in ctl.calls if c[0] == "terminate"] == [22, 21]
    assert ("shutdown", 100, True) in ctl.calls
    assert "server_gone" in _steps(sup)


class BlockingControl(ScriptedControl):
    """A server that stays in FAULT until the test lets it answer."""

    def __init__(self) -> None:
        super().__init__([31, 32], has_status=True)
        self.release = threading.Event()

    def get_server_status(self, pid: int) -> ServerStatus:
        self.release.wait(10.0)
        return super().get_server_status(pid)


def test_node_recovery_runs_on_a_worker_and_never_twice_at_once(sup: MpsSupervisor) -> None:
    ctl = BlockingControl()
    sup.control = ctl  # type: ignore[assignment]
    mgr = MpsNodeManager(sup.config, [GPU], supervisor_factory=lambda _: sup)
    mgr.recover(GPU, [31], [32])  # returns although the server has not answered yet
    assert mgr.wait_recovery(GPU, 0.05) is False
    mgr.recover(GPU, [31], [32])  # a second request while the first runs is ignored
    ctl.release.set()
    assert mgr.wait_recovery(GPU, 5.0) is True
    assert [c[1] for c in ctl.calls if c[0] == "terminate"] == [31, 32]
    assert [c for c in ctl.calls if c[0] == "status"].count(("status", 100)) == 2
    assert _steps(sup)[-1] == "server_active"


def test_r535_without_fatal_event_touches_nothing(sup: MpsSupervisor) -> None:
    ctl = ScriptedControl([21], has_status=False)
    sup.control = ctl  # type: ignore[assignment]
    assert sup.recover([21], []) is True
    assert not any(c[0] in ("terminate", "shutdown") for c in ctl.calls)
    assert _steps(sup) == ["no_faulted_server"]


def test_recovery_events_are_stamped(sup: MpsSupervisor) -> None:
    sup.control = ScriptedControl([1], has_status=True)  # type: ignore[assignment]
    seen: list[MpsEvent] = []
    sup.subscribe(seen.append)
    sup.recover([1], [])
    assert seen
    assert all(e.at_s == 7.0 and e.gpu_uuid == GPU for e in seen)
    assert seen[1].client_pid == 1


# The fake other engineers use ----------------------------------------------------------------


def test_fake_node_follows_mps() -> None:
    node: MpsNode = FakeMpsNode([GPU])
    fake = node
    assert isinstance(fake, FakeMpsNode)
    fake.connect_client(GPU, 100, uid=1000)
    fake.connect_client(GPU, 101, uid=1000)
    kinds = [e.kind for e in node.drain_events(GPU)]
    assert kinds == [
        MpsEventKind.SERVER_STARTED,
        MpsEventKind.SERVER_READY,
        MpsEventKind.CLIENT_CONNECTED,
        MpsEventKind.CLIENT_CONNECTED,
    ]
    with pytest.raises(RuntimeError, match="queued"):
        fake.connect_client(GPU, 102, uid=2000)
    fake.inject_fault(GPU)
    assert node.state(GPU) is MpsState.FAULT
    with pytest.raises(RuntimeError, match="807"):
        fake.connect_client(GPU, 103, uid=1000)
    node.recover(GPU, [101], [100])
    steps = [e for e in node.drain_events(GPU) if e.kind is MpsEventKind.RECOVERY_STEP]
    assert [e.client_pid for e in steps if e.client_pid] == [101, 100]
    assert node.state(GPU) is MpsState.UP
    assert fake.clients(GPU) == {}
    assert ("recover", (GPU, (101,), (100,))) in fake.calls


def test_fake_node_failures_and_terminate() -> None:
    fake = FakeMpsNode([GPU])
    fake.connect_client(GPU, 100)
    assert fake.terminate_client(GPU, 999) is False
    fake.fail_next("terminate_client")
    assert fake.terminate_client(GPU, 100) is False
    assert fake.terminate_client(GPU, 100) is True
    fake.fail_next("state", RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        fake.state(GPU)
    assert fake.state(GPU) is MpsState.UP
    fake.fail_next("pipe_dir")
    with pytest.raises(DaemonNotReachable, match="Cannot find MPS control daemon"):
        fake.pipe_dir(GPU)
    assert fake.pipe_dir(GPU) == Path("/tmp/fake-mps") / GPU
    with pytest.raises(KeyError, match="shared GPUs"):
        fake.state("GPU-other")
