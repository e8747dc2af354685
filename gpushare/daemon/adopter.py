"""Adoption in the daemon: the rules in force, the periodic scan of the host's processes, the news.

The matching is :mod:`gpushare.adoption` (pure); this module feeds it: the config's ``[[adopt]]``
rules (with the config file's owner standing behind them: root's config may adopt anyone's
processes), the scheduler jobs registered by ``adopt`` requests (their caller standing behind
them), and the facts of every process on the host (:func:`gpushare.node.procs.process_facts`).
What it skips, and why:

- processes younger than ``min_age_s``: between ``fork`` and ``exec`` a process still shows its
  parent's environment and cgroup, and a service manager or ``slurmstepd`` moves it into its cgroup
  just after it starts; a second look a moment later sees what it really is;
- the daemon itself, and processes that are already a client or descend from one (a launched
  client's children are that client's, not new ones);
- the MPS control daemons and servers, which gpushare runs itself.

Each refusal and each rule that matches nothing is reported once, when it first appears
(:attr:`Outcome.news`), not at every scan.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gpushare import adoption, protocol
from gpushare.adoption import Decision, Rule
from gpushare.config import AdoptRule, Config
from gpushare.daemon.registry import Registration
from gpushare.model import ClientClass, GpuSample, ProcessFacts
from gpushare.mpsenv import check_limits
from gpushare.node import procs

DEFAULT_MIN_AGE_S = 1.0
"""How old a process must be before a scan decides it (see the module docstring)."""

_OWN_PROCESSES = ("nvidia-cuda-mps",)  # the MPS control daemon and server: gpushare's own


@dataclass(frozen=True, slots=True)
class Found:
    """A process to make a client: the decision and the facts it was made on."""

    decision: Decision
    facts: ProcessFacts
    source: str
    """The rule's name and where it came from, as ``adopted_by`` records it."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one scan found."""

    adopt: tuple[Found, ...]
    """Processes to make clients now (roots only: their descendants are part of them)."""
    news: tuple[str, ...]
    """Refusals and idle rules not reported before (each appears once while it lasts)."""
    young: int
    """Processes left for a later scan because they are younger than ``min_age_s``."""


def config_rules(cfg: Config, config_path: Path | None) -> list[Rule]:
    """The config's ``[[adopt]]`` rules and who stands behind them: the file's owner.

    A config file owned by root is root's config: its rules may adopt any user's processes into
    any class. Without a file (built-in defaults) the daemon's own uid stands behind them.
    """
    if config_path is not None:
        try:
            owner = os.stat(config_path).st_uid
        except OSError:
            owner = os.geteuid()
        source = str(config_path)
    else:
        owner, source = os.geteuid(), "the built-in default"
    return [Rule(spec, owner, source) for spec in cfg.adopt]


def check_adopt(req: protocol.AdoptRequest, caller_uid: int) -> tuple[ClientClass, str | None]:
    """Refuse an ``adopt`` request gpushare cannot honour; its class and a permission problem.

    Returns:
        The class, and ``None`` or the reason the caller may not register this job (a caller
        other than root registers its own processes only: that is its owner asking).

    Raises:
        ValueError: a bad class, limit or job name, or a registration that would match every
            process of the user; the message names the fix.
    """
    try:
        cls = ClientClass(req.cls)
    except ValueError:
        raise ValueError(f"class {req.cls!r} is not a class: use online or offline") from None
    if not req.source.strip() or not req.job.strip():
        raise ValueError("source and job must name the scheduler and its job, e.g. slurm and 42")
    if not req.match_env and not req.pids:
        raise ValueError(
            "give match_env (e.g. SLURM_JOB_ID=<job>) or pids: without either the registration "
            f"would adopt every process of uid {req.uid}"
        )
    slo = req.slo_p99_ms / 1000 if req.slo_p99_ms is not None else None
    check_limits(cls, req.sm_pct, req.mem_bytes, slo)
    if caller_uid not in (0, req.uid):
        return cls, (
            f"uid {caller_uid} may register its own processes only (uid {caller_uid}), not uid "
            f"{req.uid}'s; a prolog that registers other users' jobs runs as root"
        )
    return cls, None


def registration_rules(reg: Registration) -> list[Rule]:
    """The adoption rule of a registered job: its owner's processes whose environment matches.

    Explicit ``pids`` get a rule of their own (the same class and limits, no environment
    condition), so they are adopted even when they do not carry the job's variables.
    """
    req = protocol.from_params(protocol.AdoptRequest, dict(reg.params))
    name = f"{reg.source} job {reg.job}"
    spec = AdoptRule(
        name=name, user=str(req.uid), env=dict(req.match_env), cls=ClientClass(req.cls).value,
        slo_p99_s=req.slo_p99_ms / 1000 if req.slo_p99_ms is not None else None,
        sm_pct=req.sm_pct, mem_bytes=req.mem_bytes,
    )  # fmt: skip
    rules = [Rule(spec, reg.owner_uid, name)] if req.match_env else []
    if req.pids:
        rules.append(_PidRule(replace(spec, env={}), reg.owner_uid, name, frozenset(req.pids)))
    return rules


@dataclass(frozen=True, slots=True)
class _PidRule(Rule):
    """A registration's explicit pids: matched by pid (and the owner's uid), nothing else."""

    pids: frozenset[int] = frozenset()


def gpu_processes(samples: Sequence[GpuSample], nvml: bool) -> dict[int, tuple[str, ...]] | None:
    """Each pid NVML lists and its GPUs; ``None`` where no real NVML reports processes."""
    if not nvml:
        return None
    found: dict[int, list[str]] = {}
    for s in samples:
        for p in s.processes:
            found.setdefault(p.pid, []).append(s.uuid)
    return {pid: tuple(uuids) for pid, uuids in found.items()}


class Adopter:
    """Scans the host's processes against the rules; remembers what it already reported.

    Args:
        min_age_s: processes younger than this are left for a later scan.
        facts_of: :func:`gpushare.node.procs.process_facts` (tests pass their own).
        all_pids: :func:`gpushare.node.procs.all_pids`.
        clock: wall-clock seconds, the unit of :attr:`ProcessFacts.start_time`.
    """

    def __init__(
        self,
        *,
        min_age_s: float = DEFAULT_MIN_AGE_S,
        facts_of: Callable[..., ProcessFacts | None] = procs.process_facts,
        all_pids: Callable[[], list[int]] = procs.all_pids,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.min_age_s = min_age_s
        self._facts_of = facts_of
        self._all_pids = all_pids
        self._clock = clock
        self._told: set[str] = set()

    def scan(
        self,
        rules: Sequence[Rule],
        *,
        clients: Collection[int],
        gpu_pids: Mapping[int, tuple[str, ...]] | None,
        only: Collection[int] | None = None,
    ) -> Outcome:
        """Decide every process of the host (or of ``only``) against ``rules``.

        Args:
            rules: job registrations first (they are the more specific), then the config's.
            clients: pids that are already clients; they and their descendants are skipped.
            gpu_pids: :func:`gpu_processes`.
            only: decide these pids only (an ``adopt`` request's explicit pids, at once).
        """
        names = set(adoption.FACT_ENV) | {k for r in rules for k in r.spec.env}
        now = self._clock()
        facts: list[ProcessFacts] = []
        for pid in self._all_pids() if only is None else sorted(only):
            f = self._facts_of(pid, names, gpu_pids)
            if f is not None:  # gone (or a kernel thread) while it was read: nothing to adopt
                facts.append(f)
        skip = _descendants_of(clients, facts) | {os.getpid()}
        young = {f.pid for f in facts if now - f.start_time < self.min_age_s}
        candidates = [
            f for f in facts
            if f.pid not in skip and f.pid not in young and not f.name.startswith(_OWN_PROCESSES)
        ]  # fmt: skip
        plain = [r for r in rules if not isinstance(r, _PidRule)]
        by_pid_rules = [r for r in rules if isinstance(r, _PidRule)]
        result = adoption.scan(plain, candidates)
        decisions = list(result.decisions)
        decided = {d.pid for d in decisions} | set(result.members)
        for f in candidates:
            if f.pid in decided:
                continue
            for pr in by_pid_rules:
                if f.pid in pr.pids and str(f.uid) == pr.spec.user:
                    decisions.append(adoption.decide([pr], f))
                    break
        by_pid = {f.pid: f for f in candidates}
        rule_source = {r.spec.name: f"rule {r.spec.name!r} ({r.source})" for r in rules}
        for r in rules:
            if r.spec.name == r.source:
                rule_source[r.spec.name] = r.source  # a job: "slurm job 42" says it all
        adopt = tuple(
            Found(d, by_pid[d.pid], rule_source.get(d.rule or "", d.rule or ""))
            for d in decisions
            if d.adopt
        )
        messages = [d.reason for d in decisions if not d.adopt]
        messages += [n for d in adopt for n in d.decision.notes]
        if only is None:
            # A job whose processes have not started yet matches nothing: only config rules
            # that match nothing are worth a message.
            # A rule whose processes are clients already (or too young yet) is not idle.
            idle = {
                r.spec.name for r in rules
                if r.spec.name != r.source and not any(adoption.matches(r.spec, f) for f in facts)
            }  # fmt: skip
            messages += [m for m in result.unmatched if any(f"rule {n!r} " in m for n in idle)]
        news = tuple(m for m in messages if m not in self._told)
        self._told = (self._told if only is not None else set()) | set(messages)
        return Outcome(adopt, news, len(young - skip))


def _descendants_of(roots: Collection[int], facts: Sequence[ProcessFacts]) -> set[int]:
    parent = {f.pid: f.ppid for f in facts}
    out: set[int] = set()
    for f in facts:
        seen: set[int] = set()
        pid: int | None = f.pid
        while pid is not None and pid not in seen:
            if pid in roots:
                out.add(f.pid)
                break
            seen.add(pid)
            pid = parent.get(pid)
    return out
