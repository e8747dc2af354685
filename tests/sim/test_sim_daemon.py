"""``gpushare daemon --simulate 1``: the real daemon and CLI on a simulated GPU, end to end.

These run with simulated MPS on every machine: ``mps.control_binary`` names a binary that does not
exist, as on a host without ``nvidia-cuda-mps-control``. The real control binary in simulate mode
is tested in ``tests/sim/test_sim_hybrid_mps.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import sim_daemon_helpers as helpers
from tests.support.sim_daemon_helpers import SimDaemon


@pytest.fixture
def sim_daemon() -> Iterator[SimDaemon]:
    absent = Path("/nonexistent/gpushare-test/nvidia-cuda-mps-control")
    with helpers.sim_daemon(absent, rest='[latency]\nwindow = "5s"') as d:
        yield d


def test_simulated_daemon_runs_submitted_workloads(sim_daemon: SimDaemon) -> None:
    d = sim_daemon
    res = d.cli(
        "submit", "--offline", "--restartable", "--name", "train",
        "--sim-profile", "resnet50-train", "--", "sleep", "60",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = d.cli(
        "submit", "--online", "--detach", "--name", "web", "--slo-p99", "60ms",
        "--sim-profile", "resnet50-inference", "--rps", "25", "--", "sleep", "60",
    )  # fmt: skip
    # 25/s of 9.9 ms passes (kernels and host time, W3) is a load of 0.25: gated, offline work
    # still has most of the GPU.
    assert res.returncode == 0, res.stderr
    # The utilisation is a window's average: read it until the training job has filled one
    # (about 3 s; longer on a loaded machine, where the real-time simulation starts late).
    deadline = time.monotonic() + 20.0
    while True:
        time.sleep(1.0)
        status = json.loads(d.cli("status", "--json").stdout)
        (gpu,) = status["gpus"]
        if (gpu["gpu_util_pct"] or 0) > 20 or time.monotonic() > deadline:
            break
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
    assert "up (sim)" in d.cli("status").stdout
    line = next(x for x in d.log_lines() if x["event"] == "simulated_node")
    assert line["mps"] == "simulated"
    assert "nvidia-cuda-mps-control not found" in line["reason"]
    assert "scripts/get-mps-control.sh" in line["reason"]


def test_sim_profile_errors(sim_daemon: SimDaemon) -> None:
    d = sim_daemon
    res = d.cli("submit", "--offline", "--sim-profile", "resnet50-train", "--", "true")
    assert res.returncode == 2
    assert "--sim-profile needs --detach" in res.stderr
    res = d.cli("submit", "--online", "--detach", "--rps", "3", "--", "true")
    assert res.returncode == 2
    assert "give --sim-profile too" in res.stderr


def test_a_submit_whose_simulated_workload_cannot_run_leaves_nothing_behind(
    sim_daemon: SimDaemon,
) -> None:
    d = sim_daemon
    res = d.cli(
        "submit", "--offline", "--detach", "--sim-profile", "no-such-profile",
        "--", "sleep", "777",
    )  # fmt: skip
    assert res.returncode == 2, res.stdout
    assert "unknown --sim-profile 'no-such-profile'" in res.stderr
    assert "internal error" not in res.stderr
    (client,) = json.loads(d.cli("list", "--all", "--json").stdout)["clients"]
    assert client["state"] == "failed"
    assert "unknown --sim-profile" in client["reason"]
    assert client["pid"] is None
    assert json.loads(d.cli("list", "--json").stdout)["clients"] == []
    # The workload was spawned and then stopped: no `sleep 777` of this daemon is left.
    # It did start (its log exists), so this is the path after the spawn.
    assert (d.base / "state" / "clients" / f"{client['id']}.log").exists()
    assert not _processes_with_argv(["sleep", "777"], under=d.base)


def _processes_with_argv(argv: list[str], *, under: Path) -> list[int]:
    """Live processes running exactly ``argv`` whose environment names ``under`` (this daemon's)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if [c.decode() for c in cmd] == argv and str(under).encode() in env:
            found.append(int(entry))
    return found
