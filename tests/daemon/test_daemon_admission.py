"""The daemon's admission: the MPS client slots count live clients, and the memory of a job
admitted the tick before counts.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import os

import pytest

from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.model import ClientClass, ClientState
from gpushare.protocol import ErrorCode, ProtocolError
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import ROOT, _submit


def test_slot_limit_counts_live_clients(env: tuple[Daemon, ScriptedPolicy, FakeMpsNode]) -> None:
    d, _, _ = env
    d.config = config.loads(
        d.config.paths
        and f"""version = 1
[paths]
runtime_dir = "{d.config.paths.runtime_dir}"
state_dir = "{d.config.paths.state_dir}"
[mps]
max_clients = 2
[probe]
enabled = true
"""
    )
    _submit(d, ["sleep", "30"])
    with pytest.raises(ProtocolError) as info:
        _submit(d, ["sleep", "30"], no_queue=True)
    assert info.value.code is ErrorCode.NO_CAPACITY
    assert "client slots" in info.value.message
    assert "latency probe" in info.value.message


def test_admission_counts_the_mem_of_a_job_admitted_the_tick_before(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    """A started job's --mem is promised to it (D12): the next tick does not start a second one."""
    d, policy, _ = env
    # Fake GPU 0: 16G with 1G used, and NVML lists no processes, so a started job never shows its
    # memory. 15G free less the 2G online reserve leave 13G: one 7G job fits, two do not.

    def queue() -> str:
        rec = d.registry.add_client(
            cls=ClientClass.OFFLINE, argv=["sleep", "60"], uid=ROOT.uid, gid=ROOT.gid,
            user="test", state=ClientState.QUEUED, priority=1, gpu_request="0",
            mem_bytes=7 << 30, restartable=True, detach=True, cwd="/",
            env={"PATH": os.environ["PATH"]}, pause_mechanism=d.state.pauser.mechanism.value,
        )  # fmt: skip
        return rec.id

    first = queue()
    d.run(max_ticks=1)
    assert d.registry.get(first).state.is_live
    second = queue()
    policy.seen.clear()
    d.run(max_ticks=3)
    # NVML's free memory never moved; the first job's view carries what the promise needs.
    assert {o.sample.mem_free_bytes for o in policy.seen} == {15 << 30}
    view = next(c for o in policy.seen for c in o.clients if c.client_id == first)
    assert (view.limits.pinned_mem_bytes, view.mem_used_bytes) == (7 << 30, None)
    assert view.started_at_s is not None
    assert d.registry.get(second).state is ClientState.QUEUED
