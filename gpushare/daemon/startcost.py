"""A restart's cost measured: from a relaunch to the first GPU work the daemon sees (issue 32).

A share restart costs the job its start-up (imports, data loaders, checkpoint load, warm-up) and
the controller weighs that cost (:mod:`gpushare.control.restart_cost`). A job may declare it
(``submit --restart-cost``); otherwise the daemon measures it here: when it relaunches a
restartable offline client (:meth:`StartTimes.spawned`, from the lifecycle), it notes the time,
and at the first tick on which NVML shows one of the client's processes (its cgroup's, so a
descendant counts) doing GPU work, the difference is the start-up. "GPU work" is a pid in the
driver's per-process SM periods where the driver gives them (the simulator does too: its job's
first kernel, after its start-up), else a pid in the GPU's process lists (a CUDA context), the
only sign a driver without per-process utilisation gives. A first launch is not measured: it loads
no checkpoint, so it says less about what a restart costs.

Each measurement is capped at ``[control] restart_cost_measured_max`` (a client decides when it
first touches the GPU, so it could otherwise make itself as dear to restart as it likes) and
smoothed with the stored value (:func:`smoothed`, an exponential average: one slow start-up
moves it half way), then kept in the registry (``startup_s``), so a daemon restart keeps it.
:func:`fed_cost` is the one rule for what reaches the controller: a declared cost wins, then the
measured one (capped again, at the cap in force now), else the config's ``restart_cost``.

The time counts from the spawn to the tick that sees the work: freezes during the start-up
count (the job lost that time too), and the tick period (100 ms) is the resolution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from gpushare.config import ControlConfig
from gpushare.daemon.registry import ClientRecord, RegistryError
from gpushare.daemon.state import PAUSE_ERRORS, NodeState
from gpushare.model import GpuSample

log = structlog.get_logger(__name__)

#: The weight of a new measurement against the stored value: the newest half, the rest half.
SMOOTHING = 0.5

DECLARED, MEASURED, DEFAULT = "declared", "measured", "default"


@dataclass(frozen=True, slots=True)
class _Spawn:
    gpu_uuid: str
    at_mono_s: float


class StartTimes:
    """Relaunched clients not yet seen doing GPU work, and when each was spawned."""

    def __init__(self) -> None:
        self._pending: dict[str, _Spawn] = {}

    @property
    def waiting(self) -> bool:
        """Whether any relaunch waits for its first GPU work (the tick's hook costs nothing else)."""
        return bool(self._pending)

    def spawned(self, client_id: str, gpu_uuid: str, now_mono_s: float) -> None:
        """``client_id`` was relaunched on ``gpu_uuid`` at ``now_mono_s``."""
        self._pending[client_id] = _Spawn(gpu_uuid, now_mono_s)

    def forget(self, client_id: str) -> None:
        """The client's process ended: a start-up it never finished is not measured."""
        self._pending.pop(client_id, None)

    def seen(
        self, sample: GpuSample, pids_of: Callable[[str], Sequence[int]], now_mono_s: float
    ) -> list[tuple[str, float]]:
        """The clients of this GPU seen doing GPU work now, with their start-up (seconds)."""
        mine = [(cid, sp) for cid, sp in self._pending.items() if sp.gpu_uuid == sample.uuid]
        if not mine:
            return []
        if sample.sm_periods is not None:
            working = {pid for period in sample.sm_periods for pid in period.pids}
        else:
            working = {p.pid for p in sample.processes}
        if not working:
            return []
        out = []
        for cid, sp in mine:
            if any(pid in working for pid in pids_of(cid)):
                del self._pending[cid]
                out.append((cid, max(0.0, now_mono_s - sp.at_mono_s)))
        return out


def smoothed(stored_s: float | None, measured_s: float, cap_s: float) -> float:
    """The start-up to keep: ``measured_s`` capped, averaged with the stored value."""
    sample = min(max(0.0, measured_s), cap_s)
    if stored_s is None:
        return sample
    return min(cap_s, SMOOTHING * sample + (1.0 - SMOOTHING) * max(0.0, stored_s))


def fed_cost(
    declared_s: float | None, measured_s: float | None, control: ControlConfig
) -> tuple[float | None, str]:
    """The restart cost the controller gets and where it comes from (``None``: its default)."""
    if declared_s is not None:
        return declared_s, DECLARED
    if measured_s is not None:
        return min(max(0.0, measured_s), control.restart_cost_measured_max_s), MEASURED
    return None, DEFAULT


def restart_cost_status(rec: ClientRecord, control: ControlConfig) -> dict[str, Any]:
    """``status``'s ``offline.restart_cost`` (docs/status-schema.md): the cost used, and whence."""
    cost, source = fed_cost(rec.restart_cost_s, rec.startup_s, control)
    return {
        "s": control.restart_cost_s if cost is None else cost,
        "source": source,
        "declared_s": rec.restart_cost_s,
        "measured_s": rec.startup_s,
    }


def measure(s: NodeState, times: StartTimes, sample: GpuSample, now_mono_s: float) -> None:
    """The tick's hook for one GPU: record the start-ups that ended since the last tick."""

    def pids_of(client_id: str) -> Sequence[int]:
        try:
            return s.pauser.pids(client_id)
        except PAUSE_ERRORS:
            return ()

    for client_id, startup_s in times.seen(sample, pids_of, now_mono_s):
        record(s, client_id, startup_s)


def record(s: NodeState, client_id: str, startup_s: float) -> None:
    """Keep one measured start-up in the registry, and say so in the log and the event log."""
    cap = s.config.control.restart_cost_measured_max_s
    rec = s.registry.find(client_id)
    if rec is None:
        return
    kept = smoothed(rec.startup_s, startup_s, cap)
    try:
        s.registry.update(client_id, startup_s=kept)
    except RegistryError as exc:
        log.warning("startup_not_recorded", client_id=client_id, error=str(exc))
        return
    capped = " (capped: [control] restart_cost_measured_max)" if startup_s > cap else ""
    log.info(
        "client_startup_measured", client_id=client_id, startup_s=round(startup_s, 3),
        kept_s=round(kept, 3), cap_s=cap, used=rec.restart_cost_s is None,
    )  # fmt: skip
    s.registry.add_event(
        "client_startup_measured",
        f"relaunched to first GPU work in {startup_s:.1f}s{capped}; restart cost "
        + (f"{kept:.1f}s (measured)" if rec.restart_cost_s is None
           else f"{rec.restart_cost_s:g}s (declared; the measurement is kept)"),
        client_id=client_id, gpu_uuid=rec.gpu_uuid,
        data={"startup_s": round(startup_s, 3), "kept_s": round(kept, 3)},
    )  # fmt: skip
