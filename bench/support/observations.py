"""Builders of Observation values for the controller, admission and baseline tests."""

from __future__ import annotations

from dataclasses import replace

from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    GpuEvent,
    GpuSample,
    Limits,
    MpsState,
    Observation,
    ProbeReading,
    QueuedJob,
)

GIB = 1 << 30
GPU = "GPU-00000000-0000-0000-0000-000000000000"


def gpu_uuid(index: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{index:012d}"


def online(
    client_id: str = "on1",
    *,
    slo_ms: float | None = 40.0,
    p99_ms: float | None = 20.0,
    mem: int | None = 4 * GIB,
    uid: int = 1000,
    state: ClientState = ClientState.RUNNING,
    sm_pct: float = 100.0,
) -> ClientView:
    return ClientView(
        client_id=client_id,
        cls=ClientClass.ONLINE,
        state=state,
        limits=Limits(sm_pct=sm_pct, pinned_mem_bytes=None, priority=0),
        uid=uid,
        pid=100,
        mem_used_bytes=mem,
        slo_p99_ms=slo_ms,
        p99_ms=p99_ms,
    )


def offline(
    client_id: str = "off1",
    *,
    sm_pct: float = 50.0,
    mem: int | None = 8 * GIB,
    restartable: bool = False,
    uid: int = 1000,
    state: ClientState = ClientState.RUNNING,
    failures: int = 0,
    ceiling: float | None = None,
    mem_limit: int | None = None,
    started: float | None = None,
) -> ClientView:
    """An offline client; ``mem`` is what NVML attributes to it, ``mem_limit`` its ``--mem``."""
    return ClientView(
        client_id=client_id,
        cls=ClientClass.OFFLINE,
        state=state,
        limits=Limits(sm_pct=sm_pct, pinned_mem_bytes=mem_limit, priority=1),
        uid=uid,
        pid=200,
        mem_used_bytes=mem,
        restartable=restartable,
        failures=failures,
        ceiling_sm_pct=ceiling,
        started_at_s=started,
    )


def observation(
    clients: tuple[ClientView, ...] = (),
    *,
    gpu: str = GPU,
    index: int = 0,
    probe_ratio: float | None = 1.0,
    mem_total: int | None = 80 * GIB,
    mem_free: int | None = None,
    sm_active: float | None = 30.0,
    gpu_util: float | None = None,
    reserve: int = 2 * GIB,
    mps_state: MpsState = MpsState.UP,
    gpu_events: tuple[GpuEvent, ...] = (),
    lost: bool = False,
    offline_max: float = 100.0,
    admissions_open: bool = True,
) -> Observation:
    """An observation whose free memory defaults to total minus what the clients hold."""
    if mem_free is None and mem_total is not None:
        used = sum(c.mem_used_bytes or 0 for c in clients if c.state.is_live)
        mem_free = max(0, mem_total - used)
    sample = GpuSample(
        index=index,
        uuid=gpu,
        mem_total_bytes=mem_total,
        mem_free_bytes=mem_free,
        mem_used_bytes=None if mem_total is None or mem_free is None else mem_total - mem_free,
        sm_active_pct=sm_active,
        gpu_util_pct=gpu_util,
        lost=lost,
        error="GPU is lost" if lost else None,
    )
    probe = (
        ProbeReading(latency_ms=probe_ratio, baseline_ms=1.0, ratio=probe_ratio, samples=100)
        if probe_ratio is not None
        else ProbeReading(reason="unavailable: test")
    )
    return Observation(
        gpu_uuid=gpu,
        gpu_index=index,
        sample=sample,
        probe=probe,
        clients=clients,
        mps_state=mps_state,
        gpu_events=gpu_events,
        mem_reserve_bytes=reserve,
        offline_sm_pct_max=offline_max,
        admissions_open=admissions_open,
    )


def with_p99(obs: Observation, p99_ms: float) -> Observation:
    """The observation with every online client's p99 replaced."""
    clients = tuple(
        replace(c, p99_ms=p99_ms) if c.cls is ClientClass.ONLINE else c for c in obs.clients
    )
    return replace(obs, clients=clients)


def job(
    client_id: str,
    *,
    mem: int | None = 4 * GIB,
    duration: float | None = 100.0,
    uid: int = 1000,
    gpu: str | None = None,
    submitted: float = 0.0,
    not_before: float = 0.0,
    sm_pct: float | None = None,
    restartable: bool = False,
) -> QueuedJob:
    return QueuedJob(
        client_id=client_id,
        uid=uid,
        mem_bytes=mem,
        sm_pct=sm_pct,
        gpu=gpu,
        submitted_at_s=submitted,
        expected_duration_s=duration,
        restartable=restartable,
        not_before_s=not_before,
    )
