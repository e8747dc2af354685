"""Observation building: attribution, app p99, admissions, per-GPU config, and never raising."""

from __future__ import annotations

import dataclasses

import pytest

from bench.support import fake_nvml
from bench.support.fake_nvml import GIB, uuid_of
from gpushare.config import Config, ControlConfig, GpuOverride, MpsConfig
from gpushare.daemon.observe import (
    NO_APP_LATENCY,
    NO_PROBE,
    build_observation,
)
from gpushare.latency.p99 import LatencyP99
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    GateReading,
    GpuEvent,
    GpuSample,
    Limits,
    MpsEvent,
    MpsEventKind,
    MpsState,
    ProbeReading,
    ProcessMemory,
)
from gpushare.node.nvml import NvmlBackend
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_probe import FakeProbe

U0, U1 = uuid_of(0), uuid_of(1)


def view(cid: str, cls: ClientClass, pid: int | None, **kw: object) -> ClientView:
    return ClientView(
        client_id=cid,
        cls=cls,
        state=kw.pop("state", ClientState.RUNNING),  # type: ignore[arg-type]
        limits=Limits(sm_pct=50.0, pinned_mem_bytes=None, priority=cls.mps_priority),
        uid=1000,
        pid=pid,
        **kw,  # type: ignore[arg-type]
    )


def sample(index: int = 0, **kw: object) -> GpuSample:
    procs = (ProcessMemory(100, 30 << 20), ProcessMemory(201, 2 * GIB), ProcessMemory(202, GIB),
             ProcessMemory(203, None))  # fmt: skip
    return GpuSample(index=index, uuid=uuid_of(index), processes=procs, **kw)  # type: ignore[arg-type]


def test_clients_get_memory_and_p99_and_the_rest_is_passed_through() -> None:
    online = view("web", ClientClass.ONLINE, 201, slo_p99_ms=20.0)
    batch = view("train", ClientClass.OFFLINE, 202)
    quiet = view("quiet", ClientClass.ONLINE, 999)  # no GPU context yet, no latency source
    ev = MpsEvent(MpsEventKind.SERVER_STARTED, U0, 1.0, "Server 77 has started", server_pid=77)
    other_gpu_ev = MpsEvent(MpsEventKind.SERVER_STARTED, U1, 1.0, "x")
    xid = GpuEvent(U0, 13, 2.0, fatal=False)
    reading = ProbeReading(latency_ms=1.0, run_ms=0.5, baseline_ms=0.8, ratio=1.25, samples=99)
    obs = build_observation(
        sample=sample(),
        probe=reading,
        clients=[online, batch, quiet],
        config=Config(),
        app_p99={"web": LatencyP99(12.5, 400)},
        mps_state=MpsState.UP,
        mps_events=[ev, other_gpu_ev],
        gpu_events=[xid, GpuEvent(U1, 79, 2.0, fatal=True)],
    )
    assert obs.gpu_uuid == U0
    assert obs.probe is reading
    web, train, q = obs.clients
    assert (web.mem_used_bytes, web.p99_ms, web.p99_reason, web.slo_p99_ms) == (
        2 * GIB, 12.5, None, 20.0
    )  # fmt: skip
    assert (train.mem_used_bytes, train.p99_ms, train.p99_reason) == (GIB, None, None)
    assert (q.mem_used_bytes, q.p99_ms, q.p99_reason) == (None, None, NO_APP_LATENCY)
    assert obs.mps_events == (ev,)
    assert obs.gpu_events == (xid,)
    assert obs.mem_reserve_bytes == 2 << 30
    assert obs.offline_sm_pct_max == 100.0
    assert obs.admissions_open
    assert obs.online() == (web, q)
    assert obs.offline() == (train,)


def test_memory_sums_every_pid_of_a_client_and_unknown_stays_none() -> None:
    c = view("multi", ClientClass.OFFLINE, 201)
    obs = build_observation(
        sample=sample(), probe=None, clients=[c], config=Config(),
        client_pids={"multi": [201, 202, 203, 4242]},
    )  # fmt: skip
    assert obs.clients[0].mem_used_bytes == 3 * GIB  # 203 is N/A, 4242 vanished
    only_na = build_observation(
        sample=sample(), probe=None, clients=[c], config=Config(), client_pids={"multi": [203]}
    )
    assert only_na.clients[0].mem_used_bytes is None
    assert only_na.probe.reason == NO_PROBE


def test_app_p99_without_enough_samples_keeps_its_reason() -> None:
    c = view("web", ClientClass.ONLINE, 201)
    why = "only 3 reports in the last 30s (needs 20)"
    obs = build_observation(
        sample=sample(), probe=None, clients=[c], config=Config(),
        app_p99={"web": LatencyP99(None, 3, why)}, mps_state=MpsState.UP,
    )  # fmt: skip
    assert obs.clients[0].p99_ms is None
    assert obs.clients[0].p99_reason == why


@pytest.mark.parametrize(
    ("why", "kwargs"),
    [
        ("gpu lost", {"sample": dataclasses.replace(sample(), lost=True, error="gpu lost")}),
        ("mps down", {"mps_state": MpsState.FAULT}),
        ("mps unknown", {"mps_state": MpsState.UNKNOWN}),
        ("fatal xid", {"gpu_events": [GpuEvent(U0, 79, 1.0, fatal=True)]}),
        ("not shared", {"config": Config(gpus={"0": GpuOverride(shared=False)})}),
        ("client slots full", {"config": Config(mps=MpsConfig(max_clients=3))}),
    ],
)
def test_admissions_close(why: str, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {
        "sample": sample(),
        "probe": None,
        "clients": [view("a", ClientClass.ONLINE, 201), view("b", ClientClass.OFFLINE, 202)],
        "config": Config(),
        "mps_state": MpsState.UP,
        "probe_mps_slots": 1,  # 2 clients + the probe = 3 slots
    }
    assert build_observation(**args).admissions_open  # type: ignore[arg-type]
    args.update(kwargs)
    assert not build_observation(**args).admissions_open, why  # type: ignore[arg-type]


def test_per_gpu_overrides_by_uuid_win_over_index() -> None:
    cfg = Config(
        control=ControlConfig(online_memory_reserve_bytes=GIB),
        gpus={
            "1": GpuOverride(online_memory_reserve_bytes=4 * GIB),
            U1: GpuOverride(offline_sm_pct_max=40.0),
        },
    )
    o0, o1 = (
        build_observation(sample=s, probe=None, clients=(), config=cfg)
        for s in (sample(0), sample(1))
    )
    assert (o0.mem_reserve_bytes, o0.offline_sm_pct_max) == (GIB, 100.0)
    # The UUID entry wins entirely (Config.for_gpu): its reserve is unset -> the default.
    assert (o1.mem_reserve_bytes, o1.offline_sm_pct_max) == (GIB, 40.0)


def test_build_observation_with_the_real_adapter_and_a_scripted_probe() -> None:
    lib = fake_nvml.gpu_lost(n=2, lost=1)
    backend = NvmlBackend(nvml=lib, events=False)
    try:
        samples = backend.sample()
    finally:
        backend.close()
    probe = FakeProbe([(0.0, 0.05), (10.0, 0.2)], baseline_ms=0.05)
    probe.now = 12.0
    clients = {
        U0: [view("web", ClientClass.ONLINE, 201)],
        U1: [view("t", ClientClass.OFFLINE, 202)],
    }
    o0, o1 = (
        build_observation(
            sample=s,
            probe=probe.reading(s.uuid),
            clients=clients[s.uuid],
            config=Config(),
            mps_state=MpsState.UP,
        )
        for s in samples
    )
    assert o0.probe.ratio == pytest.approx(4.0)
    assert o0.clients[0].mem_used_bytes == 2 * GIB
    assert o0.admissions_open
    assert o1.sample.lost
    assert not o1.admissions_open
    assert o1.clients[0].mem_used_bytes is None  # a lost GPU lists no processes


def test_building_never_raises() -> None:
    # Garbage from a caller (a client view that is not one) still yields a closed observation.
    bad = build_observation(
        sample=sample(), probe=None, clients=[object()], config=Config(),  # type: ignore[list-item]
        mps_state=MpsState.UP,
    )  # fmt: skip
    assert not bad.admissions_open
    assert (bad.sample.error or "").startswith("observation failed: ")


def test_the_gate_and_the_compute_mode_go_into_the_observation_also_a_failed_one() -> None:
    gate = GateReading(
        enabled=True, closed=False, inflight=1, signalled_clients=1, busy_fraction=0.2
    )
    obs = build_observation(
        sample=sample(), probe=None, clients=[view("web", ClientClass.ONLINE, 201)],
        config=Config(), mps_state=MpsState.UP, gate=gate, time_sliced=True,
    )  # fmt: skip
    assert obs.gate is gate and obs.time_sliced
    assert obs.admissions_open and obs.clients[0].mem_used_bytes == 2 * GIB
    plain = build_observation(sample=sample(), probe=None, clients=[], config=Config())
    assert plain.gate is None and not plain.time_sliced
    bad = build_observation(
        sample=sample(), probe=None, clients=[object()], config=Config(),  # type: ignore[list-item]
        gate=gate, time_sliced=True,
    )  # fmt: skip
    assert not bad.admissions_open and bad.gate is gate and bad.time_sliced


def test_fake_backend_feeds_observations() -> None:
    backend = FakeGpuBackend.uniform(2, 3)
    backend.set(1, lost=True, error="gpu lost")
    readings = {U0: ProbeReading(latency_ms=1.0)}
    obs = [
        build_observation(sample=s, probe=readings.get(s.uuid), clients=(), config=Config(),
                          mps_state=MpsState.UP)
        for s in backend.sample()
    ]  # fmt: skip
    assert [o.admissions_open for o in obs] == [True, False]
    assert obs[0].probe.latency_ms == 1.0
    assert obs[1].probe.reason == NO_PROBE


def test_online_and_offline_are_made_once_and_stay_out_of_equality_and_repr() -> None:
    # The controller asks for them about ten times per GPU per tick: one pass over the clients.
    clients = (
        view("web", ClientClass.ONLINE, 201),
        view("train", ClientClass.OFFLINE, 202),
        view("gone", ClientClass.OFFLINE, None, state=ClientState.EXITED),
        view("queued", ClientClass.OFFLINE, None, state=ClientState.QUEUED),
    )
    obs = build_observation(sample=sample(), probe=None, clients=clients, config=Config())
    fresh = build_observation(sample=sample(), probe=None, clients=clients, config=Config())
    assert [c.client_id for c in obs.online()] == ["web"]
    assert [c.client_id for c in obs.offline()] == ["train"]
    assert obs.offline() is obs.offline() and obs.online() is obs.online()
    # Asked or not, the same observation: equal, same hash, same repr; a copy asks anew.
    assert obs == fresh and hash(obs) == hash(fresh) and repr(obs) == repr(fresh)
    moved = dataclasses.replace(obs, clients=clients[1:])
    assert moved.online() == () and [c.client_id for c in moved.offline()] == ["train"]


def test_the_probes_mps_slots_count_against_the_client_limit() -> None:
    cfg = Config(mps=MpsConfig(max_clients=2))
    clients = (view("web", ClientClass.ONLINE, 201),)

    def admissions(slots: int) -> bool:
        obs = build_observation(
            sample=sample(),
            probe=None,
            clients=clients,
            config=cfg,
            mps_state=MpsState.UP,
            probe_mps_slots=slots,
        )
        return obs.admissions_open

    assert admissions(0)  # 1 client of 2
    assert not admissions(1)  # 1 client and the probe's context: full
