"""The daemon with the real MPS control binary (one control daemon per GPU); only the GPU is fake.

Without a GPU the control daemon still starts, answers commands and quits, which is what the
daemon's readiness, status and stop semantics rest on.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

from bench.support.daemon_helpers import DaemonProc, wait_for
from gpushare.node.exec import run
from tests.fakes.fake_gpu import fake_uuid

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gpushare.node.mps") is None,
    reason="gpushare.node.mps (the MPS adapter) is not on this branch",
)


def _daemon(mps_control: Path, stop_mps: bool) -> DaemonProc:
    extra = f"""[mps]
control_binary = "{mps_control}"
compute_mode = "leave"
multiuser = "off"
"""
    d = DaemonProc(extra, gpus=1, env={"GPUSHARE_TEST_REAL_MPS": "1"})
    if stop_mps:
        d.write_config(extra)
        d.config_path.write_text(
            d.config_text(extra).replace("[daemon]\n", "[daemon]\nstop_mps_on_exit = true\n")
        )
    return d


def _answers(mps_control: Path, pipe_dir: Path) -> bool:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    done = run(
        [str(mps_control)], input="get_default_active_thread_percentage\n", timeout_s=5, env=env
    )
    return done.ok and done.stdout.strip() == "100.0"


def _quit(mps_control: Path, pipe_dir: Path) -> None:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    run([str(mps_control)], input="quit\n", timeout_s=5, env=env)


@pytest.mark.mps
@pytest.mark.parametrize(
    "stop_mps",
    [False, True],
)
def test_real_mps_ready_status_env_and_stop(mps_control: Path, stop_mps: bool) -> None:
    d = _daemon(mps_control, stop_mps)
    pipe_dir = d.base / "run" / "mps" / fake_uuid(0)
    try:
        d.start()
        wait_for(lambda: d.call("status")["daemon"]["ready"], what="READY with MPS answering")
        gpu = d.call("status")["gpus"][0]
        assert gpu["mps_state"] == "up"
        res = d.submit_detached(["sleep", "30"], gpu="0")
        assert res["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe_dir)
        assert (pipe_dir / "control").exists()  # the client's pipe is the real daemon's
        assert _answers(mps_control, pipe_dir)
        d.call("cancel", {"client_id": res["client_id"]})
        assert d.stop(signal.SIGTERM, timeout_s=5.0) == 0
        # SIGTERM leaves MPS serving unless daemon.stop_mps_on_exit asks for it to stop too.
        assert _answers(mps_control, pipe_dir) is not stop_mps
    finally:
        _quit(mps_control, pipe_dir)
        d.cleanup()
