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
from gpushare.daemon.state import NodeState
from gpushare.model import ClientClass


@dataclass(frozen=True, slots=True)
class QueueChoice:
    """An offline client's queue: the mode, why, how it is set up, and how it is shallow if so."""

    mode: str
    why: str
    how: str
    shallow_how: str | None


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
    gang: Sequence[str] = (),
) -> tuple[dict[str, str], QueueChoice | None]:
    """The client's environment, and its queue choice (``None`` for an online client).

    A gang of several GPUs (``gang``, rank order; ``gpu_uuid`` is rank 0's) also carries every
    rank's GPU variables, for ``gpushare rank-exec`` (:func:`gpushare.mpsenv.rank_env`).
    """

    def one(uuid: str) -> dict[str, str]:
        return mpsenv.mps_env(
            client_id=client_id,
            limits=mpsenv.MpsLimits(
                gpu_uuid=uuid, sm_pct=sm, mem_bytes=mem, priority=s.priority(cls)
            ),
            pipe_dir=s.mps.pipe_dir(uuid),
            latency_socket=s.config.paths.resolved("latency_socket"),
        )

    env = one(gpu_uuid)
    if len(gang) > 1:
        env.update(mpsenv.gang_env([one(uuid) for uuid in gang]))
    slo = slo_p99_ms / 1000 if slo_p99_ms is not None and cls is ClientClass.ONLINE else None
    choice = None
    if cls is ClientClass.OFFLINE:
        gating = s.gate.view(gpu_uuid, s.clock.monotonic()).enabled
        mode, why = launcher.choose_queue(queue, gating_on=gating)
        queue_vars, how = launcher.queue_env(
            mode, s.config.gate, s.shallow_library, vet=s.library_vet
        )
        env.update(queue_vars)
        choice = QueueChoice(mode, why, how, launcher.shallow_how(queue_vars))
    return {**mpsenv.marker_env(cls, slo), **env}, choice
