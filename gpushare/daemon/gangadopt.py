"""Adoption of a job's ranks as one gang client (issue 35): the scan's side of gang grouping.

``torchrun --nproc_per_node=N`` started outside gpushare is a parent with one worker per GPU.
Where the adoption rules adopt the workers (each on its own GPU, from its environment), they are
one job whose ranks wait for each other: adopted one by one they would be N clients frozen
apart, a rank left running against frozen peers. The rule that groups them is
:func:`gpushare.control.gang.group_ranks` (same parent of the same owner, same job key, distinct
ranks and GPUs; docs/security.md on why the environment alone decides nothing); this module
feeds it the scan's facts and turns each gang into what the adopter adopts: the **parent** as
the client's process, so that its pauser (the parent's cgroup or SIGSTOP to it and its
descendants) reaches every rank at once, with the gang's GPUs in rank order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpushare.control.gang import FoundGang, RankFacts, group_ranks
from gpushare.model import ProcessFacts

if TYPE_CHECKING:
    from gpushare.daemon.adopter import Found


@dataclass(frozen=True, slots=True)
class GangFound:
    """A gang to adopt: its ranks as the rules found them (rank order) and their parent."""

    gang: FoundGang
    ranks: tuple[Found, ...]
    parent: ProcessFacts


def split(
    adopt: Sequence[Found], facts: Sequence[ProcessFacts], young: Collection[int]
) -> tuple[tuple[GangFound, ...], tuple[Found, ...]]:
    """The gangs among ``adopt``, and the processes adopted one by one (deferred ranks left out).

    ``facts`` are every process the scan read (the parents among them); ``young`` the pids too
    young to decide, whose parents' ranks wait for the next scan.
    """
    by_pid = {f.pid: f for f in facts}
    ranks = [
        RankFacts(
            f.facts.pid,
            f.facts.ppid,
            f.facts.uid,
            f.decision.cls.value,
            f.decision.gpu_uuid,
            f.facts.environ,
        )  # fmt: skip
        for f in adopt
        if f.decision.cls is not None
    ]
    # A parent that runs with rights its user lacks (setuid), or the daemon, is never a client.
    me = os.getpid()
    parents: Mapping[int, int] = {f.pid: f.uid for f in facts if not f.setuid and f.pid != me}
    unsettled = {by_pid[pid].ppid for pid in young if pid in by_pid}
    grouping = group_ranks(ranks, parents, unsettled)
    found = {f.facts.pid: f for f in adopt}
    gangs = tuple(
        GangFound(g, tuple(found[pid] for pid in g.pids), by_pid[g.parent]) for g in grouping.gangs
    )
    taken = {pid for g in grouping.gangs for pid in g.pids} | grouping.deferred
    return gangs, tuple(f for f in adopt if f.facts.pid not in taken)


def parent_found(g: GangFound, shared: Collection[str]) -> Found | str:
    """What the adopter adopts for a gang: its parent, with rank 0's decision and GPU.

    Or why not: a GPU of a rank that gpushare does not share.
    """
    first = g.ranks[0]
    off = [uuid for uuid in g.gang.gpus if uuid not in shared]
    if off:
        return (
            f"the gang of pid {g.parent.pid} ({g.parent.name}) of {g.parent.user} not adopted by "
            f"{first.source}: GPU {off[0]} is not shared by gpushare here"
        )
    notes = tuple(n for r in g.ranks for n in r.decision.notes)
    decision = dataclasses.replace(
        first.decision, pid=g.parent.pid, gpu_uuid=g.gang.gpus[0], notes=notes
    )
    return dataclasses.replace(first, decision=decision, facts=g.parent)
