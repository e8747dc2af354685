"""Building the controller's input: one frozen :class:`~gpushare.model.Observation` per GPU per tick.

Everything arrives as data (the NVML samples, the probe readings, the registry's client views,
the app-latency p99s, the MPS state and events, the GPU events, the config), so this module does no
I/O and reads no clock. It fills in what the registry cannot know: each client's GPU memory from
NVML's per-process list and each online client's app-reported p99, and decides whether the GPU is
open for admissions. Building never raises: a reading that is missing is ``None`` with a reason,
and a GPU whose observation cannot be built at all gets a closed, explained one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import structlog

from gpushare.config import Config
from gpushare.control.fit import slot_free
from gpushare.latency.p99 import LatencyP99
from gpushare.model import (
    ClientClass,
    ClientView,
    GateReading,
    GpuEvent,
    GpuSample,
    MpsEvent,
    MpsState,
    Observation,
    ProbeReading,
)

log = structlog.get_logger(__name__)

NO_APP_LATENCY = "no app latency source (report_latency or --latency-from)"
NO_PROBE = "unavailable: no probe on this GPU"


def build_observation(
    *,
    sample: GpuSample,
    probe: ProbeReading | None,
    clients: Sequence[ClientView],
    config: Config,
    app_p99: Mapping[str, LatencyP99] | None = None,
    mps_state: MpsState = MpsState.UNKNOWN,
    mps_events: Sequence[MpsEvent] = (),
    gpu_events: Sequence[GpuEvent] = (),
    client_pids: Mapping[str, Sequence[int]] | None = None,
    probe_mps_slots: int = 0,
    gate: GateReading | None = None,
    time_sliced: bool = False,
) -> Observation:
    """One GPU's observation for one tick; never raises.

    Args:
        sample: the GPU's NVML sample this tick.
        probe: the probe's reading (``None``: no probe on this GPU).
        clients: the registry's views of the clients placed on this GPU.
        config: the daemon config (per-GPU reserve, offline SM cap, shared flag, client limit).
        app_p99: app-reported p99 per client id (:class:`gpushare.latency.app.AppLatency`).
        mps_state: health of the GPU's MPS control daemon and server.
        mps_events: MPS events of this GPU since the last tick.
        gpu_events: GPU (XID) events since the last tick; other GPUs' events are ignored.
        client_pids: every pid of each client (its cgroup); default: the view's ``pid``.
        probe_mps_slots: MPS client slots the probe holds here (counted against the limit).
        gate: the GPU's request gate (``None``: the runner does no gating).
        time_sliced: the GPU time-slices its contexts (NVML's default compute mode).
    """
    try:
        return _build(
            sample,
            probe,
            clients,
            config,
            app_p99 or {},
            mps_state,
            mps_events,
            gpu_events,
            client_pids or {},
            probe_mps_slots,
            gate,
            time_sliced,
        )
    except Exception as exc:
        log.exception("observation_failed", gpu=sample.uuid)
        return Observation(
            gpu_uuid=sample.uuid,
            gpu_index=sample.index,
            sample=dataclasses.replace(
                sample, error=f"observation failed: {type(exc).__name__}: {exc}"
            ),
            probe=ProbeReading(reason=f"observation failed: {exc}"),
            clients=tuple(clients),
            mps_state=mps_state,
            admissions_open=False,
            gate=gate,
            time_sliced=time_sliced,
        )


def _build(
    sample: GpuSample,
    probe: ProbeReading | None,
    clients: Sequence[ClientView],
    config: Config,
    app_p99: Mapping[str, LatencyP99],
    mps_state: MpsState,
    mps_events: Sequence[MpsEvent],
    gpu_events: Sequence[GpuEvent],
    client_pids: Mapping[str, Sequence[int]],
    probe_mps_slots: int,
    gate: GateReading | None,
    time_sliced: bool,
) -> Observation:
    gpu = config.for_gpu(sample.index, sample.uuid)

    memory: dict[int, int | None] = {p.pid: p.used_bytes for p in sample.processes}
    views = tuple(
        # An offline client on a GPU whose processes NVML lists none of keeps its view as it
        # is (_client_view would give it back unchanged): idle clients cost no look-up each.
        c
        if not memory and c.cls is not ClientClass.ONLINE and c.mem_used_bytes is None
        else _client_view(c, memory, client_pids.get(c.client_id), app_p99.get(c.client_id))
        for c in clients
    )
    events = tuple(e for e in gpu_events if e.gpu_uuid == sample.uuid)
    live = sum(1 for c in views if c.state.is_live)
    admissions_open = (
        gpu.shared
        and not sample.lost
        and mps_state is MpsState.UP
        and not any(e.fatal for e in events)
        and slot_free(gpu.max_clients, probe_mps_slots, live)
    )
    return Observation(
        gpu_uuid=sample.uuid,
        gpu_index=sample.index,
        sample=sample,
        probe=probe if probe is not None else ProbeReading(reason=NO_PROBE),
        clients=views,
        mps_state=mps_state,
        mps_events=tuple(e for e in mps_events if e.gpu_uuid == sample.uuid),
        gpu_events=events,
        mem_reserve_bytes=gpu.online_memory_reserve_bytes,
        offline_sm_pct_max=gpu.offline_sm_pct_max,
        admissions_open=admissions_open,
        gate=gate,
        time_sliced=time_sliced,
    )


def _client_view(
    view: ClientView,
    memory: Mapping[int, int | None],
    pids: Sequence[int] | None,
    p99: LatencyP99 | None,
) -> ClientView:
    own = pids if pids is not None else ((view.pid,) if view.pid is not None else ())
    known = [used for pid in own if (used := memory.get(pid)) is not None]
    # None, not 0, when NVML lists none of the client's pids: "no context yet" and "cannot see"
    # are not "uses nothing".
    mem = sum(known) if known else None
    if view.cls is not ClientClass.ONLINE:
        return _with(view, mem_used_bytes=mem)
    if p99 is None:
        return _with(view, mem_used_bytes=mem, p99_ms=None, p99_reason=NO_APP_LATENCY)
    if p99.ttft is not None or p99.tpot is not None:
        return _with(
            view, mem_used_bytes=mem, p99_ms=p99.p99_ms, p99_reason=p99.reason,
            ttft_p99_ms=p99.ttft.p99_ms if p99.ttft is not None else None,
            tpot_p99_ms=p99.tpot.p99_ms if p99.tpot is not None else None,
        )  # fmt: skip
    return _with(view, mem_used_bytes=mem, p99_ms=p99.p99_ms, p99_reason=p99.reason)


_VIEW_FIELDS = tuple(f.name for f in dataclasses.fields(ClientView) if f.init)


def _with(view: ClientView, **changes: object) -> ClientView:
    """``dataclasses.replace`` without its per-call introspection, and no copy when unchanged.

    ``replace`` dominated the cost of a tick with hundreds of clients (bench/observe.py).
    """
    if all(getattr(view, k) == v for k, v in changes.items()):
        return view
    values = {name: getattr(view, name) for name in _VIEW_FIELDS}
    values.update(changes)
    return ClientView(**values)
