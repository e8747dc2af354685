"""The daemon carries out the duty cycle: ``SetDuty`` throttles offline work's CPU share, a freeze
hold wins over it, a client going away is not refrozen, and a gang freezes whole.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.support.daemon_helpers import cpu_ticks, wait_for
from gpushare.daemon.core import Daemon
from gpushare.model import ClientState, Freeze, SetDuty, Thaw
from tests.fakes.fake_gpu import fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import BUSY, GPU0, ROOT, _submit


def test_duty_cycle_throttles_cpu_share(env: tuple[Daemon, ScriptedPolicy, FakeMpsNode]) -> None:
    d, policy, _ = env
    r = _submit(d, BUSY)
    pid = r["pid"]
    policy.pending = [SetDuty(GPU0, 0.0, "test")]
    d.run(max_ticks=2)
    assert d.registry.get(r["client_id"]).state is ClientState.THROTTLED
    time.sleep(0.05)
    t0 = cpu_ticks(pid)
    d.run(max_ticks=5)
    assert cpu_ticks(pid) - t0 <= 1, "duty 0 must keep offline work frozen"
    policy.pending = [SetDuty(GPU0, 0.5, "test")]
    # The share is measured against an unthrottled busy process running meanwhile, not against
    # wall time: on a loaded machine a busy process gets far less than a core even unthrottled.
    reference = subprocess.Popen(BUSY)
    try:
        c1, r1 = cpu_ticks(pid), cpu_ticks(reference.pid)
        d.run(max_ticks=20)
        used, ref_used = cpu_ticks(pid) - c1, cpu_ticks(reference.pid) - r1
    finally:
        reference.kill()
        reference.wait()
    share = used / max(ref_used, 1)
    # Wide bounds: under load the duty edges come late (the daemon's thread waits for a core),
    # which moves the share; what must hold is neither frozen for good nor unthrottled.
    assert 0.1 < share < 0.9, f"duty 0.5 gave {share:.2f} of an unthrottled process's CPU"
    policy.pending = [SetDuty(GPU0, 1.0, "test")]
    d.run(max_ticks=1)
    assert d.registry.get(r["client_id"]).state is ClientState.RUNNING


def test_freeze_hold_wins_over_duty(env: tuple[Daemon, ScriptedPolicy, FakeMpsNode]) -> None:
    d, policy, _ = env
    r = _submit(d, BUSY)
    policy.pending = [Freeze(r["client_id"], "memory pressure")]
    d.run(max_ticks=2)
    rec = d.registry.get(r["client_id"])
    assert (rec.state, rec.held, rec.reason) == (ClientState.FROZEN, True, "memory pressure")
    t0 = cpu_ticks(r["pid"])
    d.run(max_ticks=4)
    assert cpu_ticks(r["pid"]) - t0 <= 1
    policy.pending = [Thaw(r["client_id"], "ok again")]
    d.run(max_ticks=1)
    assert d.registry.get(r["client_id"]).state is ClientState.RUNNING
    t1 = cpu_ticks(r["pid"])
    d.run(max_ticks=4)
    assert cpu_ticks(r["pid"]) - t1 >= 5


def test_a_client_going_away_is_not_refrozen_by_the_duty_cycle(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode], tmp_path: Path
) -> None:
    """A cancel under duty 0 thaws the client; later ticks must let it finish its clean exit."""
    d, policy, _ = env
    marker = tmp_path / "checkpointed"
    slow_exit = [sys.executable, "-c", (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(0.4)\n"
        f"    open({str(marker)!r}, 'w').write('ok')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "while True: time.sleep(0.01)\n"
    )]  # fmt: skip
    r = _submit(d, slow_exit)
    time.sleep(0.3)  # its handler is installed
    policy.pending = [SetDuty(GPU0, 0.0, "test")]
    d.run(max_ticks=2)
    assert d.registry.get(r["client_id"]).state is ClientState.THROTTLED
    d.api.cancel(ROOT, {"client_id": r["client_id"]})

    def ended() -> bool:
        d.run(max_ticks=1)
        return d.registry.get(r["client_id"]).state.is_final

    wait_for(ended, 5.0, "the cancelled client to end")
    rec = d.registry.get(r["client_id"])
    assert (rec.state, rec.exit_code) == (ClientState.EXITED, 0), rec.reason
    assert marker.read_text() == "ok"


def test_a_duty_freeze_on_any_gpu_of_a_gang_freezes_the_whole_gang(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, policy, _ = env
    gang = _submit(d, BUSY, gpu="any", gpus="0,1")
    solo = _submit(d, BUSY)  # a one-GPU client of GPU 0
    assert d.registry.get(gang["client_id"]).gpus() == (GPU0, fake_uuid(1))
    d.run(max_ticks=1)
    # Each GPU's controller sees the gang's rank there as one of its offline clients.
    seen = {o.gpu_uuid: {c.client_id for c in o.clients} for o in policy.seen[-2:]}
    assert seen == {GPU0: {gang["client_id"], solo["client_id"]}, fake_uuid(1): {gang["client_id"]}}
    # GPU 1's duty 0 freezes the gang (every rank, one cgroup) and leaves GPU 0's own client alone.
    policy.pending = [SetDuty(fake_uuid(1), 0.0, "test")]
    d.run(max_ticks=2)
    assert d.registry.get(gang["client_id"]).state is ClientState.THROTTLED
    assert d.registry.get(solo["client_id"]).state is ClientState.RUNNING
    time.sleep(0.05)
    t0, s0 = cpu_ticks(gang["pid"]), cpu_ticks(solo["pid"])
    d.run(max_ticks=5)
    assert cpu_ticks(gang["pid"]) - t0 <= 1, "GPU 1's duty 0 must keep the whole gang frozen"
    assert cpu_ticks(solo["pid"]) - s0 >= 5
    policy.pending = [SetDuty(fake_uuid(1), 1.0, "test")]
    d.run(max_ticks=1)
    assert d.registry.get(gang["client_id"]).state is ClientState.RUNNING
