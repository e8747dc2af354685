"""Gangs: the rules for a job whose processes span GPUs and wait for each other (issue 35).

A DDP training job (``torchrun --nproc_per_node=N``) runs one rank per GPU and ends every
iteration with an all-reduce that waits for the slowest rank; a frozen rank stalls every rank.
So a gang makes progress only while it may run on **all** its GPUs at once. On a GPU with an
online service that tells the daemon of its requests, the gate lets offline work run while no
request is in flight (under a looser SLO, also beside short spells): a fraction ``1 - rho`` of
the time, ``rho`` being the share of time the gate holds offline work frozen. Requests of
different services arrive independently, so the windows in which a gang across GPUs of several
services may run on all of them at once are about ``prod(1 - rho_s)`` of the time (the gang does
somewhat better, since a rank that waits keeps the work it did); the GPUs of one tensor-parallel
server are busy at the same moments, so they cost the gang one factor, not one per GPU.

:func:`place_gang` is the admission rule: the ``n`` GPUs that fit the ranks' memory and maximise
the gang's predicted run fraction (docs/design.md D14). :func:`gang_duty` is the duty rule: a
gang's ranks all take the smallest duty of its GPUs, since a rank cannot use more than the
slowest rank lets it (the barrier), and the time it would run beyond that only costs its GPU's
online service. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Generic

from gpushare.control.policy import Policy, StateT
from gpushare.model import Action, Observation, SetDuty

#: Combinations examined exhaustively; beyond this (16 GPUs choose 8 is 12,870) a greedy pick.
MAX_EXACT_COMBINATIONS = 20_000
#: A busy fraction is clamped under 1, so that a saturated service costs a large finite amount.
RHO_MAX = 0.99


@dataclass(frozen=True, slots=True)
class GpuForGang:
    """What the gang placement needs to know of one GPU.

    ``services`` maps each online service with a client on this GPU to its busy fraction (0..1):
    the share of time this GPU's gate keeps offline work frozen for it, as the gate measures it
    (at a tight SLO, the share of time the service has a request in flight; under a looser one
    less, since the gate then lets offline work run beside short spells). The offered load stands
    in for it only at a tight SLO (docs/design.md §7). A tensor-parallel server has the same key
    on each of its GPUs. ``available_bytes`` is the memory a new client may still take.
    """

    index: int
    available_bytes: int
    services: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class GangPlacement:
    """The GPUs chosen for a gang and the run fraction predicted for it there."""

    gpus: tuple[int, ...]
    run_fraction: float
    services: tuple[str, ...]


def run_fraction(gpus: Sequence[GpuForGang]) -> float:
    """The share of time a gang on ``gpus`` may run under request gating: ``prod(1 - rho_s)``.

    Over the distinct services on those GPUs (a TP server counts once); 1 on GPUs without any.
    """
    rho: dict[str, float] = {}
    for g in gpus:
        for name, busy in g.services.items():
            rho[name] = max(rho.get(name, 0.0), min(RHO_MAX, max(0.0, busy)))
    return math.prod(1.0 - r for r in rho.values())


def place_gang(
    gpus: Sequence[GpuForGang], ranks: int, mem_per_rank_bytes: int
) -> GangPlacement | None:
    """The ``ranks`` GPUs for a gang, one rank each, or None where fewer GPUs fit its memory.

    The rule: of the GPUs whose available memory holds a rank, the set with the largest
    :func:`run_fraction`; ties go to fewer online services touched, then to more memory left,
    then to the lowest indices. Past :data:`MAX_EXACT_COMBINATIONS` sets it builds the set
    greedily, each step adding the GPU that keeps the run fraction highest.
    """
    if ranks <= 0:
        raise ValueError(f"a gang needs at least one rank, not {ranks}")
    fits = sorted((g for g in gpus if g.available_bytes >= mem_per_rank_bytes), key=_index)
    if len(fits) < ranks:
        return None
    if math.comb(len(fits), ranks) <= MAX_EXACT_COMBINATIONS:
        best = max(combinations(fits, ranks), key=_score)
    else:
        chosen: list[GpuForGang] = []
        rest = list(fits)
        while len(chosen) < ranks:
            pick = max(rest, key=lambda g: _score((*chosen, g)))
            chosen.append(pick)
            rest.remove(pick)
        best = tuple(chosen)
    names = sorted({name for g in best for name in g.services})
    return GangPlacement(tuple(sorted(g.index for g in best)), run_fraction(best), tuple(names))


def gpu_services(online_client_ids: Iterable[str], busy_fraction: float | None) -> dict[str, float]:
    """One GPU's :attr:`GpuForGang.services` as the daemon knows them: its online clients as one key.

    The daemon measures one gate share per GPU (``busy_fraction``: the share of the gate's window
    with requests in flight), not one per service, so the online clients of a GPU count as one
    service under one key, their ids joined: a tensor-parallel server alone on its GPUs has the
    same key on each and costs a gang once. Unmeasured (``None``: no request boundaries yet) is
    0, and the service still counts in :func:`place_gang`'s tie of fewer services touched.
    """
    ids = sorted(set(online_client_ids))
    if not ids:
        return {}
    return {"+".join(ids): 0.0 if busy_fraction is None else busy_fraction}


def _index(g: GpuForGang) -> int:
    return g.index


def _score(gs: Sequence[GpuForGang]) -> tuple[float, int, int, tuple[int, ...]]:
    services = {name for g in gs for name in g.services}
    memory = sum(g.available_bytes for g in gs)
    # max() keeps the first of equals; negated indices make the lowest indices win a tie.
    return (run_fraction(gs), -len(services), memory, tuple(-g.index for g in gs))


def gang_duty(duties: Mapping[str, float], gang_gpus: Sequence[str]) -> float:
    """The duty every rank of a gang takes: the smallest duty of its GPUs (1 where none is set).

    Each GPU's duty thaws offline work from the start of the same control period, so with equal
    duties the ranks' windows coincide and the gang loses nothing to the barrier.
    """
    return min((duties.get(g, 1.0) for g in gang_gpus), default=1.0)


class GangDuty(Generic[StateT]):
    """A policy that gives every GPU of a gang the gang's duty (:func:`gang_duty`).

    It wraps a one-GPU policy: each GPU's step is the inner policy's, and a ``SetDuty`` for a
    GPU that holds ranks of a gang is replaced by the smallest duty the inner policy last chose
    on the gang's GPUs (a GPU stepped later in the tick counts with its previous tick's duty).
    ``gangs`` lists each gang's GPU uuids. It remembers each GPU's own duty across steps: that
    memory is the only state it adds, and it never does I/O or reads a clock.
    """

    def __init__(self, inner: Policy[StateT], gangs: Sequence[Sequence[str]]) -> None:
        self.inner = inner
        self.name = f"{inner.name}+gang-duty"
        self.offline_mps_priority = inner.offline_mps_priority
        self.gangs = tuple(tuple(g) for g in gangs)
        #: Each GPU's own duty (the inner policy's) and the duty last sent for it.
        self._own: dict[str, float] = {}
        self._applied: dict[str, float] = {}

    def initial_state(self, gpu_uuid: str, now: float) -> StateT:
        """The inner policy's initial state."""
        return self.inner.initial_state(gpu_uuid, now)

    def step(
        self, state: StateT, observation: Observation, now: float
    ) -> tuple[StateT, Sequence[Action]]:
        """The inner policy's step, with the gang's duty in place of this GPU's own."""
        state, actions = self.inner.step(state, observation, now)
        uuid = observation.gpu_uuid
        mine = [g for g in self.gangs if uuid in g]
        if not mine:
            return state, actions
        out: list[Action] = []
        why = "gang duty"
        for a in actions:
            if isinstance(a, SetDuty):  # re-emitted below, as the gang's
                self._own[uuid] = a.duty
                why = a.reason
            else:
                out.append(a)
        duty = min(gang_duty(self._own, g) for g in mine)
        if duty != self._applied.get(uuid, 1.0):
            self._applied[uuid] = duty
            own = self._own.get(uuid, 1.0)
            if duty < own:
                why = f"gang duty {duty:g}: the smallest of its GPUs' (own {own:g})"
            out.append(SetDuty(uuid, duty, why))
        return state, out


# ------------------------------------------------------------------------------ adoption

#: The variables that tie a torchrun job's workers together, read by the adoption scan: the
#: elastic agent's run id (or a gang's environment, ``gpushare rank-exec``'s) and each worker's
#: rank (``rank-exec`` keeps the launcher's in ``GPUSHARE_LOCAL_RANK``).
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_GANG = "GPUSHARE_GANG"
ENV_GANG_LOCAL_RANK = "GPUSHARE_LOCAL_RANK"
GANG_ENV: tuple[str, ...] = (ENV_RUN_ID, ENV_LOCAL_RANK, ENV_GANG, ENV_GANG_LOCAL_RANK)


@dataclass(frozen=True, slots=True)
class RankFacts:
    """One process an adoption rule adopts, as the gang grouping sees it.

    ``gpu_uuid`` is the GPU its decision gave it; ``cls`` its class; ``environ`` the variables
    the scan read (attacker-controlled: the process's owner wrote them).
    """

    pid: int
    ppid: int
    uid: int
    cls: str
    gpu_uuid: str | None
    environ: Mapping[str, str] | None


@dataclass(frozen=True, slots=True)
class FoundGang:
    """Ranks of one job to adopt as one client through their common parent."""

    parent: int
    pids: tuple[int, ...]
    """The ranks' pids, in rank order."""
    gpus: tuple[str, ...]
    """Each rank's GPU, in rank order."""


def _rank(environ: Mapping[str, str] | None) -> tuple[str, int] | None:
    """A process's job key and local rank, or None where it does not say both."""
    env = environ or {}
    key = env.get(ENV_RUN_ID) or env.get(ENV_GANG)
    raw = env.get(ENV_GANG_LOCAL_RANK) or env.get(ENV_LOCAL_RANK)
    if not key or raw is None or not (raw.isascii() and raw.isdigit()):
        return None
    return key, int(raw)


@dataclass(frozen=True, slots=True)
class Grouping:
    """What :func:`group_ranks` found: gangs, and ranks left for the next scan."""

    gangs: tuple[FoundGang, ...]
    deferred: frozenset[int]
    """Ranks of a parent with a rank still too young to decide: none is adopted this scan."""


def group_ranks(
    ranks: Sequence[RankFacts],
    parent_uids: Mapping[int, int],
    unsettled: Collection[int] = (),
) -> Grouping:
    """The gangs among processes adoption takes: ranks of one job, each on a GPU of its own.

    Ranks form a gang when they have the same parent, the same owner, the same class and the
    same job key (``TORCHELASTIC_RUN_ID``, else ``GPUSHARE_GANG``), distinct local ranks and
    distinct GPUs, and when the parent is a process of that same owner (``parent_uids``; not
    init, not root's ``slurmstepd``). The environment decides nothing alone: a process is a
    child of the parent it has, and a user cannot place a process under another user's parent,
    so another user's process never joins. ``unsettled`` lists parents with a rank not decided
    yet (too young for the scan): their ranks wait for the next scan, rather than starting a
    gang without it. Anything else is left to be adopted one process at a time, as before.
    """
    groups: dict[tuple[int, int, str, str], list[tuple[int, RankFacts]]] = {}
    for r in ranks:
        found = _rank(r.environ)
        if found is None or r.gpu_uuid is None or r.ppid <= 1:
            continue
        key, local = found
        groups.setdefault((r.uid, r.ppid, r.cls, key), []).append((local, r))
    out: list[FoundGang] = []
    deferred: set[int] = set()
    for (uid, parent, _cls, _key), members in sorted(groups.items()):
        members.sort(key=lambda m: m[0])
        locals_ = [m[0] for m in members]
        gpus = [m[1].gpu_uuid or "" for m in members]
        if parent_uids.get(parent) != uid:
            continue
        if parent in unsettled:
            deferred.update(m[1].pid for m in members)
            continue
        if len(members) < 2 or len(set(locals_)) != len(locals_) or len(set(gpus)) != len(gpus):
            continue
        out.append(FoundGang(parent, tuple(m[1].pid for m in members), tuple(gpus)))
    return Grouping(tuple(out), frozenset(deferred))
