"""Issue 32: a relaunched job's start-up measured by the daemon, and used as its restart cost.

A real daemon (real SQLite registry, real processes, the signal pauser) on a fake NVML
(tests/fakes): the test says when NVML first shows the relaunched process doing GPU work.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import wait_for
from gpushare import config
from gpushare.cli.render import render_clients
from gpushare.control.restart_cost import verdict
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.daemon.server import Caller
from gpushare.daemon.startcost import smoothed
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    Limits,
    ProcessMemory,
    RestartClient,
)
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import stop_daemon

ROOT = Caller(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
# Exits at once on SIGUSR2, its checkpoint signal: a restart takes no grace.
JOB = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(0))\n"
    "time.sleep(60)\n"
)


def _daemon(base: Path, gpu: FakeGpuBackend, control: str = "") -> tuple[Daemon, ScriptedPolicy]:
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
cancel_grace = "1s"
[control]
period = "100ms"
{control}
[probe]
enabled = false
""")
    uuid = gpu.sample()[0].uuid
    policy = ScriptedPolicy(uuid)
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=gpu,
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=SignalPauser(), policy=policy,
        notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    return d, policy


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gss-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _running(d: Daemon) -> Iterator[Daemon]:
    try:
        yield d
    finally:
        stop_daemon(d)


def _submit(d: Daemon, **kw: Any) -> dict[str, Any]:
    params = {"cls": "offline", "argv": [sys.executable, "-c", JOB], "detach": True, "cwd": "/",
              "gpu": "0", "env": {"PATH": os.environ["PATH"]}, "restartable": True,
              "checkpoint_signal": int(signal.SIGUSR2), **kw}  # fmt: skip
    return d.api.submit(ROOT, params)


def _restart(d: Daemon, policy: ScriptedPolicy, cid: str) -> int:
    """Restart ``cid`` through the controller's action; its new pid once relaunched."""
    old = d.registry.get(cid).pid
    policy.pending = [RestartClient(cid, 40.0, "test")]
    d.run(max_ticks=1)

    def relaunched() -> int | None:
        rec = d.registry.get(cid)
        ok = rec.state is ClientState.RUNNING and rec.pid not in (None, old)
        return rec.pid if ok else None

    pid = wait_for(relaunched, 10.0, "the relaunch")
    assert isinstance(pid, int)
    return pid


def _tick_until_measured(d: Daemon, cid: str) -> float:
    def measured() -> float | None:
        d.run(max_ticks=1)
        return d.registry.get(cid).startup_s

    found = wait_for(measured, 10.0, "the start-up measured")
    assert isinstance(found, float)
    return found


def _view(d: Daemon, cid: str, uuid: str) -> ClientView:
    d.run(max_ticks=1)
    return next(v for v in d.loop.views.of_gpu(uuid) if v.client_id == cid)


def _offline(d: Daemon, cid: str) -> dict[str, Any]:
    (c,) = [c for c in d.api.status(ROOT, {})["clients"] if c["id"] == cid]
    assert isinstance(c["offline"], dict)
    return c


def test_a_relaunch_is_timed_to_its_first_sm_work_kept_across_a_daemon_restart_and_used(
    base: Path,
) -> None:
    gpu = FakeGpuBackend(gpus=1)
    gpu.sm_busy = set()  # the driver gives per-process SM periods; nobody busy yet
    uuid = gpu.sample()[0].uuid
    d, policy = _daemon(base, gpu)
    with _running(d):
        cid = _submit(d)["client_id"]
        first = d.registry.get(cid).pid
        assert first is not None
        # A first launch is not measured: it loads no checkpoint.
        gpu.sm_busy = {first}
        for _ in range(3):
            d.run(max_ticks=1)
        assert d.registry.get(cid).startup_s is None
        gpu.sm_busy = set()
        pid = _restart(d, policy, cid)
        began = time.monotonic()
        time.sleep(0.6)  # its "imports and checkpoint load": NVML shows no work of it yet
        for _ in range(2):
            d.run(max_ticks=1)
        assert d.registry.get(cid).startup_s is None, "no GPU work seen, nothing measured"
        gpu.sm_busy = {pid}
        startup = _tick_until_measured(d, cid)
        assert 0.6 <= startup <= time.monotonic() - began + 0.5
        # What the controller gets: the measurement, as the restart cost (none was declared).
        view = _view(d, cid, uuid)
        assert (view.restart_cost_s, view.restart_cost_measured) == (startup, True)
        # ... and what the restart rule's line says.
        why = verdict(d.config.control, view, 80.0, 1.0, None, time.monotonic()).reason
        assert f"costing {startup:.0f}s (measured)" in why
        c = _offline(d, cid)
        assert c["offline"]["restart_cost"] == {
            "s": startup, "source": "measured", "declared_s": None, "measured_s": startup,
        }  # fmt: skip
        assert "RESTART COST" in render_clients([c], wide=True)
        assert f"{startup:.1f}s (measured)" in render_clients([c], wide=True)
        events = [e for e in d.registry.events() if e.kind == "client_startup_measured"]
        assert len(events) == 1 and events[0].client_id == cid
    # A new daemon on the same database knows it.
    reg = Registry.open(base / "state" / "gpushare.db")
    try:
        assert reg.get(cid).startup_s == startup
    finally:
        reg.close()


def test_without_per_process_utilisation_a_context_in_the_process_list_is_the_sign(
    base: Path,
) -> None:
    gpu = FakeGpuBackend.uniform(1, 0)  # no SM periods (sm_periods None), no processes
    uuid = gpu.sample()[0].uuid
    d, policy = _daemon(base, gpu)
    with _running(d):
        cid = _submit(d)["client_id"]
        pid = _restart(d, policy, cid)
        time.sleep(0.3)
        d.run(max_ticks=1)
        assert d.registry.get(cid).startup_s is None
        # Another process on the GPU is not this client's work.
        gpu.set(0, processes=(ProcessMemory(os.getpid(), None),))
        d.run(max_ticks=1)
        assert d.registry.get(cid).startup_s is None
        gpu.set(0, processes=(ProcessMemory(os.getpid(), None), ProcessMemory(pid, None)))
        assert _tick_until_measured(d, cid) >= 0.3
        assert _view(d, cid, uuid).restart_cost_measured


def test_a_job_that_delays_its_first_gpu_work_counts_for_at_most_the_cap(base: Path) -> None:
    gpu = FakeGpuBackend(gpus=1)
    gpu.sm_busy = set()
    uuid = gpu.sample()[0].uuid
    d, policy = _daemon(base, gpu, 'restart_cost_measured_max = "500ms"')
    with _running(d):
        cid = _submit(d)["client_id"]
        pid = _restart(d, policy, cid)
        time.sleep(1.0)  # twice the cap before it touches the GPU
        gpu.sm_busy = {pid}
        assert _tick_until_measured(d, cid) == 0.5
        assert _view(d, cid, uuid).restart_cost_s == 0.5
        assert _offline(d, cid)["offline"]["restart_cost"]["s"] == 0.5


def test_a_declared_cost_wins_over_the_measured_one(base: Path) -> None:
    gpu = FakeGpuBackend(gpus=1)
    gpu.sm_busy = set()
    uuid = gpu.sample()[0].uuid
    d, policy = _daemon(base, gpu)
    with _running(d):
        cid = _submit(d, restart_cost_s=90.0)["client_id"]
        gpu.sm_busy = {_restart(d, policy, cid)}
        measured = _tick_until_measured(d, cid)
        view = _view(d, cid, uuid)
        assert (view.restart_cost_s, view.restart_cost_measured) == (90.0, False)
        assert _offline(d, cid)["offline"]["restart_cost"] == {
            "s": 90.0, "source": "declared", "declared_s": 90.0, "measured_s": measured,
        }  # fmt: skip


def test_a_job_never_relaunched_costs_the_configs_default_in_status(base: Path) -> None:
    d, _ = _daemon(base, FakeGpuBackend(gpus=1))
    with _running(d):
        cid = _submit(d)["client_id"]
        assert _offline(d, cid)["offline"]["restart_cost"] == {
            "s": 60.0, "source": "default", "declared_s": None, "measured_s": None,
        }  # fmt: skip


def test_measurements_are_capped_then_averaged_half_and_half() -> None:
    assert smoothed(None, 12.0, 300.0) == 12.0
    assert smoothed(12.0, 30.0, 300.0) == 21.0
    # One start-up far past the cap moves the kept value by half the cap's distance at most.
    assert smoothed(12.0, 1e9, 300.0) == 156.0
    assert smoothed(None, -1.0, 300.0) == 0.0


def test_the_restart_rules_line_says_a_cost_is_measured_only_when_it_is() -> None:
    cfg = config.loads("version = 1\n").control
    plain = ClientView("c1", ClientClass.OFFLINE, ClientState.RUNNING, Limits(50.0, None, 1), 0,
                       restartable=True, restart_cost_s=12.0)  # fmt: skip
    assert "costing 12s needs" in verdict(cfg, plain, 80.0, 1.0, None, 1e6).reason
    measured = replace(plain, restart_cost_measured=True)
    assert "costing 12s (measured) needs" in verdict(cfg, measured, 80.0, 1.0, None, 1e6).reason


def test_a_database_from_before_measured_start_ups_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    Registry.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE clients DROP COLUMN startup_s")
        conn.execute("INSERT INTO clients (id, cls, argv, uid, gid, user, priority, restartable,"
                     " checkpoint_signal, detach, env, state, submitted_at) VALUES"
                     " ('c1', 'offline', '[]', 0, 0, 'root', 1, 1, 10, 1, '{}', 'running', 1.0)")  # fmt: skip
    conn.close()
    reg = Registry.open(path)
    assert reg.get("c1").startup_s is None
    assert reg.events() == []  # not moved aside as corrupt
    reg.update("c1", startup_s=42.5)
    reg.close()
    reg = Registry.open(path)
    assert reg.get("c1").startup_s == 42.5
    reg.close()
