"""What MpsSupervisor sets up around its daemon (gpushare.node.mps.setup), on the real binary.

The binary is nvidia-cuda-mps-control 535.261.03, which runs without a GPU. Multiuser detection,
the GPU's compute mode set and restored (or left), through a fake compute mode and through the real
NVML adapter, and a pipe path too long for a Unix socket.

Every fixture (tests/node/conftest.py) stops what it started: supervisors are stopped, and any
process whose environment still names a test's pipe directory is killed in teardown.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpushare.config import Config, MpsConfig, PathsConfig
from gpushare.node import mps
from gpushare.node.mps import MpsSetupError, MpsSupervisor
from tests.fakes.fake_compute_mode import FakeComputeMode
from tests.support.mps_real import GPU_A, GPU_B

# Daemon output is logged at debug from background threads: quiet_logs (conftest.py) keeps the
# test output readable.
pytestmark = [pytest.mark.mps, pytest.mark.usefixtures("quiet_logs")]


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
