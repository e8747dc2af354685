"""Node-level admission of queued offline jobs: SJF-BSBF's rule brought to one node.

SJF-BSBF (SJF-BSBF, docs/sources.md; Lai-JX/Scheduler ``cluster/switch.py`` ``share_check``) takes jobs
shortest first and places each where sharing costs least: it predicts each job's slowdown ξ when
co-located, computes ``t_con = ½·etc_a + (1 - 1/(2ξ_a))·êtc_b`` against the sequential
``t_seq = etc_b + ½·etc_a``, shares only when ``t_con < t_seq``, prefers idle GPUs, and requires
``free_mem >= job mem``.

Adaptation to one node (``docs/controller.md`` has the argument):

* **Order**: shortest expected job first (``expected_duration_s``; unknown durations after known
  ones), then submission time. A job that cannot start anywhere is skipped, so no job waits behind
  one that cannot start.
* **Fit**: the job's memory must fit in the GPU's available memory (NVML's free memory minus the
  ``--mem`` promised to its clients that NVML does not show yet, :mod:`gpushare.control.promise`,
  the rule ``submit`` places by: docs/design.md D12) minus the online reserve minus what this
  round already placed there; an MPS client slot must be free (``max_clients`` minus the probe
  minus live clients); MPS must be up, the GPU not lost and open for admissions; and (docs/design.md D11)
  without ``-multiuser-server`` a job is not placed beside a live client of another uid.
* **Benefit**: the running partners' remaining times ``etc_b`` are unknown on a node (clients carry
  no progress), so the pairwise ``t_con < t_seq`` test cannot be evaluated. On one node the
  alternative to sharing is to stay queued, and offline work is best-effort (the duty cycle protects
  online clients), so every fitting GPU is admissible and the GPU with the smallest predicted ``t_con``
  wins; for a job alone on a GPU ``t_con`` is ``ξ·etc_a``, so the choice is the smallest ξ, predicted
  from measured headroom: the job gets its SM cap ``s`` where that many SMs are idle (``100 -`` SM
  activity), and at worst an equal split of its cap with the ``n`` offline clients already there:
  ``ξ = 100 / min(s, max(idle, s/(n+1)))``. Ties go to the GPU with no offline client (SJF-BSBF's
  "idle GPUs always preferred"), then the most memory left, then the lowest index.
* **Reservation** (EASY backfill, docs/design.md D15): skipping a job that cannot start lets a
  stream of one-GPU jobs keep a wide gang waiting forever. The first gang in queue order that has
  waited ``GangReserve.after_s`` reserves the GPUs it would take once their offline jobs end
  (the same D14/D12 choice), and no other queued job is placed on them. Bounded so that a
  reservation cannot be a weapon: only for a gang whose owner has nothing live on the node, one
  reservation at a time, and for at most ``GangReserve.max_hold_s``.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpushare.control.fit import LOST, Room, misfit, mps_closed
from gpushare.control.gang import GpuForGang, gpu_services, place_gang
from gpushare.control.promise import promised_to_views
from gpushare.control.signals import free_memory_bytes
from gpushare.model import Admit, ClientClass, MpsState, Observation, QueuedJob

DEFAULT_MAX_CLIENTS = 48
# The latency probe is an MPS client too and takes one slot per GPU.
DEFAULT_PROBE_SLOTS = 1


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """The outcome of one admission round.

    Attributes:
        admits: jobs to start now, in the order they were chosen.
        waiting: for every queued job not admitted, why it waits (for ``gpushare status``).
        reserved: the GPUs a waiting gang reserved (D15), by UUID, with that gang's id: a new
            offline submit is not placed there either.
    """

    admits: tuple[Admit, ...]
    waiting: Mapping[str, str] = field(default_factory=dict)
    reserved: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GangReserve:
    """When a waiting gang reserves GPUs (docs/design.md D15).

    Attributes:
        after_s: a gang that has waited this long (seconds) reserves the GPUs it would take.
        max_hold_s: the reservation lapses this long (seconds) after it began; the gang then
            waits by the plain rule again, so that one gang cannot hold GPUs idle without bound.
    """

    after_s: float
    max_hold_s: float


@dataclass(slots=True)
class _Gpu:
    obs: Observation
    share_pct: float
    promised_bytes: int
    #: Free memory less the promised and less what this round placed; ``None``: unknown.
    available_bytes: int | None
    max_clients: int
    probe_slots: int
    live: int
    uids: set[int]
    offline_count: int
    idle_pct: float
    multiuser: bool
    closed: str | None


def admit(
    queue: Sequence[QueuedJob],
    observations: Mapping[str, Observation],
    shares: Mapping[str, float],
    now: float,
    *,
    max_clients: int | Mapping[str, int] = DEFAULT_MAX_CLIENTS,
    multiuser: bool | Mapping[str, bool] = False,
    probe_slots: int = DEFAULT_PROBE_SLOTS,
) -> list[Admit]:
    """Choose which queued offline jobs start now, and where.

    Args:
        queue: the node's queued offline jobs, in any order.
        observations: this tick's observation of every shared GPU, by UUID.
        shares: the offline SM share each GPU's policy set (``SetOfflineShare``), by UUID; a GPU
            missing here uses its ``offline_sm_pct_max``.
        now: the current time, for ``not_before_s`` (failure backoff).
        max_clients: MPS client slots per GPU (one number, or per UUID).
        multiuser: whether each GPU's MPS runs ``-multiuser-server`` (docs/design.md D11).
        probe_slots: client slots the latency probe takes on each GPU.

    Returns:
        The :class:`Admit` actions, in the order chosen. :func:`plan` also says why others wait.
    """
    return list(
        plan(
            queue,
            observations,
            shares,
            now,
            max_clients=max_clients,
            multiuser=multiuser,
            probe_slots=probe_slots,
        ).admits
    )


def plan(
    queue: Sequence[QueuedJob],
    observations: Mapping[str, Observation],
    shares: Mapping[str, float],
    now: float,
    *,
    max_clients: int | Mapping[str, int] = DEFAULT_MAX_CLIENTS,
    multiuser: bool | Mapping[str, bool] = False,
    probe_slots: int = DEFAULT_PROBE_SLOTS,
    reserve: GangReserve | None = None,
) -> AdmissionPlan:
    """Like :func:`admit`, with the reason each job not admitted waits.

    ``reserve``: when a waiting gang reserves GPUs (``None``: never, the plain rule).
    """
    gpus = [
        _gpu_view(obs, shares, max_clients, multiuser, probe_slots, now)
        for _, obs in sorted(observations.items(), key=lambda kv: (kv[1].gpu_index, kv[0]))
    ]
    ordered = queue_order(queue)
    admits: list[Admit] = []
    waiting: dict[str, str] = {}
    held = _reservation(ordered, gpus, observations, now, reserve)
    for job in ordered:
        if job.not_before_s > now:
            waiting[job.client_id] = (
                f"backing off after failures: may start in {job.not_before_s - now:.0f}s"
            )
            continue
        # Other jobs are not placed on a waiting gang's reserved GPUs (D15).
        open_gpus = gpus if held is None or held.holder == job.client_id else held.others(gpus)
        if job.ranks > 1:  # a gang: all its GPUs at once, or it waits (docs/design.md §7)
            gang = _admit_gang(job, open_gpus)
            if isinstance(gang, str):
                waiting[job.client_id] = gang if held is None else held.explain(job, gang, now)
            else:
                admits.append(gang)
            continue
        best: tuple[tuple[float, int, int, int], _Gpu, float, float] | None = None
        refusals: list[str] = [] if held is None else held.refusals(job, gpus, now)
        for gpu in open_gpus:
            if job.gpu is not None and job.gpu not in (gpu.obs.gpu_uuid, str(gpu.obs.gpu_index)):
                continue
            why_not = _refusal(job, gpu)
            if why_not is not None:
                refusals.append(f"GPU {gpu.obs.gpu_index}: {why_not}")
                continue
            sm_pct = gpu.share_pct if job.sm_pct is None else min(gpu.share_pct, job.sm_pct)
            slowdown = _slowdown(sm_pct, gpu)
            mem_after = _mem_left(gpu) - (job.mem_bytes or 0)
            rank = (slowdown, gpu.offline_count > 0, -mem_after, gpu.obs.gpu_index)
            if best is None or rank < best[0]:
                best = (rank, gpu, sm_pct, slowdown)
        if best is None:
            if not refusals:
                refusals.append(
                    f"no shared GPU matches --gpu {job.gpu}" if job.gpu else "no shared GPU"
                )
            waiting[job.client_id] = "cannot start: " + "; ".join(refusals)
            continue
        _, gpu, sm_pct, slowdown = best
        admits.append(_admit_one(job, gpu, sm_pct, slowdown))
        _place(job, gpu, sm_pct)
    started = {a.client_id for a in admits}
    reserved = (
        {} if held is None or held.holder in started else dict.fromkeys(held.gpus, held.holder)
    )
    return AdmissionPlan(tuple(admits), waiting, reserved)


def _admit_one(job: QueuedJob, gpu: _Gpu, sm_pct: float, slowdown: float) -> Admit:
    duration = (
        f"expected {job.expected_duration_s:g}s"
        if job.expected_duration_s is not None
        else "no expected duration"
    )
    return Admit(
        job.client_id,
        gpu.obs.gpu_uuid,
        sm_pct,
        f"SJF-BSBF: shortest fitting job ({duration}); GPU {gpu.obs.gpu_index} has the "
        f"least predicted slowdown {slowdown:.2f}x with {gpu.offline_count} offline "
        f"co-runner(s), {_mem(job.mem_bytes)} fits beside the online reserve, "
        f"SM share {sm_pct:g}%",
    )


def _admit_gang(job: QueuedJob, gpus: Sequence[_Gpu]) -> Admit | str:
    """A gang's start on ``job.ranks`` GPUs that each fit a rank, or why it waits.

    The GPUs it named, in its rank order; otherwise D14 (:func:`gpushare.control.gang.place_gang`:
    the GPUs where it may run the largest share of the time beside online services' gates).
    """
    named = job.gang_gpus
    pool = [g for g in gpus if not named or g.obs.gpu_uuid in named]
    fitting: list[_Gpu] = []
    refusals: list[str] = []
    for gpu in pool:
        why_not = _refusal(job, gpu)
        if why_not is None:
            fitting.append(gpu)
        else:
            refusals.append(f"GPU {gpu.obs.gpu_index}: {why_not}")
    if len(fitting) < job.ranks:
        why = "; ".join(refusals) or "too few shared GPUs admit new clients"
        return f"cannot start: the gang of {job.ranks} GPUs fits on {len(fitting)}: {why}"
    chosen, rule = _choose(job, fitting)
    sm_pct = min(g.share_pct for g in chosen)
    sm_pct = sm_pct if job.sm_pct is None else min(sm_pct, job.sm_pct)
    for gpu in chosen:
        _place(job, gpu, sm_pct)
    where = ",".join(str(g.obs.gpu_index) for g in chosen)
    return Admit(
        job.client_id,
        chosen[0].obs.gpu_uuid,
        sm_pct,
        f"a gang of {job.ranks}: every GPU fits a rank now, {_mem(job.mem_bytes)} each beside "
        f"the online reserve; GPUs {where} ({rule}), SM share {sm_pct:g}%",
        gang=tuple(g.obs.gpu_uuid for g in chosen),
    )


def _choose(job: QueuedJob, fitting: Sequence[_Gpu]) -> tuple[list[_Gpu], str]:
    """Of GPUs that each fit a rank, the gang's: as named in its rank order, else D14 (or D12)."""
    named = job.gang_gpus
    rule = "as named" if named else "D14"
    if named:
        chosen = sorted(fitting, key=lambda g: named.index(g.obs.gpu_uuid))
    elif any(g.obs.gate is not None and g.obs.gate.delay_s > 0 for g in fitting):
        # D14 is for gates that close on every request; beside a gate delay the most memory
        # left (D12) stands, in index order for the ranks.
        rule = "D12: a gate runs a delay"
        chosen = sorted(sorted(fitting, key=lambda g: (-_mem_left(g), g.obs.gpu_index))[: job.ranks],
                        key=lambda g: g.obs.gpu_index)  # fmt: skip
    else:
        views = [
            GpuForGang(
                g.obs.gpu_index,
                _mem_left(g),
                gpu_services(
                    (c.client_id for c in g.obs.online()),
                    None if g.obs.gate is None else g.obs.gate.busy_fraction,
                ),
            )
            for g in fitting
        ]
        placed = place_gang(views, job.ranks, 0)
        assert placed is not None  # every GPU here fits a rank
        chosen = [g for g in fitting if g.obs.gpu_index in placed.gpus]

    return chosen, rule


@dataclass(frozen=True, slots=True)
class _Held:
    """The GPUs one waiting gang reserved this round (D15) and what is said about them."""

    holder: str
    #: Reserved GPUs' UUIDs, in the gang's rank order.
    gpus: tuple[str, ...]
    indices: str
    since_s: float
    until_s: float

    def others(self, gpus: Sequence[_Gpu]) -> list[_Gpu]:
        return [g for g in gpus if g.obs.gpu_uuid not in self.gpus]

    def refusals(self, job: QueuedJob, gpus: Sequence[_Gpu], now: float) -> list[str]:
        held = [g for g in gpus if g.obs.gpu_uuid in self.gpus]
        if job.gpu is not None:
            held = [g for g in held if job.gpu in (g.obs.gpu_uuid, str(g.obs.gpu_index))]
        return [
            f"GPU {g.obs.gpu_index}: reserved for the gang {self.holder} "
            f"since {_ago(now - self.since_s)}"
            for g in held
        ]

    def explain(self, job: QueuedJob, why: str, now: float) -> str:
        if job.client_id == self.holder:
            return (
                f"reserving GPUs {self.indices} since {_ago(now - self.since_s)} (EASY backfill, "
                f"until {_ago(self.until_s - now)} from now); {why}"
            )
        if job.gang_gpus and not set(job.gang_gpus) & set(self.gpus):
            return why
        return f"{why}; GPUs {self.indices} are reserved for the gang {self.holder}"


def _reservation(
    ordered: Sequence[QueuedJob],
    gpus: Sequence[_Gpu],
    observations: Mapping[str, Observation],
    now: float,
    reserve: GangReserve | None,
) -> _Held | None:
    """The one gang that reserves GPUs this round, if any (D15, EASY backfill).

    The first gang in queue order that has waited ``reserve.after_s``, whose reservation has not
    lapsed, whose owner has no live client on the node (a user running work cannot also hold
    GPUs idle for more), and that would fit on enough GPUs once their offline clients are gone.
    """
    if reserve is None:
        return None
    running = {c.uid for o in observations.values() for c in o.clients if c.state.is_live}
    for job in ordered:
        since = job.submitted_at_s + reserve.after_s
        until = since + reserve.max_hold_s
        if job.ranks <= 1 or job.not_before_s > now or not since <= now < until:
            continue
        if job.uid in running:
            continue
        fitting = [g for g in (_drained(g, now) for g in gpus) if _refusal(job, g) is None]
        fitting = [g for g in fitting if not job.gang_gpus or g.obs.gpu_uuid in job.gang_gpus]
        if len(fitting) < job.ranks:
            continue  # online work or closed GPUs stop it, not offline jobs: nothing to reserve
        chosen, _ = _choose(job, fitting)
        where = ",".join(str(g.obs.gpu_index) for g in chosen)
        return _Held(job.client_id, tuple(g.obs.gpu_uuid for g in chosen), where, since, until)
    return None


def _drained(gpu: _Gpu, now: float) -> _Gpu:
    """The GPU as it will be once its offline clients end: their memory, slots and uids free."""
    live = [c for c in gpu.obs.clients if c.state.is_live]
    offline = [c for c in live if c.cls is ClientClass.OFFLINE]
    online = [c for c in live if c.cls is not ClientClass.OFFLINE]
    promised = promised_to_views(online, now)
    free = free_memory_bytes(gpu.obs)
    return dataclasses.replace(
        gpu,
        promised_bytes=promised,
        # What NVML shows the offline clients using comes back as free; their promises end.
        available_bytes=None
        if free is None
        else free + sum(c.mem_used_bytes or 0 for c in offline) - promised,
        live=len(online),
        uids={c.uid for c in online},
        offline_count=0,
    )


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def queue_order(queue: Sequence[QueuedJob]) -> list[QueuedJob]:
    """The order admission tries queued jobs in.

    Shortest declared length first, then the jobs without one; each group by submission time
    (then by id, so that the order is total).
    """
    return sorted(
        queue,
        key=lambda j: (
            j.expected_duration_s is None,
            j.expected_duration_s if j.expected_duration_s is not None else math.inf,
            j.submitted_at_s,
            _id_number(j.client_id),
            j.client_id,
        ),
    )


def positions(queue: Sequence[QueuedJob]) -> dict[str, int]:
    """Each queued job's place in :func:`queue_order`, 1 being the next one tried."""
    return {j.client_id: n for n, j in enumerate(queue_order(queue), start=1)}


def _id_number(client_id: str) -> int:
    # c9 before c10: ids are c<number> (a simulator's scenario may name its own: those sort last).
    digits = client_id[1:]
    return int(digits) if digits.isdigit() else 1 << 62


def _gpu_view(
    obs: Observation,
    shares: Mapping[str, float],
    max_clients: int | Mapping[str, int],
    multiuser: bool | Mapping[str, bool],
    probe_slots: int,
    now: float,
) -> _Gpu:
    live = [c for c in obs.clients if c.state.is_live]
    slots = (
        max_clients
        if isinstance(max_clients, int)
        else max_clients.get(obs.gpu_uuid, DEFAULT_MAX_CLIENTS)
    )
    multi = multiuser if isinstance(multiuser, bool) else multiuser.get(obs.gpu_uuid, False)
    free = free_memory_bytes(obs)
    closed: str | None = None
    if obs.sample.lost:
        closed = LOST
    elif not obs.admissions_open:
        closed = "admissions closed on this GPU"
    elif obs.mps_state is not MpsState.UP:
        closed = mps_closed(obs.mps_state)
    elif free is None:
        closed = "free memory unknown (NVML gave no reading)"
    share = min(shares.get(obs.gpu_uuid, obs.offline_sm_pct_max), obs.offline_sm_pct_max)
    util = obs.sample.sm_active_pct
    if util is None:
        util = obs.sample.gpu_util_pct
    # A job admitted on an earlier tick may have no CUDA context yet: NVML's free memory still
    # counts its --mem as free, and the next tick would start a second job into it.
    promised = promised_to_views(live, now)
    return _Gpu(
        obs=obs,
        share_pct=share,
        promised_bytes=promised,
        available_bytes=None if free is None else free - promised,
        max_clients=slots,
        probe_slots=probe_slots,
        live=len(live),
        uids={c.uid for c in live},
        offline_count=sum(1 for c in live if c.cls is ClientClass.OFFLINE),
        # Unknown activity counts as no idle SMs: the prediction errs towards slowdown.
        idle_pct=0.0 if util is None else max(0.0, 100.0 - util),
        multiuser=multi,
        closed=closed,
    )


def _refusal(job: QueuedJob, gpu: _Gpu) -> str | None:
    others = () if gpu.multiuser else tuple(f"uid {u}" for u in sorted(gpu.uids) if u != job.uid)
    room = Room(
        closed=gpu.closed,
        max_clients=gpu.max_clients,
        probe_slots=gpu.probe_slots,
        live=gpu.live,
        # A GPU of unknown free memory is closed above; none here is unknown.
        available_bytes=gpu.available_bytes if gpu.available_bytes is not None else 0,
        promised_bytes=gpu.promised_bytes,
        reserve_bytes=gpu.obs.mem_reserve_bytes,
        other_users=others,
    )
    return misfit(room, job.mem_bytes)


def _mem_left(gpu: _Gpu) -> int:
    """Memory left beside the online reserve (0 where unknown: such a GPU is closed)."""
    if gpu.available_bytes is None:
        return 0
    return gpu.available_bytes - gpu.obs.mem_reserve_bytes


def _slowdown(sm_pct: float, gpu: _Gpu) -> float:
    effective = min(sm_pct, max(gpu.idle_pct, sm_pct / (gpu.offline_count + 1)))
    return 100.0 / max(effective, 1e-6)


def _place(job: QueuedJob, gpu: _Gpu, sm_pct: float) -> None:
    gpu.available_bytes = (gpu.available_bytes or 0) - (job.mem_bytes or 0)
    gpu.live += 1
    gpu.uids.add(job.uid)
    gpu.offline_count += 1
    gpu.idle_pct = max(0.0, gpu.idle_pct - sm_pct)


def _mem(n: int | None) -> str:
    return "unknown memory" if n is None else f"{n / (1 << 30):.2f}GiB"
