"""The simulated node in real time: clients by profile name, Protocols advancing with the clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.config import Config
from gpushare.model import ClientClass, ClientState
from gpushare.sim.realtime import FORGET_PERIOD_S, RealTimeSimNode, SimProfileError, SimWorkload
from tests.fakes.fake_clock import ManualClock


def test_clients_run_as_the_clock_advances(tmp_path: Path) -> None:
    clock = ManualClock(100.0)
    rt = RealTimeSimNode(1, Config(), runtime_dir=tmp_path, clock=clock)
    served: list[str] = []
    rt.on_latency = lambda cid, _lat, _at: served.append(cid)
    (uuid,) = rt.gpu_uuids
    assert rt.add_client(
        "inf",
        ClientClass.ONLINE,
        SimWorkload("resnet50-inference", rps=40.0),
        gpu_uuid=uuid,
        sm_pct=100,
        mem_bytes=2 << 30,
        pid=11,
    )
    assert rt.add_client(
        "train",
        ClientClass.OFFLINE,
        SimWorkload("resnet50-train"),
        gpu_uuid=uuid,
        sm_pct=50,
        mem_bytes=6 << 30,
        pid=12,
    )
    backend, probe, pauser = rt.gpu_backend(), rt.latency_probe(), rt.pauser()
    backend.sample()
    clock.t += 2.0
    (sample,) = backend.sample()
    assert rt.node.loop.now == pytest.approx(2.0)
    assert sample.mem_used_bytes == 8 << 30
    assert sample.gpu_util_pct is not None
    assert sample.gpu_util_pct > 50
    assert probe.reading(uuid).samples > 10
    train = rt.node.client("train")
    assert train is not None
    iterations = len(train.iterations)  # type: ignore[attr-defined]
    assert iterations > 5
    pauser.attach("train", 12)
    pauser.freeze("train")
    clock.t += 1.0
    rt.advance()
    frozen_at = len(train.iterations)  # type: ignore[attr-defined]
    clock.t += 2.0
    rt.advance()
    assert len(train.iterations) == frozen_at  # type: ignore[attr-defined]
    pauser.thaw("train")
    clock.t += 1.0
    rt.advance()
    assert len(train.iterations) > frozen_at  # type: ignore[attr-defined]
    assert len(served) > 150 and set(served) == {"inf"}
    rt.remove_client("train")
    assert train.state is ClientState.EXITED
    assert rt.mps_node().terminate_client(uuid, 11)


def test_bad_profiles_are_refused_with_the_fix(tmp_path: Path) -> None:
    rt = RealTimeSimNode(1, Config(), runtime_dir=tmp_path, clock=ManualClock(100.0))
    (uuid,) = rt.gpu_uuids
    kw = {"gpu_uuid": uuid, "sm_pct": 100.0, "mem_bytes": 1 << 30, "pid": 1}
    with pytest.raises(SimProfileError, match="valid: bert-inference"):
        rt.add_client("a", ClientClass.ONLINE, SimWorkload("gpt-9", rps=1.0), **kw)
    with pytest.raises(SimProfileError, match="needs --rps"):
        rt.add_client("a", ClientClass.ONLINE, SimWorkload("bert-inference"), **kw)
    with pytest.raises(SimProfileError, match="is an offline workload"):
        rt.add_client("a", ClientClass.ONLINE, SimWorkload("bert-train", rps=3.0), **kw)
    assert not rt.add_client(
        "big", ClientClass.OFFLINE, SimWorkload("bert-train"), **{**kw, "mem_bytes": 64 << 30}
    )


def test_simulated_services_send_request_boundaries_to_the_daemons_gate(tmp_path: Path) -> None:
    import time

    from gpushare.daemon.freeze import by_gate
    from gpushare.daemon.gating import Gatekeeper

    clock = ManualClock(100.0)
    rt = RealTimeSimNode(1, Config(), runtime_dir=tmp_path, clock=clock)
    (uuid,) = rt.gpu_uuids
    pauser = rt.pauser()
    gate = Gatekeeper(Config().gate, pauser, clock=clock)
    seen: list[int] = []

    def deliver(client_id: str, pid: int, count: int, at_s: float) -> None:
        seen.append(count)
        assert gate.on_inflight(client_id, pid, count, at_s) is None

    rt.start_boundaries(deliver)
    try:
        for cid, cls, work, pid in (
            ("inf", ClientClass.ONLINE, SimWorkload("resnet50-inference", rps=40.0), 11),
            ("train", ClientClass.OFFLINE, SimWorkload("resnet50-train"), 12),
        ):
            assert rt.add_client(
                cid, cls, work, gpu_uuid=uuid, sm_pct=50, mem_bytes=2 << 30, pid=pid,
                launch_blocking=cls is ClientClass.OFFLINE,
            )  # fmt: skip
            pauser.attach(cid, pid)
        gate.update_clients({"inf": uuid}, {uuid: ["train"]}, clock())
        gate.set_enabled(uuid, True, clock())
        train = rt.node.client("train")
        assert train is not None and train.launch_blocking
        frozen_seen = False
        for _ in range(40):
            clock.t += 0.05
            rt.advance()
            time.sleep(0.005)  # the delivery thread's turn
            gate.poll(clock())
            frozen_seen |= by_gate(gate.arbiter.reasons("train"))
        deadline = time.monotonic() + 5.0
        while gate.view(uuid, clock()).closes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        view = gate.view(uuid, clock())
        assert view.signalled_clients == 1 and view.closes > 0
        assert frozen_seen
        assert 1 in seen and 0 in seen  # starts and ends reached the gate
    finally:
        rt.stop_boundaries()
        gate.close()


def test_a_long_running_node_keeps_only_what_its_windows_read(tmp_path: Path) -> None:
    """Issue 33.5: the daemon's simulated node ran for days growing 0.44 MiB a minute."""
    clock = ManualClock(100.0)
    cfg = Config()
    rt = RealTimeSimNode(1, cfg, runtime_dir=tmp_path, clock=clock)
    reported: list[float] = []
    rt.on_latency = lambda _cid, lat, _at: reported.append(lat)
    (uuid,) = rt.gpu_uuids
    workloads = (("inf", ClientClass.ONLINE, SimWorkload("resnet50-inference", rps=40.0), 11),
                 ("train", ClientClass.OFFLINE, SimWorkload("resnet50-train"), 12))  # fmt: skip
    for cid, cls, workload, pid in workloads:
        assert rt.add_client(cid, cls, workload, gpu_uuid=uuid, sm_pct=50, mem_bytes=2 << 30,
                             pid=pid)  # fmt: skip
    probe = rt.latency_probe()
    span_s = max(cfg.probe.window_s, cfg.probe.baseline_window_s)
    for _ in range(int(3 * span_s / cfg.control.period_s)):
        clock.t += cfg.control.period_s
        reading = probe.reading(uuid)
    (server,) = rt.node.online
    (train,) = rt.node.offline
    # every request was handed to the daemon, and the node kept none of them
    assert len(reported) > 3 * span_s * 20
    assert server.completed == [] and server.served == []
    # the probe keeps one baseline window of samples, the trainer one window of iterations
    # (trimmed once per FORGET_PERIOD_S: at most that much more than the windows)
    kept_s = span_s + FORGET_PERIOD_S
    samples = rt.node.probes[uuid].samples
    assert samples[0][0] >= rt.node.loop.now - kept_s - cfg.control.period_s
    assert len(samples) <= kept_s / rt.node.probes[uuid].period_s + 2
    assert train.iterations[0] >= rt.node.loop.now - kept_s
    # and the readings still work: the window is full and a baseline was learned
    assert reading.samples > 10
