"""A gang under its GPUs' controllers (issue 35), driven tick by tick in-process.

Real registry, socket and child processes on four fake GPUs; a policy scripted per GPU stands in
for each GPU's controller. A gang has one controller per GPU it uses: a hold (``Freeze``) by any
of them holds the whole gang until that same controller lets go, whatever the others say; and a
gang submit with ``--gpus N`` goes where D14 puts it, the GPUs where it may run the largest share
of the time beside the online services' request gates.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import cpu_ticks
from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.daemon.server import Caller
from gpushare.model import (
    Action,
    ClientState,
    Freeze,
    GateReading,
    Observation,
    SetGating,
    Thaw,
)
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.support.actions_daemon import stop_daemon

ROOT = Caller(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
BUSY = [sys.executable, "-c", "while True: pass"]
G0, G1, G2, G3 = (fake_uuid(k) for k in range(4))


class PerGpuPolicy:
    """Each GPU's controller returns the actions queued for that GPU at its next step."""

    name = "per-gpu"
    offline_mps_priority = 1
    gpu_mode = "mps"
    preemption = None

    def __init__(self) -> None:
        self.pending: dict[str, list[Action]] = {}
        self.seen: dict[str, Observation] = {}

    def initial_state(self, gpu_uuid: str, now: float) -> int:
        return 0

    def step(
        self, state: int, observation: Observation, now: float
    ) -> tuple[int, Sequence[Action]]:
        self.seen[observation.gpu_uuid] = observation
        return state + 1, self.pending.pop(observation.gpu_uuid, [])


@pytest.fixture
def env() -> Iterator[tuple[Daemon, PerGpuPolicy]]:
    base = Path(tempfile.mkdtemp(prefix="gsg-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
cancel_grace = "1s"
[control]
period = "100ms"
[probe]
enabled = false
""")
    policy = PerGpuPolicy()
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(gpus=4),
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=SignalPauser(), policy=policy,
        notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    try:
        yield d, policy
    finally:
        stop_daemon(d)
        shutil.rmtree(base, ignore_errors=True)


def _submit(d: Daemon, argv: list[str], **kw: Any) -> dict[str, Any]:
    params = {"cls": "offline", "argv": argv, "detach": True, "cwd": "/",
              "env": {"PATH": os.environ["PATH"]}, **kw}  # fmt: skip
    return d.api.submit(ROOT, params)


def _runs(d: Daemon, pid: int, ticks: int = 4) -> int:
    time.sleep(0.05)
    t0 = cpu_ticks(pid)
    d.run(max_ticks=ticks)
    return cpu_ticks(pid) - t0


def test_a_hold_by_one_gpus_controller_holds_the_gang_whatever_its_other_gpus_say(
    env: tuple[Daemon, PerGpuPolicy],
) -> None:
    d, policy = env
    gang = _submit(d, BUSY, gpus="0,1")
    cid = gang["client_id"]
    # GPU 0's controller holds the gang; in the same tick GPU 1's (stepped after) lets it go.
    policy.pending = {G0: [Freeze(cid, "memory pressure on GPU 0")], G1: [Thaw(cid, "GPU 1 ok")]}
    d.run(max_ticks=1)
    rec = d.registry.get(cid)
    assert (rec.state, rec.held) == (ClientState.FROZEN, True), rec
    assert _runs(d, gang["pid"]) <= 1, "GPU 1's Thaw released GPU 0's hold on the gang"
    # The hold is the gang's on every GPU it uses: status says why on both.
    for uuid in (G0, G1):
        last = d.state.ops.last_action(uuid)
        assert last is not None and (last.kind, last.client_id) == ("freeze", cid), uuid
    # GPU 1's controller thaws again: still GPU 0's hold.
    policy.pending = {G1: [Thaw(cid, "GPU 1 still ok")]}
    assert _runs(d, gang["pid"]) <= 1
    assert d.registry.get(cid).state is ClientState.FROZEN
    # Only GPU 0's own Thaw ends it.
    policy.pending = {G0: [Thaw(cid, "GPU 0 ok again")]}
    d.run(max_ticks=1)
    assert d.registry.get(cid).state is ClientState.RUNNING
    assert _runs(d, gang["pid"]) >= 5


def test_a_one_gpu_clients_hold_is_still_ended_by_its_controllers_thaw(
    env: tuple[Daemon, PerGpuPolicy],
) -> None:
    d, policy = env
    solo = _submit(d, BUSY, gpu="1")
    policy.pending = {G1: [Freeze(solo["client_id"], "hold")]}
    d.run(max_ticks=1)
    assert d.registry.get(solo["client_id"]).state is ClientState.FROZEN
    policy.pending = {G1: [Thaw(solo["client_id"], "go")]}
    d.run(max_ticks=1)
    assert d.registry.get(solo["client_id"]).state is ClientState.RUNNING


def test_a_gang_of_n_goes_where_the_online_services_gates_cost_it_least_d14(
    env: tuple[Daemon, PerGpuPolicy],
) -> None:
    d, _ = env
    # A TP server on GPUs 0 and 1 (one service, busy half the time), its 4 GiB promised on
    # both; one-GPU services on 2 and 3 (busy 0.4 each), which leave more memory free.
    tp = _submit(d, ["sleep", "60"], cls="online", gpu="0", mem_bytes=4 << 30)
    d.registry.update(tp["client_id"], gang=(G0, G1))
    for k in (2, 3):
        _submit(d, ["sleep", "60"], cls="online", gpu=str(k))
    busy = {G0: 0.5, G1: 0.5, G2: 0.4, G3: 0.4}
    real = d.state.gate.view

    def view(gpu_uuid: str, now: float) -> GateReading:  # the gates' measured shares
        return dataclasses.replace(real(gpu_uuid, now), busy_fraction=busy[gpu_uuid])

    d.state.gate.view = view  # type: ignore[method-assign]
    # D12 by memory would take 2 and 3: the windows both services leave are 0.6 * 0.6 = 0.36 of
    # the time; beside the one TP server the gang may run 0.5 of it.
    gang = _submit(d, ["sleep", "60"], gpus="2", mem_bytes=1 << 30)
    assert d.registry.get(gang["client_id"]).gpus() == (G0, G1)
    # With the TP server busy 0.9 of the time, the two one-GPU services cost the gang less.
    busy.update({G0: 0.9, G1: 0.9})
    other = _submit(d, ["sleep", "60"], gpus="2", mem_bytes=1 << 30)
    assert d.registry.get(other["client_id"]).gpus() == (G2, G3)
    # Where a gate runs a delay, D14 does not hold (docs/design.md D14): the memory rule (D12)
    # takes the GPUs with the most memory left (2 and 3: 4 GiB more than 0 and 1), where D14
    # would take the TP server's again.
    busy.update({G0: 0.5, G1: 0.5})
    d.loop.apply(SetGating(G2, True, "test", 0.002), 0.0)
    third = _submit(d, ["sleep", "60"], gpus="2", mem_bytes=1 << 30)
    assert d.registry.get(third["client_id"]).gpus() == (G2, G3)


def test_an_online_gangs_request_frees_every_gpu_it_uses_of_offline_work(
    env: tuple[Daemon, PerGpuPolicy],
) -> None:
    d, _ = env
    # A TP server on GPUs 0 and 1; an offline job on GPU 1 alone, one on GPU 2 alone.
    tp = _submit(d, ["sleep", "60"], cls="online", gpus="0,1")
    on1, on2 = _submit(d, BUSY, gpu="1"), _submit(d, BUSY, gpu="2")
    assert d.registry.get(tp["client_id"]).gpus() == (G0, G1)
    for uuid in (G0, G1, G2):
        d.loop.apply(SetGating(uuid, True, "test", 0.0), time.monotonic())
    d.run(max_ticks=1)
    # A request of the server (its boundaries hold rank 0's GPU's gate) runs on both GPUs.
    assert d.state.gate.on_inflight(tp["client_id"], tp["pid"], 1, time.monotonic()) is None
    assert _runs(d, on1["pid"]) <= 1, "offline work ran on GPU 1 beside the TP server's request"
    assert _runs(d, on2["pid"]) >= 5, "GPU 2 is not the server's: nothing to free there"
    assert d.state.gate.on_inflight(tp["client_id"], tp["pid"], 0, time.monotonic()) is None
    assert _runs(d, on1["pid"]) >= 5


def test_every_gpus_controller_sees_how_many_gpus_a_gang_spans(
    env: tuple[Daemon, PerGpuPolicy],
) -> None:
    # The controller's rules for gangs (no loose-SLO gate delay beside one, docs/controller.md)
    # read ClientView.gang_gpus: a gang's view on each of its GPUs says 2, a one-GPU client's 1.
    d, policy = env
    gang = _submit(d, BUSY, gpus="0,1")
    solo = _submit(d, BUSY, gpu="1")
    d.run(max_ticks=1)
    spans = {
        (uuid, c.client_id): c.gang_gpus for uuid, obs in policy.seen.items() for c in obs.clients
    }
    assert spans == {
        (G0, gang["client_id"]): 2,
        (G1, gang["client_id"]): 2,
        (G1, solo["client_id"]): 1,
    }
