"""The queue for offline submits: what waits when no GPU can hold a job now, and in what order.

An ``--offline`` submit that no GPU can hold now (memory, an MPS client slot, another user's MPS
server) is recorded ``queued`` instead of refused, unless it asked ``--no-queue`` or could never
fit (more memory than any GPU has beside its online reserve): sbatch users expect a job to wait.
The control loop's admission round (:func:`gpushare.control.admission.plan`) starts queued jobs
in :func:`~gpushare.control.admission.queue_order` (shortest declared ``--time`` first, then by
submission) where they fit; the records are in the registry, so the queue survives a restart.

A detached job is spawned by the loop when admitted. A foreground one cannot be: its submitter
execs the workload itself. Its record waits ``queued`` while the submitter asks again
(``wait_for``) every second or so; when admission picks it, the loop moves it to ``starting`` on
its GPU (:meth:`ForegroundWaiters.admit`), and the submitter's next ask adopts it and gets its
environment. A waiter that stops asking (its process gone) is ended, so that it holds no place.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpushare.control import pods
from gpushare.control.admission import positions
from gpushare.daemon import gangplace
from gpushare.daemon.registry import ClientRecord
from gpushare.model import ClientClass, ClientState, QueuedJob

S = ClientState

WAITER_GRACE_S = 30.0
"""How long a foreground queued job keeps its place without its submitter asking about it."""


_SLURM_JOB = re.compile(r"/slurm[^/]*(/.*)?/job_\d+(/|$)")


def managed_cgroup(path: str | None) -> str | None:
    """Whether a caller's cgroup belongs to something else that accounts for it, and what.

    A Slurm job's step (slurmstepd puts tasks under ``.../slurmstepd.scope/job_<id>/...``) or a
    container (docker, containerd, cri-o, podman; a Kubernetes pod): a foreground submit from
    there is adopted where it is, as the adopter does, so that the job's limits and accounting
    keep it. ``None`` for any other cgroup (a login shell's): gpushare gives it one of its own.
    """
    if not path or path == "/":
        return None
    if _SLURM_JOB.search(path):
        return f"the Slurm job's cgroup {path}"
    if pods.container_of_cgroup(path) is not None:
        return f"its container's cgroup {path}"
    return None


def queued_jobs(
    records: Iterable[ClientRecord],
    now_mono_s: float,
    now_wall_s: float,
    not_before: dict[str, float],
) -> list[QueuedJob]:
    """The queued offline jobs as admission sees them (monotonic submission times).

    A gang (its ``gpu_request`` is :func:`gangplace.request_text`'s) waits for all its GPUs.
    """
    jobs = []
    for r in records:
        if r.state is not S.QUEUED:
            continue
        gang = gangplace.parse_request(r.gpu_request)
        ranks, named = gang if gang is not None else (1, ())
        gpu = None if gang is not None or r.gpu_request in (None, "any") else r.gpu_request
        jobs.append(
            QueuedJob(
                client_id=r.id,
                uid=r.uid,
                mem_bytes=r.mem_bytes,
                sm_pct=r.sm_ceiling,
                gpu=gpu,
                submitted_at_s=now_mono_s - max(0.0, now_wall_s - r.submitted_at),
                expected_duration_s=r.expected_s,
                restartable=r.restartable,
                not_before_s=not_before.get(r.id, 0.0),
                ranks=ranks,
                gang_gpus=named,
            )
        )
    return jobs


def queue_positions(
    records: Iterable[ClientRecord], now_mono_s: float, now_wall_s: float
) -> dict[str, int]:
    """Each queued job's place in the queue (1: tried first), by client id."""
    return positions(queued_jobs(records, now_mono_s, now_wall_s, {}))


def waiting_ahead(records: Sequence[ClientRecord]) -> bool:
    """Whether offline jobs already wait: a new one then joins the queue rather than jump it."""
    return any(r.state is S.QUEUED and r.cls is ClientClass.OFFLINE for r in records)


@dataclass(frozen=True, slots=True)
class Waiter:
    """The process of a foreground submit waiting in the queue, and when it last asked."""

    pid: int
    asked_mono_s: float


class ForegroundWaiters:
    """The submitters of queued foreground jobs (in memory: after a restart they ask again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, Waiter] = {}
        self._first_seen: dict[str, float] = {}

    def asked(self, client_id: str, pid: int, now_mono_s: float) -> None:
        """The submitter of ``client_id`` asked (submitted, or asked again)."""
        with self._lock:
            self._waiters[client_id] = Waiter(pid, now_mono_s)

    def forget(self, client_id: str) -> None:
        """The job started or ended."""
        with self._lock:
            self._waiters.pop(client_id, None)
            self._first_seen.pop(client_id, None)

    def gone(self, records: Iterable[ClientRecord], now_mono_s: float) -> list[str]:
        """Foreground jobs (queued, or admitted and not yet taken) whose submitter stopped asking.

        A job the daemon has no waiter for (it restarted since) gets :data:`WAITER_GRACE_S` from
        the first time it is seen here.
        """
        out = []
        with self._lock:
            for r in records:
                if r.detach or r.pid is not None or r.state not in (S.QUEUED, S.STARTING):
                    continue
                w = self._waiters.get(r.id)
                since = w.asked_mono_s if w else self._first_seen.setdefault(r.id, now_mono_s)
                if now_mono_s - since > WAITER_GRACE_S:
                    out.append(r.id)
        return out

    def pid(self, client_id: str) -> int | None:
        """The waiting submitter's pid."""
        with self._lock:
            w = self._waiters.get(client_id)
            return w.pid if w else None
