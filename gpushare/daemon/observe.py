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
from gpushare.latency.p99 import LatencyP99
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    GateReading,
    GpuEvent,
    GpuSample,
    MpsEvent,
    MpsState,
    Observation,
    ProbeReading,
)
from gpushare.node.base import SlotHoldingProbe

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
    override = config.gpu_override(sample.index, sample.uuid)
    reserve = override.online_memory_reserve_bytes
    if reserve is None:
        reserve = config.control.online_memory_reserve_bytes
    sm_max = override.offline_sm_pct_max
    if sm_max is None:
        sm_max = config.control.offline_sm_pct_max
    max_clients = override.max_clients or config.mps.max_clients

    memory: dict[int, int | None] = {p.pid: p.used_bytes for p in sample.processes}
    views = tuple(
        _client_view(c, memory, client_pids.get(c.client_id), app_p99.get(c.client_id))
        for c in clients
    )
    events = tuple(e for e in gpu_events if e.gpu_uuid == sample.uuid)
    live = sum(1 for c in views if c.state.is_live)
    admissions_open = (
        override.shared
        and not sample.lost
        and mps_state is MpsState.UP
        and not any(e.fatal for e in events)
        and live + probe_mps_slots < max_clients
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
        mem_reserve_bytes=reserve,
        offline_sm_pct_max=sm_max,
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


def build_observations(
    *,
    samples: Sequence[GpuSample],
    probe: SlotHoldingProbe | Mapping[str, ProbeReading] | None,
    clients_by_gpu: Mapping[str, Sequence[ClientView]],
    config: Config,
    app_p99: Mapping[str, LatencyP99] | None = None,
    mps_states: Mapping[str, MpsState] | None = None,
    mps_events: Mapping[str, Sequence[MpsEvent]] | None = None,
    gpu_events: Sequence[GpuEvent] = (),
    client_pids: Mapping[str, Sequence[int]] | None = None,
) -> tuple[Observation, ...]:
    """One observation per sampled GPU, in sample order; never raises.

    Args:
        samples: this tick's NVML samples (``GpuBackend.sample()``).
        probe: a :class:`~gpushare.node.base.SlotHoldingProbe` (or readings by GPU UUID, or
            ``None``: no slot is then counted).
        clients_by_gpu: the registry's client views by GPU UUID.
        config: the daemon config.
        app_p99: app-reported p99 per client id.
        mps_states: MPS health by GPU UUID (missing: ``UNKNOWN``, which closes admissions).
        mps_events: MPS events since the last tick by GPU UUID.
        gpu_events: GPU events since the last tick (``GpuBackend.drain_events()``).
        client_pids: every pid of each client.
    """
    out = []
    for sample in samples:
        reading = _probe_reading(probe, sample.uuid)
        slots = _probe_slots(probe, sample.uuid)
        out.append(
            build_observation(
                sample=sample,
                probe=reading,
                clients=clients_by_gpu.get(sample.uuid, ()),
                config=config,
                app_p99=app_p99,
                mps_state=(mps_states or {}).get(sample.uuid, MpsState.UNKNOWN),
                mps_events=(mps_events or {}).get(sample.uuid, ()),
                gpu_events=gpu_events,
                client_pids=client_pids,
                probe_mps_slots=slots,
            )
        )
    return tuple(out)


def _probe_reading(
    probe: SlotHoldingProbe | Mapping[str, ProbeReading] | None, uuid: str
) -> ProbeReading | None:
    if probe is None:
        return None
    if isinstance(probe, Mapping):
        return probe.get(uuid)
    try:
        return probe.reading(uuid)
    except Exception as exc:
        log.exception("probe_reading_failed", gpu=uuid)
        return ProbeReading(reason=f"unavailable: probe failed: {exc}")


def _probe_slots(probe: SlotHoldingProbe | Mapping[str, ProbeReading] | None, uuid: str) -> int:
    if probe is None or isinstance(probe, Mapping):
        return 0  # readings alone hold no slot
    try:
        return int(probe.mps_client_slots(uuid))
    except Exception:  # noqa: BLE001 - a slot count is advisory
        return 1


def offline_running(clients: Sequence[ClientView]) -> bool:
    """Whether offline work may be running on a GPU (for ``LatencyProbe.set_offline_running``).

    Frozen or held clients issue no new work; every other live offline client might.
    """
    return any(
        c.cls is ClientClass.OFFLINE
        and c.state.is_live
        and c.state is not ClientState.FROZEN
        and not c.held
        for c in clients
    )
