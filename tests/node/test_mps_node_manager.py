"""MpsNodeManager over two GPUs' control daemons, on the real MPS control binary.

The binary is nvidia-cuda-mps-control 535.261.03, which runs without a GPU. One daemon per GPU with
its own pipe directory; one GPU's restart and recovery leave the other's daemon alone.

Every fixture (tests/node/conftest.py) stops what it started: supervisors are stopped, and any
process whose environment still names a test's pipe directory is killed in teardown.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from bench.support.helpers import mps_server_dir
from gpushare.config import Config
from gpushare.model import MpsEventKind, MpsState
from gpushare.node.mps import MpsNodeManager
from tests.support.mps_real import GPU_A, GPU_B
from tests.support.mps_real import wait_until as _wait_until

# Daemon output is logged at debug from background threads: quiet_logs (conftest.py) keeps the
# test output readable.
pytestmark = [pytest.mark.mps, pytest.mark.usefixtures("quiet_logs")]


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
