"""The environment a client of a GPU starts with, and the queue mode an offline client gets.

What ``gpushare env`` prints for the same class and limits (:mod:`gpushare.mpsenv`), plus the
client's id, and for an offline client its queue mode (:func:`gpushare.daemon.launcher.choose_queue`,
by whether the GPU's request gate is on now) with the variables that set it up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpushare import mpsenv
from gpushare.daemon import launcher
from gpushare.daemon.inflight_control import LiveQueues
from gpushare.daemon.state import NodeState
from gpushare.model import ClientClass


@dataclass(frozen=True, slots=True)
class QueueChoice:
    """An offline client's queue: the mode, why, how it is set up, and how it is shallow if so."""

    mode: str
    why: str
    how: str
    shallow_how: str | None
    #: Its bound follows request gating through the GPU's control file, without a restart
    #: (issue 32): :class:`~gpushare.daemon.inflight_control.LiveQueues` keeps its shallow mark.
    live: bool = False


def client_env(
    s: NodeState,
    client_id: str,
    gpu_uuid: str,
    sm: float,
    mem: int | None,
    cls: ClientClass,
    slo_p99_ms: float | None = None,
    *,
    queue: str | None = None,
    live: LiveQueues | None = None,
    gang: Sequence[str] = (),
) -> tuple[dict[str, str], QueueChoice | None]:
    """The client's environment, and its queue choice (``None`` for an online client).

    ``live``: the daemon's live ``--queue auto`` clients; an ``auto`` client that may preload the
    in-flight library is launched with its GPU's control file instead of a fixed queue (issue 32).
    A gang of several GPUs (``gang``, rank order; ``gpu_uuid`` is rank 0's) also carries every
    rank's GPU variables, for ``gpushare rank-exec`` (:func:`gpushare.mpsenv.rank_env`).
    """
    # One priority for every rank: the one its record keeps (lifecycle.prepare_launch).
    prio = s.priority(cls, gang or (gpu_uuid,))

    def one(uuid: str) -> dict[str, str]:
        return mpsenv.mps_env(
            client_id=client_id,
            limits=mpsenv.MpsLimits(gpu_uuid=uuid, sm_pct=sm, mem_bytes=mem, priority=prio),
            pipe_dir=s.mps.pipe_dir(uuid),
            latency_socket=s.config.paths.resolved("latency_socket"),
        )

    env = one(gpu_uuid)
    if len(gang) > 1:
        env.update(mpsenv.gang_env([one(uuid) for uuid in gang]))
    slo = slo_p99_ms / 1000 if slo_p99_ms is not None and cls is ClientClass.ONLINE else None
    choice = None
    if cls is ClientClass.OFFLINE:
        now = s.clock.monotonic()
        gating = s.gate.view(gpu_uuid, now).enabled
        mode, why = launcher.choose_queue(queue, gating_on=gating)
        lib, vet = s.shallow_library, s.library_vet
        if queue == "auto":  # vetted once, here: the live switch and the fallback alike
            lib, vet = launcher.vetted_library(lib, vet), None
        switched = None
        if live is not None:
            switched = live.launch_env(client_id, gpu_uuid, queue, gating, s.config.gate, lib, now)
            if switched is None:
                live.forget(client_id)
        if switched is not None:
            queue_vars, how = switched
            env.update(queue_vars)
            choice = QueueChoice(mode, why, how, None, live=True)
        else:
            queue_vars, how = launcher.queue_env(mode, s.config.gate, lib, vet=vet)
            env.update(queue_vars)
            choice = QueueChoice(mode, why, how, launcher.shallow_how(queue_vars))
    return {**mpsenv.marker_env(cls, slo), **env}, choice
