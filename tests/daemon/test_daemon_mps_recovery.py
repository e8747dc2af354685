"""The daemon's MPS side under the controller's actions: the offline share, ``RecoverMps`` (offline
clients removed, restartable ones requeued), alerts, and whether shutdown stops MPS.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from bench.support.daemon_helpers import wait_for
from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.model import Alert, ClientState, RecoverMps, SetOfflineShare, Severity
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import GPU0, ROOT, _submit


def test_share_recover_alert(env: tuple[Daemon, ScriptedPolicy, FakeMpsNode]) -> None:
    d, policy, mps = env
    policy.pending = [SetOfflineShare(GPU0, 35.0, "online load"),
                      RecoverMps(GPU0, "fault"), Alert(GPU0, Severity.CRITICAL, "SLO broken")]  # fmt: skip
    o = _submit(d, ["sleep", "30"])
    d.run(max_ticks=1)
    assert mps.recovered == [(GPU0, (o["pid"],), ())]
    r = _submit(d, ["sleep", "30"])
    assert r["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "35"
    kinds = {(e.kind, e.severity) for e in d.registry.events()}
    assert {
        ("offline_share_changed", "info"),
        ("mps_recovery", "warning"),
        ("alert", "critical"),
    } <= kinds
    assert d.api.status(ROOT, {})["gpus"][0]["offline_sm_pct"] == 35.0


@pytest.mark.parametrize("stop_mps", [False, True])
def test_shutdown_leaves_mps_running_unless_configured(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode], stop_mps: bool
) -> None:
    d, _, mps = env
    r = _submit(d, ["sleep", "30"])
    d.config = config.loads(f"""version = 1
[paths]
runtime_dir = "{d.config.paths.runtime_dir}"
state_dir = "{d.config.paths.state_dir}"
[daemon]
stop_mps_on_exit = {str(stop_mps).lower()}
""")
    d.shutdown()
    d.shutdown()  # idempotent
    # Supervision always stops; the MPS daemons quit only when configured to.
    assert mps.stopped == [stop_mps]
    os.kill(r["pid"], 0)  # the workload is left running either way


def test_mps_recovery_removes_offline_clients_and_requeues_restartable_ones(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    """The faulted server refuses new clients until every old one is gone (docs/design.md §2).

    MPS's terminate_client kills a client's GPU work, not its process: the daemon makes sure the
    offline processes go, puts restartable ones back in the queue without counting the fault as
    their failure, and leaves online clients to reconnect.
    """
    d, policy, mps = env
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]  # fmt: skip
    job = _submit(d, stubborn, restartable=True)
    other = _submit(d, stubborn)
    online = _submit(d, ["sleep", "60"], cls="online")
    policy.pending = [RecoverMps(GPU0, "MPS server in FAULT")]
    d.run(max_ticks=1)
    assert mps.recovered == [(GPU0, (job["pid"], other["pid"]), (online["pid"],))]

    def queued_event() -> list[Any]:
        return [e for e in d.registry.events(limit=1000)
                if e.kind == "client_queued" and e.client_id == job["client_id"]]  # fmt: skip

    def gone() -> bool:
        d.run(max_ticks=1)
        return d.registry.get(other["client_id"]).state.is_final and bool(queued_event())

    wait_for(gone, 5.0, "the offline clients to be removed")
    assert "MPS server in FAULT" in queued_event()[0].message
    assert d.registry.get(job["client_id"]).failures == 0
    stopped = d.registry.get(other["client_id"])
    assert stopped.state is ClientState.FAILED and "MPS" in (stopped.reason or "")
    assert d.registry.get(online["client_id"]).state is ClientState.RUNNING
