"""The node Protocols on the simulated node: what a daemon driving it would see and do."""

from __future__ import annotations

from pathlib import Path

from gpushare.model import ClientState, MpsState, PauseMechanism
from gpushare.sim import adapters as simnode
from gpushare.sim import scenario
from gpushare.sim.node import SimNode

SCENARIO = """
[scenario]
duration = "10s"
[[online]]
name = "inf"
profile = "orion-v100-kernels/resnet50_4_fwd.csv"
load = 0.5
[[offline]]
name = "train"
profile = "orion-v100-kernels/mobilenetv2_32_fb1.csv"
mem = "6GiB"
"""


ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_CLIENT_PRIORITY": "1"}


def started_node() -> SimNode:
    n = SimNode(scenario.loads(SCENARIO))
    n.start()
    simnode.SimProcesses(n).spawn(
        ["train"], uid=1000, gid=1000, cwd="/", env=ENV, log_dir=Path("/nonexistent"),
        client_id="train",
    )  # fmt: skip
    n.loop.run_until(2.0)
    return n


def test_backend_and_probe_readings(tmp_path: Path) -> None:
    n = started_node()
    backend, probe, pauser, mps = simnode.protocols(n, tmp_path)
    (first,) = backend.sample()
    assert first.gpu_util_pct is None  # no interval yet: unknown, never zero
    n.loop.run_until(3.0)
    (sample,) = backend.sample()
    assert sample.uuid == n.gpus[0].uuid
    assert sample.mem_used_bytes == (2 << 30) + (6 << 30)
    assert sample.mem_free_bytes == (16 << 30) - sample.mem_used_bytes
    assert sample.gpu_util_pct is not None
    assert 50.0 < sample.gpu_util_pct <= 100.0  # training runs most of the time
    assert {p.pid for p in sample.processes} == {n.online[0].pid, n.offline[0].pid}
    reading = probe.reading(sample.uuid)
    assert reading.samples > 10
    assert reading.latency_ms is not None
    assert reading.latency_ms >= 0.015
    assert probe.reading("GPU-nope").reason is not None
    assert backend.drain_events() == ()
    assert mps.state(sample.uuid) is MpsState.UP
    assert mps.state("GPU-nope") is MpsState.UNKNOWN
    assert mps.pipe_dir(sample.uuid) == tmp_path / "mps" / sample.uuid
    assert pauser.mechanism is PauseMechanism.CGROUP


def test_pauser_freezes_and_kills(tmp_path: Path) -> None:
    n = started_node()
    _, _, pauser, _ = simnode.protocols(n, tmp_path)
    train = n.offline[0]
    pauser.attach("train", train.pid)
    assert pauser.pids("train") == [train.pid]
    pauser.freeze("train")
    n.loop.run_until(3.0)  # the issued iteration drains
    issued = train.counts.issued
    n.loop.run_until(4.0)
    assert train.counts.issued == issued
    assert train.state is ClientState.FROZEN
    pauser.thaw("train")
    n.loop.run_until(5.0)
    assert train.counts.issued > issued
    pauser.kill("train")
    assert train.state is ClientState.EXITED
    assert pauser.pids("train") == []
    pauser.release("train")


def test_terminate_client_and_recover_order(tmp_path: Path) -> None:
    n = started_node()
    _, _, _, mps = simnode.protocols(n, tmp_path)
    uuid = n.gpus[0].uuid
    assert not mps.terminate_client(uuid, 999_999)
    mps.recover(uuid, [n.offline[0].pid], [])
    assert n.offline[0].state is ClientState.EXITED
    assert n.online[0].state is ClientState.RUNNING
    before = len(n.online[0].completed)
    assert mps.terminate_client(uuid, n.online[0].pid)
    n.loop.run_until(4.0)
    assert len(n.online[0].completed) == before
    assert n.gpus[0].held_sms <= 1  # only the probe may hold an SM
