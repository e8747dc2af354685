"""The daemon carries out ``Evict`` (terminate, then kill, then requeue) and ``RestartClient``
(checkpoint and relaunch), and counts evictions per client across requeues.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from bench.support.daemon_helpers import wait_for
from gpushare.daemon.core import Daemon
from gpushare.model import ClientState, Evict, RestartClient
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import GPU0, ROOT, _submit


def test_evict_terminates_then_kills_and_requeues(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, policy, mps = env
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]  # fmt: skip
    r = _submit(d, stubborn, restartable=True)
    o = _submit(d, ["sleep", "60"])
    policy.pending = [
        Evict(r["client_id"], True, "reserve"),
        Evict(o["client_id"], True, "reserve"),
    ]
    d.run(max_ticks=1)
    assert mps.terminated == [(GPU0, r["pid"]), (GPU0, o["pid"])]
    start = time.monotonic()

    def requeued() -> bool:
        d.run(max_ticks=1)
        return any(
            e.kind == "client_queued" and e.client_id == r["client_id"] for e in d.registry.events()
        )

    wait_for(requeued, what="restartable evictee requeued")
    assert time.monotonic() - start >= 0.3  # the kill waited for evict_grace
    queued = next(e for e in d.registry.events() if e.kind == "client_queued")
    assert queued.data is not None
    assert queued.data["reason"] == "reserve"

    def failed() -> bool:
        d.run(max_ticks=1)
        return d.registry.get(o["client_id"]).state is ClientState.FAILED

    wait_for(failed, what="non-restartable evictee failed")
    assert d.registry.get(o["client_id"]).reason == "evicted: reserve"
    assert d.registry.get(o["client_id"]).exit_code == -signal.SIGKILL
    # Admission starts the queued job again (a new process, the GPU's offline share).
    d.run(max_ticks=1)
    rec = d.registry.get(r["client_id"])
    assert (rec.state, rec.sm_pct) == (ClientState.RUNNING, 50.0)
    assert rec.pid not in (None, r["pid"])


def test_restart_client_checkpoints_and_relaunches(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode], tmp_path: Path
) -> None:
    d, policy, _ = env
    script = ("import os, signal, sys, time\n"
              "print('start', os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'], flush=True)\n"
              "signal.signal(signal.SIGUSR2, lambda *a: (print('checkpoint', flush=True), sys.exit(0)))\n"
              "time.sleep(60)\n")  # fmt: skip
    r = _submit(d, [sys.executable, "-c", script], restartable=True, checkpoint_signal=signal.SIGUSR2,
                sm_pct=50.0)  # fmt: skip
    time.sleep(0.3)
    policy.pending = [RestartClient(r["client_id"], 30.0, "online demand up")]
    d.run(max_ticks=1)
    wait_for(
        lambda: (d.registry.get(r["client_id"]).restarts, d.registry.get(r["client_id"]).state)
        == (1, ClientState.RUNNING),
        what="relaunch",
    )
    rec = d.registry.get(r["client_id"])
    assert (rec.state, rec.sm_pct) == (ClientState.RUNNING, 30.0)
    wait_for(lambda: "start 30" in Path(r["log_path"]).read_text(), what="relaunched output")
    assert Path(r["log_path"]).read_text().splitlines()[:3] == [
        "start 50",
        "checkpoint",
        "start 30",
    ]


def test_evictions_are_counted_per_client_and_survive_requeue(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, policy, _ = env
    r = _submit(d, ["sleep", "60"], restartable=True)
    policy.pending = [Evict(r["client_id"], True, "reserve")]
    d.run(max_ticks=1)
    gate = d.api.status(ROOT, {"gpu": "0"})["gpus"][0]["gate"]
    assert gate["last_action"]["kind"] == "evict"
    assert gate["last_action"]["client_id"] == r["client_id"]

    def relaunched() -> bool:
        d.run(max_ticks=1)
        rec = d.registry.get(r["client_id"])
        return rec.state is ClientState.RUNNING and rec.pid != r["pid"]

    wait_for(relaunched, what="evicted job requeued and admitted again")
    c = next(c for c in d.api.list(ROOT, {})["clients"] if c["id"] == r["client_id"])
    assert c["offline"]["evictions"] == 1
    assert d.state.ops.gpu_evictions(GPU0) == 1
    # The submit started it at once; the requeued run went through admission.
    assert d.state.ops.admission(0, time.time()).wait_s.count == 1
