"""``gpushare daemon --simulate 1``: the real daemon and CLI on a simulated GPU, end to end.

These run with simulated MPS on every machine: ``mps.control_binary`` names a binary that does not
exist, as on a host without ``nvidia-cuda-mps-control``. The real control binary in simulate mode
is tested in ``tests/test_sim_hybrid_mps.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.paths import repo_root
from tests.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base

GPUSHARE = [sys.executable, "-c", "from gpushare.cli.app import main; main()"]


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUSHARE, *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def sim_daemon() -> Iterator[dict[str, str]]:
    base = Path(tempfile.mkdtemp(prefix="gss-", dir="/tmp"))  # short: Unix socket path limit
    # Real cgroup v2 where the machine allows it, in a directory of this test's own.
    cgroup_dir = unique_base("gs-sim-test") if cgroup_skip_reason() is None else None
    cgroup_line = f'cgroup_base = "{cgroup_dir}"' if cgroup_dir is not None else ""
    cfg = base / "gpushare.toml"
    cfg.write_text(
        f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
{cgroup_line}
[daemon]
admin_group = ""
cancel_grace = "1s"
[metrics]
enabled = false
[latency]
window = "5s"
[mps]
control_binary = "{base}/absent/nvidia-cuda-mps-control"
"""
    )
    env = {**os.environ, "GPUSHARE_SOCKET": str(base / "run" / "gpushare.sock")}
    proc = subprocess.Popen(
        [*GPUSHARE, "daemon", "--simulate", "1", "--config", str(cfg)],
        env=env,
        cwd=repo_root(),
        stdout=subprocess.DEVNULL,
        stderr=(base / "daemon.log").open("wb"),
    )
    try:
        deadline = time.monotonic() + 20
        while not (base / "run" / "gpushare.sock").exists():
            assert proc.poll() is None, (base / "daemon.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the simulated daemon did not start"
            time.sleep(0.1)
        yield {**env, "GSS_DAEMON_LOG": str(base / "daemon.log")}
    finally:
        try:
            listing = _cli(env, "list", "--json")
            if listing.returncode == 0:
                for client in json.loads(listing.stdout)["clients"]:
                    _cli(env, "cancel", client["id"])
                time.sleep(1.5)  # the cancel grace: the daemon kills what ignored SIGTERM
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            shutil.rmtree(base, ignore_errors=True)
            if cgroup_dir is not None:
                remove_tree(cgroup_dir)


def test_simulated_daemon_runs_submitted_workloads(sim_daemon: dict[str, str]) -> None:
    env = sim_daemon
    res = _cli(
        env, "submit", "--offline", "--restartable", "--name", "train",
        "--sim-profile", "resnet50-train", "--", "sleep", "60",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = _cli(
        env, "submit", "--online", "--detach", "--name", "web", "--slo-p99", "60ms",
        "--sim-profile", "resnet50-inference", "--rps", "40", "--", "sleep", "60",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    time.sleep(3.0)
    status = json.loads(_cli(env, "status", "--json").stdout)
    (gpu,) = status["gpus"]
    assert gpu["uuid"] == "GPU-sim-0000"
    assert gpu["gpu_util_pct"] is not None
    assert gpu["gpu_util_pct"] > 20  # the simulated training job keeps the GPU busy
    assert gpu["mem_used_bytes"] == (2 << 30) + (4 << 30)
    names = {c["name"]: c for c in status["clients"]}
    assert set(names) == {"train", "web"}
    assert all(c["state"] in ("running", "throttled", "frozen") for c in names.values())
    # No MPS binary: MPS is simulated, and the daemon says so and why.
    assert gpu["mps_state"] == "up"
    assert gpu["mps_backend"] == "simulated"
    assert status["daemon"]["simulated"] is True
    assert "up (sim)" in _cli(env, "status").stdout
    line = next(
        json.loads(x)
        for x in Path(env["GSS_DAEMON_LOG"]).read_text().splitlines()
        if '"simulated_node"' in x
    )
    assert line["mps"] == "simulated"
    assert "nvidia-cuda-mps-control not found" in line["reason"]
    assert "scripts/get-mps-control.sh" in line["reason"]


def test_sim_profile_errors(sim_daemon: dict[str, str]) -> None:
    env = sim_daemon
    res = _cli(env, "submit", "--offline", "--sim-profile", "resnet50-train", "--", "true")
    assert res.returncode == 2
    assert "--sim-profile needs --detach" in res.stderr
    res = _cli(env, "submit", "--online", "--detach", "--rps", "3", "--", "true")
    assert res.returncode == 2
    assert "give --sim-profile too" in res.stderr
