"""``gpushare daemon --simulate``: a live ``--queue auto`` job's twin follows the control file.

The real daemon (subprocess, real socket, real registry) on a simulated GPU launches the job with
the in-flight library preloaded and its GPU's control file (issue 32); request gating, turned on by
a simulated service's requests and off when it goes, rewrites the file; the job's simulated twin
takes each bound without a restart (same pid), as the library does at its next launch.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare import native
from tests.support import sim_daemon_helpers as helpers
from tests.support.sim_daemon_helpers import SimDaemon

# sim_daemon names a root-owned copy of the library ([paths] inflight_library).
pytestmark = pytest.mark.skipif(
    not native.built(), reason="the in-flight library is not built (make native needs a C compiler)"
)


@pytest.fixture
def sim_daemon() -> Iterator[SimDaemon]:
    absent = Path("/nonexistent/gpushare-test/nvidia-cuda-mps-control")
    with helpers.sim_daemon(absent, rest='[latency]\nwindow = "5s"') as d:
        yield d


def _lines(d: SimDaemon, event: str, cid: str) -> list[dict[str, Any]]:
    return [x for x in d.log_lines() if x["event"] == event and x.get("client_id") == cid]


def _wait(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def test_a_simulated_auto_job_takes_the_bound_gating_writes_without_a_restart(
    sim_daemon: SimDaemon,
) -> None:
    d = sim_daemon
    res = d.cli(
        "submit", "--offline", "--restartable", "--restart-cost", "1h", "--name", "train",
        "--sim-profile", "resnet50-train", "--", "sleep", "120",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (train,) = json.loads(d.cli("list", "--json").stdout)["clients"]
    cid = train["id"]
    (followed,) = _wait("the twin following", lambda: _lines(d, "sim_control_file_followed", cid))
    control = Path(str(followed["path"]))
    assert followed["bound"] == 0 == struct.unpack("<i", control.read_bytes())[0]
    pid = json.loads(d.cli("list", "--json").stdout)["clients"][0]["pid"]

    res = d.cli(
        "submit", "--online", "--detach", "--name", "web", "--slo-p99", "60ms",
        "--sim-profile", "resnet50-inference", "--rps", "25", "--", "sleep", "120",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    k = 4  # [gate] inflight_kernels' default
    got = _wait(
        "the twin bounded",
        lambda: [x for x in _lines(d, "sim_inflight_bound", cid) if x["bound"] == k],
    )
    assert got[0]["pid"] == pid
    assert struct.unpack("<i", control.read_bytes())[0] == k

    web = next(
        c for c in json.loads(d.cli("list", "--json").stdout)["clients"] if c["name"] == "web"
    )
    assert d.cli("cancel", web["id"]).returncode == 0
    got = _wait(
        "the twin unbounded again",
        lambda: [x for x in _lines(d, "sim_inflight_bound", cid) if x["bound"] == 0],
        timeout_s=40.0,
    )
    assert got[0]["pid"] == pid
    (now,) = [c for c in json.loads(d.cli("list", "--json").stdout)["clients"] if c["id"] == cid]
    assert now["pid"] == pid and now["restarts"] == 0
