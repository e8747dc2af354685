"""Sensing one GPU for a tick: read the node, then build the observation with the pure builder.

:func:`observe_gpu` does the reads of one GPU (its MPS state and events, the probe, each client's
processes, the request gate) and records what an operator should see of them (MPS events in the
event log), then hands everything as data to :func:`gpushare.daemon.observe.build_observation`, the one
builder of observations, which does no I/O and reads no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.daemon.observe import build_observation
from gpushare.daemon.reporter import Reporter
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import ClientView, GpuEvent, GpuSample, MpsEventKind, MpsState, Observation

_QUIET_MPS_EVENTS = frozenset({MpsEventKind.COMMAND, MpsEventKind.RAW})


def observe_gpu(
    s: NodeState,
    sample: GpuSample,
    views: tuple[ClientView, ...],
    gpu_events: Sequence[GpuEvent],
    tick: Tick,
    reporter: Reporter,
) -> Observation:
    """One shared GPU's observation for this tick (its MPS state is kept in ``s.mps_states``)."""
    uuid = sample.uuid
    mps_state = s.mps.state(uuid)
    s.mps_states[uuid] = mps_state
    mps_events = tuple(s.mps.drain_events(uuid))
    for ev in mps_events:
        if ev.kind is MpsEventKind.DAEMON_RESTARTED:
            reporter.mps_restarted(uuid)
        if ev.kind not in _QUIET_MPS_EVENTS:
            severity = "error" if ev.kind is MpsEventKind.FATAL_EXCEPTION else "info"
            s.registry.add_event(f"mps_{ev.kind.value}", ev.text, severity=severity, gpu_uuid=uuid)
    probe = s.probe.reading(uuid) if s.probe is not None else None
    return build_observation(
        sample=sample,
        probe=probe,
        clients=views,
        config=s.config,
        app_p99=s.p99,
        mps_state=mps_state,
        mps_events=mps_events,
        gpu_events=gpu_events,
        # The pids only attribute the GPU memory of the processes NVML lists: none listed,
        # nothing to attribute, and no pauser look-up per client.
        client_pids=(
            {v.client_id: s.pauser.pids(v.client_id) for v in views if v.pid}
            if sample.processes
            else {}
        ),
        probe_mps_slots=1 if s.probe is not None and s.config.probe.enabled else 0,
        # Built in, not a replace() of the observation afterwards: every GPU, every tick.
        gate=s.gate.view(uuid, tick.monotonic_s),
        time_sliced=time_sliced(s, sample),
    )


def time_sliced(s: NodeState, sample: GpuSample) -> bool:
    """Whether the driver time-slices the GPU's clients instead of MPS sharing it.

    In the default compute mode every process may open a context of its own, which the driver
    time-slices; the MPS supervisor puts a GPU it serves in exclusive-process mode (``[mps]
    compute_mode``), so "default" there means MPS does not hold the GPU. With ``compute_mode =
    "leave"`` the mode says nothing about MPS: time-sliced only while MPS is not up.
    """
    if sample.compute_mode != "default":
        return False
    if s.config.mps.compute_mode == "exclusive_process":
        return True
    return s.mps_states.get(sample.uuid) is not MpsState.UP


def record_gpu_event(s: NodeState, event: GpuEvent) -> None:
    """An XID event in the event log."""
    s.registry.add_event(
        "gpu_xid",
        f"XID {event.xid} on {event.gpu_uuid}" + (" (fatal)" if event.fatal else ""),
        severity="error" if event.fatal else "warning",
        gpu_uuid=event.gpu_uuid,
        data={"xid": event.xid},
    )
