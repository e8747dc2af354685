"""``make demo``'s path, shortened: no job is restarted when request gating turns off and on.

Issue 32's target: in ``make demo`` each training job used to be restarted twice within 0.3 s when
gating turned off during the online burst (the share cut on two consecutive ticks while the duty
held offline work frozen). This runs what ``scripts/demo.sh`` runs: the real daemon on one
simulated GPU in real time (``gpushare daemon --simulate 1``, simulated MPS, the demo's
``[latency] window``), the same three clients submitted through the real CLI (the ResNet-50
service, two restartable ``--queue auto`` training jobs), with the service's burst moved earlier
and made larger so that gating turns off and back on within seconds. The daemon's own registry
and event log then say whether a job was restarted. (The in-flight library is preloaded where it
is built, as ``make demo`` builds it: the jobs' queues then switch live; without it they run the
blocking fallback.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import sim_daemon_helpers as helpers
from tests.support.sim_daemon_helpers import SimDaemon

# scripts/demo.sh's service with its burst (3x for 15 s at 20 s there) moved to 3 s and made 6x:
# at 3x the simulated service keeps requests in flight under the 0.9 that turns gating off (the
# demo's gating stays on throughout), at 6x (a load of about 1) gating turns off in the burst.
BURST = "3:8:6"
# Gating has turned off and back on within about 15 s of the service's start on a machine with
# two busy cores; a more loaded one starts the real-time simulation late.
DEADLINE_S = 40.0


@pytest.fixture
def demo_daemon() -> Iterator[SimDaemon]:
    absent = Path("/nonexistent/gpushare-test/nvidia-cuda-mps-control")
    with helpers.sim_daemon(absent, rest='[latency]\nwindow = "5s"') as d:
        yield d


def _events(d: SimDaemon) -> list[dict[str, Any]]:
    res = d.cli("events", "--json")
    assert res.returncode == 0, res.stderr
    return [json.loads(x) for x in res.stdout.splitlines()]


def _submit(d: SimDaemon, *args: str) -> str:
    res = d.cli("submit", *args, "--", "sleep", "600")
    assert res.returncode == 0, res.stderr
    return res.stdout.split()[0]


def _off_then_on(kinds: list[str]) -> bool:
    """Gating turned off (in the burst), and on again after it."""
    return "gating_off" in kinds and "gating_on" in kinds[kinds.index("gating_off") :]


def test_the_demo_restarts_no_job_when_gating_turns_off_and_on(demo_daemon: SimDaemon) -> None:
    d = demo_daemon
    _submit(d, "--online", "--detach", "--name", "web", "--slo-p99", "60ms",
            "--sim-profile", "resnet50-inference", "--rps", "20", "--sim-burst", BURST)  # fmt: skip
    auto = ("--offline", "--restartable", "--queue", "auto")
    jobs = [
        _submit(d, *auto, "--name", name, "--sim-profile", profile)
        for name, profile in (("train-a", "resnet50-train"), ("train-b", "mobilenetv2-train"))
    ]

    def gating_kinds() -> list[str]:
        return [e["kind"] for e in _events(d) if e["kind"] in ("gating_on", "gating_off")]

    deadline = time.monotonic() + DEADLINE_S
    kinds = gating_kinds()
    while not _off_then_on(kinds):
        assert time.monotonic() < deadline, f"gating did not turn off and on again: {kinds}"
        time.sleep(0.5)
        kinds = gating_kinds()
    # A restart asked on the last tick shows within a tick or two.
    time.sleep(1.0)
    events = _events(d)
    restarting = [e["message"] for e in events if e["kind"] == "client_restarting"]
    assert restarting == [], restarting
    listing = json.loads(d.cli("list", "--json").stdout)["clients"]
    restarts = {c["name"]: c["restarts"] for c in listing if c["id"] in jobs}
    assert restarts == {"train-a": 0, "train-b": 0}
