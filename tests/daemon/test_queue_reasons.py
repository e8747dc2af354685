"""A queued job says why it waits: ``status`` and ``list`` show admission's reason.

End to end, a real daemon process (``tests/support/daemon_proc.py``: its loop, socket, SQLite and
pauser, the ``gpushare`` policy) on the fake GPU whose memory a test sets
(``tests/fakes/fake_dutyprobe.py``); the job is submitted and inspected through the real CLI.
In-process, the daemon driven tick by tick, for what it keeps: the reasons of the queue only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import REPO, DaemonProc, duty_gpu_daemon, wait_for
from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.daemon.server import Caller
from gpushare.model import ClientClass, ClientState
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import GIB, FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode

IDLE = "import time\nwhile True: time.sleep(0.05)"


def _gpushare(dp: DaemonProc, *args: str) -> str:
    out = subprocess.run(
        # --socket before the arguments: `submit` takes everything after `--` as the command.
        [sys.executable, "-m", "gpushare", args[0], "--socket", str(dp.socket), *args[1:]],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"gpushare {' '.join(args)}: {out.stderr}"
    return out.stdout


def _clients(dp: DaemonProc, *args: str) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in json.loads(_gpushare(dp, *args, "--json"))["clients"]}


@pytest.fixture
def dp() -> Any:
    pauser = "cgroup" if cgroup_skip_reason() is None else "signal"
    dp, _ = duty_gpu_daemon('[control]\nperiod = "50ms"\nevict_grace = "300ms"\n', pauser)
    try:
        yield dp.start()
    finally:
        dp.cleanup()


def test_a_job_queued_for_memory_shows_why_until_it_starts(dp: DaemonProc) -> None:
    mem_used = dp.base / "gpu" / "mem_used"
    out = _gpushare(dp, "submit", "--offline", "--restartable", "--mem", "4G", "--gpu", "0",
                    "--", sys.executable, "-c", IDLE)  # fmt: skip
    job = out.split()[0]
    assert _clients(dp, "list")[job]["waiting"] is None  # running: nothing to wait for

    # The online side grows to 11 GiB: 1 GiB left, under the 2 GiB reserve. The controller
    # evicts the restartable job and requeues it; its 4 GiB do not fit in the 5 GiB now free
    # beside the reserve, so admission leaves it queued and says so.
    mem_used.write_text(str(11 * GIB))
    why = "cannot start: GPU 0: needs 6G with 2G kept for online clients, 5G free"

    def queued_with_reason() -> bool:
        c = dp.client(job)
        return c["state"] == "queued" and c["waiting"] is not None

    wait_for(queued_with_reason, 10.0, "the eviction and an admission round")
    status = json.loads(_gpushare(dp, "status", "--json"))
    [queued] = [c for c in status["clients"] if c["id"] == job]
    assert (queued["state"], queued["waiting"]) == ("queued", why)
    listed = _clients(dp, "list")[job]
    assert (listed["state"], listed["waiting"]) == ("queued", why)
    # The human views give it under the client tables.
    assert f"{job}: queued: {why}" in _gpushare(dp, "status").splitlines()
    assert f"{job}: queued: {why}" in _gpushare(dp, "status", "-o", "wide").splitlines()
    assert why.removeprefix("cannot start: ").startswith(
        _gpushare(dp, "list").splitlines()[1].split("   ")[-1].rstrip("~")
    )

    # Memory comes back: admission starts the job, and no reason is left behind.
    mem_used.write_text(str(1 * GIB))
    wait_for(lambda: dp.client(job)["state"] == "running", 10.0, "the readmission")
    status = json.loads(_gpushare(dp, "status", "--json"))
    [running] = [c for c in status["clients"] if c["id"] == job]
    assert (running["state"], running["waiting"]) == ("running", None)
    assert _clients(dp, "list")[job]["waiting"] is None
    assert "queued:" not in _gpushare(dp, "list")


def _queue(d: Daemon, caller: Caller, mem_bytes: int) -> str:
    """A restartable job back in the queue (as after an eviction), never started here."""
    return d.registry.add_client(
        cls=ClientClass.OFFLINE, argv=["sleep", "60"], uid=caller.uid, gid=caller.gid,
        user="root", state=ClientState.QUEUED, priority=1, mem_bytes=mem_bytes,
        restartable=True, detach=True, cwd="/",
    ).id  # fmt: skip


def test_the_daemon_keeps_reasons_for_queued_jobs_only() -> None:
    """Reasons are replaced every round and dropped with the queue: they cannot pile up."""
    base = Path(tempfile.mkdtemp(prefix="gsq-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[probe]
enabled = false
""")
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(gpus=1),
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=SignalPauser(), policy=None, notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    try:
        root = Caller(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
        # Two requeued jobs too large for the 16 GiB GPU (1 GiB used, 2 GiB kept for online work).
        jobs = [_queue(d, root, size * GIB) for size in (20, 30)]
        assert d.state.waiting == {}
        d.run(max_ticks=1)
        assert d.state.waiting == {
            jobs[0]: "cannot start: GPU 0: needs 22G with 2G kept for online clients, 15G free",
            jobs[1]: "cannot start: GPU 0: needs 32G with 2G kept for online clients, 15G free",
        }
        listed = {c["id"]: c["waiting"] for c in d.api.list(root, {})["clients"]}
        assert listed == d.state.waiting
        d.api.cancel(root, {"client_id": jobs[0]})
        # Cancelled, it is no longer queued: the API shows no reason at once, the next round
        # forgets it, and the round after the queue empties forgets everything.
        ended = {c["id"]: c for c in d.api.list(root, {"all": True})["clients"]}[jobs[0]]
        assert (ended["state"], ended["waiting"]) == ("exited", None)
        d.run(max_ticks=1)
        assert list(d.state.waiting) == [jobs[1]]
        d.api.cancel(root, {"client_id": jobs[1]})
        d.run(max_ticks=1)
        assert d.state.waiting == {}
    finally:
        d.shutdown()
        d.registry.close()
        shutil.rmtree(base, ignore_errors=True)
