"""Simulated rates are bounded, and SIGTERM ends the daemon within the unit's TimeoutStopSec.

On b0c0ecb one user's ``submit --sim-profile bert-inference --rps 1e12`` hung the simulated node
(every request is an event simulated under the node's lock before the next tick): ``status``
timed out and SIGTERM was ignored (the loop that reads the stop request never got back to it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.client import ApiClient
from gpushare.paths import repo_root
from tests.support import sim_daemon_helpers as helpers
from tests.support.sim_daemon_helpers import SimDaemon

UNIT = repo_root() / "systemd" / "gpushare.service"


def timeout_stop_s() -> float:
    """The shipped unit's TimeoutStopSec, in seconds."""
    match = re.search(r"^TimeoutStopSec=(\d+)(s|min)?$", UNIT.read_text(), re.MULTILINE)
    assert match is not None, f"no TimeoutStopSec in {UNIT}"
    return float(match[1]) * (60.0 if match[2] == "min" else 1.0)


def _sim() -> Iterator[SimDaemon]:
    absent = Path("/nonexistent/gpushare-test/nvidia-cuda-mps-control")
    with helpers.sim_daemon(absent) as d:
        yield d


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimDaemon]:
    """One daemon for the refusals (each changes nothing)."""
    yield from _sim()


@pytest.fixture
def sim() -> Iterator[SimDaemon]:
    """A daemon of the test's own (it is stopped)."""
    yield from _sim()


def status_s(d: SimDaemon, timeout_s: float = 5.0) -> float:
    """How long a ``status`` takes (fails when it takes over ``timeout_s``)."""
    t0 = time.monotonic()
    with ApiClient.connect(d.base / "run" / "gpushare.sock", timeout_s=timeout_s) as api:
        api.call("status", {})
    return time.monotonic() - t0


def kill_clients(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("rps", ["1e12", "inf", "nan", "0", "-3", "5001"])
def test_an_unreasonable_simulated_rate_is_refused_with_one_line(
    shared_sim: SimDaemon, rps: str
) -> None:
    sim = shared_sim
    res = sim.cli(
        "submit", "--online", "--detach", "--sim-profile", "bert-inference", "--rps", rps,
        "--", "sleep", "600",
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    # Non-finite numbers are refused by the CLI's option parsing, before the rate's own rule.
    says = ("'--rps': " if rps in ("inf", "nan") else "--rps must be a number of requests per "
            "second in (0, 5000]")  # fmt: skip
    assert says in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert status_s(sim) < 2.0


def test_the_daemon_refuses_a_rate_that_bypasses_the_cli(shared_sim: SimDaemon) -> None:
    """The API itself (any user can call it without the CLI) refuses the rate."""
    sim = shared_sim
    env = {**sim.env, "GPUSHARE_SIM_PROFILE": "bert-inference", "GPUSHARE_SIM_RPS": "1e12"}
    res = subprocess.run(
        [*helpers.GPUSHARE, "submit", "--online", "--detach", "--", "sleep", "600"],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--rps must be a number" in res.stderr and "Traceback" not in res.stderr
    assert status_s(sim) < 2.0
    listing = json.loads(sim.cli("list", "--json").stdout)["clients"]
    assert listing == []


def test_sigterm_ends_a_busy_simulated_daemon_within_timeout_stop_sec(sim: SimDaemon) -> None:
    pids: list[int] = []
    try:
        for argv in (
            ["--online", "--sim-profile", "bert-inference", "--rps", "5000"],
            ["--offline", "--sim-profile", "resnet50-train"],
            ["--offline", "--sim-profile", "bert-train"],
        ):
            res = sim.cli("submit", "--detach", *argv, "--", "sleep", "600")
            assert res.returncode == 0, res.stderr
        clients = json.loads(sim.cli("list", "--json").stdout)["clients"]
        pids += [c["pid"] for c in clients if c["pid"]]
        assert len(pids) == 3, clients
        time.sleep(2.0)  # busy: the online client's requests arrive at the highest rate
        assert status_s(sim) < 2.0, "the busy simulated node held the daemon's API"
        budget_s = timeout_stop_s()
        t0 = time.monotonic()
        sim.proc.send_signal(signal.SIGTERM)
        sim.proc.wait(timeout=budget_s)
        took = time.monotonic() - t0
        assert sim.proc.returncode == 0
        print(f"SIGTERM to exit: {took:.2f} s (TimeoutStopSec {budget_s:g} s)")
        assert took < budget_s
    finally:
        kill_clients(pids)


DEADLINE_SCRIPT = textwrap.dedent(
    """
    import signal, sys
    from gpushare.roots.daemon import StopDeadline
    from gpushare.logs import configure_logging
    configure_logging("info", json=True)
    signal.signal(signal.SIGTERM, lambda *_: None)  # recorded, never acted on: a stuck loop
    StopDeadline(deadline_s=float(sys.argv[1])).install()
    print("ready", flush=True)
    while True:
        pass
    """
)


@pytest.mark.parametrize("signals", [1, 2])
def test_a_stuck_daemon_still_ends_after_sigterm(signals: int) -> None:
    deadline_s = 1.0 if signals == 1 else 30.0  # a second SIGTERM ends it at once
    proc = subprocess.Popen(
        [sys.executable, "-c", DEADLINE_SCRIPT, str(deadline_s)],
        cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        t0 = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert proc.returncode == 1
        assert took < deadline_s + 1.0 if signals == 1 else took < 2.0
        assert proc.stderr is not None and "stop_overdue" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_stop_deadline_is_under_the_units_timeout_stop_sec() -> None:
    from gpushare.roots.daemon import STOP_DEADLINE_S

    assert timeout_stop_s() > STOP_DEADLINE_S
