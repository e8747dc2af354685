"""Adoption in the daemon: the rules in force, the periodic scan of the host's processes, the news.

The matching is :mod:`gpushare.control.adoption` (pure); this module feeds it: the config's ``[[adopt]]``
rules (with the config file's owner standing behind them: root's config may adopt anyone's
processes), the scheduler jobs registered by ``adopt`` requests (their caller standing behind
them), and the facts of every process on the host (:func:`gpushare.node.procs.facts.process_facts`).
What it skips, and why:

- processes younger than ``min_age_s``: between ``fork`` and ``exec`` a process still shows its
  parent's environment and cgroup, and a service manager or ``slurmstepd`` moves it into its cgroup
  just after it starts; a second look a moment later sees what it really is;
- the daemon itself, and processes that are already a client or descend from one (a launched
  client's children are that client's, not new ones);
- the MPS control daemons and servers, which gpushare runs itself.

Each refusal and each rule that matches nothing is reported once, when it first appears
(:attr:`Outcome.refused`, :attr:`Outcome.idle`), not at every scan; the notes on an adopted
process (started without the MPS environment, other limits than the rule's) go with it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from gpushare import protocol
from gpushare.config import AdoptRule, Config
from gpushare.control import adoption
from gpushare.control.adoption import Decision, Rule
from gpushare.control.gang import GANG_ENV
from gpushare.daemon import gangadopt
from gpushare.daemon.factcache import FactCache
from gpushare.daemon.gangadopt import GangFound
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import ClientRecord, Registration
from gpushare.daemon.state import PAUSE_ERRORS, NodeState
from gpushare.model import ClientClass, ClientState, GpuSample, PauseMechanism, ProcessFacts
from gpushare.mpsenv import check_limits
from gpushare.node.procs import facts as proc_facts
from gpushare.node.procs.identity import is_same_process, process_identity

log = structlog.get_logger(__name__)

S = ClientState

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
    refused: tuple[str, ...]
    """Processes a rule matched but may not or cannot adopt, not reported before (each appears
    once while it lasts)."""
    idle: tuple[str, ...]
    """Config rules that match no process, not reported before."""
    young: int
    """Processes left for a later scan because they are younger than ``min_age_s``."""
    gangs: tuple[GangFound, ...] = ()
    """Ranks of one job to adopt as one gang client (:mod:`gpushare.daemon.gangadopt`)."""


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
        facts_of: :func:`gpushare.node.procs.facts.process_facts` (tests pass their own).
        all_pids: :func:`gpushare.node.procs.facts.all_pids`.
        clock: wall-clock seconds, the unit of :attr:`ProcessFacts.start_time`.
        cache: what the full scan reads through (:mod:`gpushare.daemon.factcache`); by default
            one reading with ``facts_of``.

    A full scan reads each process in full once and then only checks its ``stat`` (the cache's
    docstring says what is read again and when), and decides the rules again only when an input of
    the decision changed: the facts, the rules, the clients, NVML's GPU processes or ``min_age_s``.
    """

    def __init__(
        self,
        *,
        min_age_s: float = DEFAULT_MIN_AGE_S,
        facts_of: Callable[..., ProcessFacts | None] = proc_facts.process_facts,
        all_pids: Callable[[], list[int]] = proc_facts.all_pids,
        clock: Callable[[], float] = time.time,
        cache: FactCache | None = None,
    ) -> None:
        self.min_age_s = min_age_s
        self._facts_of = facts_of
        self._all_pids = all_pids
        self._clock = clock
        self.told: set[str] = set()
        self.cache = cache if cache is not None else FactCache(facts_of=facts_of)
        # The inputs, outcome and messages of the last full scan (see scan).
        self._last: tuple[Any, Outcome, set[str]] | None = None

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
        names = set(adoption.FACT_ENV) | set(GANG_ENV) | {k for r in rules for k in r.spec.env}
        now = self._clock()
        facts: list[ProcessFacts] = []
        if only is None:
            facts, changed = self.cache.read(
                self._all_pids(), names, gpu_pids, now=now, min_age_s=self.min_age_s,
                clients=clients if isinstance(clients, set | frozenset) else set(clients),
            )  # fmt: skip
            gpus = None if gpu_pids is None else dict(gpu_pids)  # a copy: the caller's may change
            inputs = (list(rules), frozenset(clients), gpus, self.min_age_s)
            last = self._last
            if not changed and last is not None and last[0] == inputs:
                # Nothing the decision depends on changed: the same outcome, nothing new to tell.
                self.told = set(last[2])
                return replace(last[1], refused=(), idle=())
        for pid in sorted(only) if only is not None else ():
            f = self._facts_of(pid, names, gpu_pids)
            if f is not None:  # gone (or a kernel thread) while it was read: nothing to adopt
                facts.append(f)
        skip = adoption.descendants_of(clients, facts) | {os.getpid()}
        # Explicit pids (an adopt request's) are vouched for by the caller: no second look needed.
        young = set() if only is not None else {
            f.pid for f in facts if now - f.start_time < self.min_age_s
        }  # fmt: skip
        candidates = [
            f for f in facts
            if f.pid not in skip and f.pid not in young and not f.name.startswith(_OWN_PROCESSES)
        ]  # fmt: skip
        result, decisions = _decide(rules, candidates)
        gangs, adopt = gangadopt.split(_found(rules, decisions, candidates), facts, young)
        refused = [d.reason for d in decisions if not d.adopt]
        idle_rules = (
            adoption.idle_rule_messages(rules, result.unmatched, facts) if only is None else []
        )
        messages = refused + idle_rules
        new = {m for m in messages if m not in self.told}
        self.told = (self.told if only is not None else set()) | set(messages)
        outcome = Outcome(
            adopt,
            tuple(m for m in refused if m in new),
            tuple(m for m in idle_rules if m in new),
            len(young - skip),
            gangs,
        )
        if only is None:
            # With young processes about, the next scan decides again (they come of age).
            self._last = (inputs, outcome, set(messages)) if not young else None
        return outcome


def _decide(
    rules: Sequence[Rule], candidates: Sequence[ProcessFacts]
) -> tuple[adoption.Scan, list[adoption.Decision]]:
    """The config's and jobs' rules over the candidates, then the pid rules over what is left."""
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
    return result, decisions


def _found(
    rules: Sequence[Rule],
    decisions: Sequence[adoption.Decision],
    candidates: Sequence[ProcessFacts],
) -> tuple[Found, ...]:
    """The processes to adopt, each with the rule (or job) that claims it, named for a user."""
    by_pid = {f.pid: f for f in candidates}
    rule_source = {r.spec.name: f"rule {r.spec.name!r} ({r.source})" for r in rules}
    for r in rules:
        if r.spec.name == r.source:
            rule_source[r.spec.name] = r.source  # a job: "slurm job 42" says it all
    return tuple(
        Found(d, by_pid[d.pid], rule_source.get(d.rule or "", d.rule or ""))
        for d in decisions
        if d.adopt
    )


# ------------------------------------------------------------------------------ in the daemon


class Adoptions:
    """The daemon's adoption: a scan thread, the ``adopt``/``release`` requests, the registry.

    The scan runs on its own thread every ``daemon.adopt_scan_period`` (reading ``/proc`` takes
    tens of milliseconds on a busy host, which the control loop must not wait for) and takes the
    state's lock only to make clients of what it found.
    """

    def __init__(self, state: NodeState, lifecycle: Lifecycle, config_path: Path | None) -> None:
        self.s = state
        self.life = lifecycle
        self.config_path = config_path
        self.adopter = Adopter(min_age_s=state.config.daemon.adopt_min_age_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scan_lock = threading.Lock()
        self._problems: set[str] = set()  # each reported once (the process is found again)
        self._registrations_lock = threading.Lock()
        self._failed_scans = 0
        self._last_error: str | None = None
        # The processes in clients' cgroups (beside their trees), as last read; read again
        # every 30 s, and at once when a scan finds something to act on (scan_once).
        self._cgroup_pids: set[int] = set()
        self._cgroup_pids_due = 0.0

    def start(self) -> None:
        """Start scanning (after re-adoption, so that recorded clients are not adopted twice)."""
        self._thread = threading.Thread(target=self._run, name="adoption", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scanning; adopted clients stay what they are."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.s.config.daemon.adopt_scan_period_s):
            try:
                self.scan_once()
            except Exception as exc:  # the scan must not die with one odd process; say so
                self._failed_scans += 1
                self._last_error = type(exc).__name__
                log.exception("adoption_scan_failed")

    def health(self) -> tuple[bool, int, str | None]:
        """The scan thread's ``(alive, failed scans, last_error)`` (``daemon.threads``)."""
        alive = self._thread is not None and self._thread.is_alive()
        return alive, self._failed_scans, self._last_error

    def rules(self) -> list[Rule]:
        """Registered jobs first (the more specific), then the config's ``[[adopt]]`` rules."""
        rules: list[Rule] = []
        for reg in self.s.registry.registrations():
            try:
                rules += registration_rules(reg)
            except (protocol.ProtocolError, ValueError) as exc:
                log.warning("registration_unusable", source=reg.source, job=reg.job, error=str(exc))
        return rules + config_rules(self.s.config, self.config_path)

    def scan_once(self, only: Collection[int] | None = None) -> list[str]:
        """One scan: make clients of what the rules adopt, record what they refuse; the new ids."""
        s = self.s
        with self._scan_lock:
            rules = self.rules()
            with s.lock:
                live = [r for r in s.registry.clients() if r.state.is_live and r.pid is not None]
                mains = {r.pid for r in live if r.pid is not None}
                now = time.monotonic()
                if now >= self._cgroup_pids_due:
                    self._cgroup_pids, self._cgroup_pids_due = self._in_cgroups(live), now + 30.0
                samples = list(s.samples)
            self.adopter.min_age_s = s.config.daemon.adopt_min_age_s
            gpus, told = gpu_processes(samples, nvml=True), set(self.adopter.told)
            out = self.adopter.scan(
                rules, clients=mains | self._cgroup_pids, gpu_pids=gpus, only=only
            )
            if out.adopt or out.refused:
                # Something to act on: none of it may be a process that left a client's tree but
                # not its cgroup (a daemonized child). Those are listed only now, not at every
                # scan: reading every client's cgroup was a third of an idle node's scan.
                with s.lock:
                    fresh = self._in_cgroups(live)
                if not fresh <= self._cgroup_pids:
                    self._cgroup_pids = fresh
                    self.adopter.told = told  # decided again: its news are told by this scan
                    out = self.adopter.scan(rules, clients=mains | fresh, gpu_pids=gpus, only=only)
            for message in out.refused:
                s.registry.add_event("adoption_refused", message, severity="warning")
                log.warning("adoption_refused", message=message)
            for message in out.idle:
                s.registry.add_event("adopt_rule_idle", message)
            adopted = []
            with s.lock:
                for found in out.adopt:
                    client_id = self._adopt(found)
                    if client_id is not None:
                        adopted.append(client_id)
                adopted += self._adopt_gangs(out.gangs)
            return adopted

    def _adopt_gangs(self, gangs: Sequence[GangFound]) -> list[str]:
        """Each gang as one client: its parent adopted, the ranks' GPUs its gang (issue 35)."""
        out = []
        for g in gangs:
            found = gangadopt.parent_found(g, {x.uuid for x in self.s.samples if self.s.shared(x)})
            client_id = None if isinstance(found, str) else self._adopt(found)
            if isinstance(found, str) and found not in self._problems:
                self._problems.add(found)
                self.s.registry.add_event("adoption_refused", found, severity="warning")
            if client_id is not None:
                self.s.registry.update(client_id, gang=g.gang.gpus)
                out.append(client_id)
        return out

    def _in_cgroups(self, live: Sequence[ClientRecord]) -> set[int]:
        """The processes in the cgroups of the clients that have one (under the state's lock).

        A client's cgroup also holds what left its process tree (a daemonized child); a process
        group is not listed (a walk of /proc per client), and its members that matter are the
        main process's descendants, skipped anyway.
        """
        pids: set[int] = set()
        for r in live:
            if self.s.pauser.mechanism_of(r.id) is PauseMechanism.CGROUP:
                pids.update(self.s.pauser.pids(r.id))
        return pids

    def _adopt(self, found: Found) -> str | None:
        """Make a client of one found process; its id, or ``None`` with an event saying why not."""
        s, d, f = self.s, found.decision, found.facts
        assert d.cls is not None
        who = f"pid {f.pid} ({f.name}) of {f.user}"
        shared = [x for x in s.samples if s.shared(x)]
        gpu = d.gpu_uuid
        if gpu is None and len(shared) == 1:
            gpu = shared[0].uuid
        sample = next((x for x in shared if x.uuid == gpu), None)
        problem = None
        if gpu is None:
            problem = (
                f"{who} not adopted by {found.source}: it does not say which of the "
                f"{len(shared)} shared GPUs it uses; start it with the environment of "
                "`gpushare env --gpu G` (GPUSHARE_GPU_UUID, CUDA_MPS_PIPE_DIRECTORY)"
            )
        elif sample is None:
            problem = (
                f"{who} not adopted by {found.source}: GPU {gpu} is not shared by gpushare here"
            )
        identity = process_identity(f.pid)
        if problem is None and (identity is None or not is_same_process(f.pid, f.start_time)):
            problem = f"{who} exited while it was being adopted by {found.source}; nothing recorded"
        if problem is not None:
            if problem not in self._problems:
                if len(self._problems) > 10_000:
                    self._problems.clear()  # bounded: a flood of short-lived processes
                self._problems.add(problem)
                s.registry.add_event("adoption_refused", problem, severity="warning")
            return None
        assert sample is not None
        assert identity is not None
        gid, argv = identity
        rec = s.registry.add_client(
            cls=d.cls, argv=argv or [f.name], uid=f.uid, gid=gid, user=f.user, state=S.RUNNING,
            priority=s.priority(d.cls), gpu_uuid=sample.uuid, gpu_index=sample.index,
            sm_pct=d.sm_pct, mem_bytes=d.mem_bytes,
            slo_p99_ms=d.slo_p99_s * 1000 if d.slo_p99_s is not None else None, detach=True,
            adopted_by=found.source,
        )  # fmt: skip
        s.registry.update(
            rec.id, pid=f.pid, start_time=f.start_time, started_at=s.clock.time(),
            slo_ttft_p99_ms=_ms(d.slo_ttft_p99_s), slo_tpot_p99_ms=_ms(d.slo_tpot_p99_s),
        )  # fmt: skip
        try:
            route = self.life.adopt_in_place(rec.id, f.pid, f.start_time, owner_uid=f.uid)
        except PAUSE_ERRORS as exc:
            s.transition(rec.id, S.FAILED, reason=f"not adopted: it cannot be paused: {exc}")
            return None
        if route is None:
            s.transition(rec.id, S.EXITED, reason="its process exited while it was being adopted")
            return None
        s.registry.update(rec.id, pause_mechanism=route.mechanism.value)
        for note in d.notes:
            s.registry.add_event(
                "adoption_note", f"client {rec.id} (pid {f.pid}): {note}", severity="warning",
                client_id=rec.id, gpu_uuid=rec.gpu_uuid,
            )  # fmt: skip
        log.info("client_adopted", client_id=rec.id, pid=f.pid, by=found.source, route=route.reason)
        return rec.id

    # ----------------------------------------------------------------------------- requests

    def register(
        self, caller_uid: int, params: dict[str, Any], *, privileged: bool = False
    ) -> dict[str, Any]:
        """``adopt``: keep a job's registration and adopt its explicit pids at once.

        A registration belongs to the uid that made it: another uid may not replace it, unless
        it is root or in the admin group (``privileged``).

        Raises:
            ProtocolError: bad parameters (``INVALID_PARAMS``), a caller registering another
                user's job without being root, or replacing another uid's registration without
                being root or an admin (``PERMISSION_DENIED``); nothing is changed.
        """
        req = protocol.from_params(protocol.AdoptRequest, params)
        try:
            _cls, denied = check_adopt(req, caller_uid)
        except ValueError as exc:
            raise protocol.ProtocolError(protocol.ErrorCode.INVALID_PARAMS, str(exc)) from None
        if denied is not None:
            raise protocol.ProtocolError(protocol.ErrorCode.PERMISSION_DENIED, denied)
        if req.gpu is not None:
            raise protocol.ProtocolError(
                protocol.ErrorCode.INVALID_PARAMS,
                "gpu: each process's GPU comes from its environment (GPUSHARE_GPU_UUID, which "
                "`gpushare env` and the Slurm TaskProlog set); leave gpu out",
            )
        with self._registrations_lock:  # the owner check and the write as one step
            self._check_owner(req.source, req.job, caller_uid, privileged, "replace")
            self.s.registry.register(req.source, req.job, caller_uid, protocol.as_dict(req))
        self.s.registry.add_event(
            "job_registered",
            f"{req.source} job {req.job} registered by uid {caller_uid}: processes of uid "
            f"{req.uid} with {req.match_env or req.pids} become {req.cls} clients",
        )
        adopted = self.scan_once(only=req.pids) if req.pids else []
        return {"source": req.source, "job": req.job, "adopted": adopted}

    def _check_owner(
        self, source: str, job: str, caller_uid: int, privileged: bool, what: str
    ) -> list[Registration]:
        """The registrations of ``source``/``job``; refuses a caller that is not their owner.

        Without a registration, the job's leftover clients belong to root (and the admin group).
        """
        regs = [r for r in self.s.registry.registrations() if (r.source, r.job) == (source, job)]
        owner = regs[0].owner_uid if regs else 0
        if privileged or caller_uid in (0, owner) or (not regs and what == "replace"):
            return regs
        raise protocol.ProtocolError(
            protocol.ErrorCode.PERMISSION_DENIED,
            f"uid {caller_uid} may not {what} {source} job {job}: uid {owner} registered it; "
            "only that uid, root or members of daemon.admin_group may",
        )

    def release(
        self, caller_uid: int, params: dict[str, Any], *, privileged: bool = False
    ) -> dict[str, Any]:
        """``release``: drop a job's registration and end its clients (thawed, not killed).

        Raises:
            ProtocolError: a caller that is neither the one who registered the job, nor root, nor
                in the admin group (``privileged``).
        """
        req = protocol.from_params(protocol.ReleaseRequest, params)
        s = self.s
        name = f"{req.source} job {req.job}"
        with self._registrations_lock:
            regs = self._check_owner(req.source, req.job, caller_uid, privileged, "release")
            s.registry.unregister(req.source, req.job)
        released = []
        with s.lock:
            for rec in s.registry.clients():
                if rec.adopted_by == name and rec.state.is_live:
                    self.life.release_adopted(rec.id, f"released: {name} ended")
                    released.append(rec.id)
        if regs or released:
            s.registry.add_event(
                "job_released",
                f"{name} released"
                + (f": client(s) {', '.join(released)} ended" if released else ": no clients"),
            )
        return {"source": req.source, "job": req.job, "released": released}


def _ms(seconds: float | None) -> float | None:
    return seconds * 1000 if seconds is not None else None
