"""Adoption: which running processes become clients, decided from rules and process facts.

Pure (no I/O, no clock): the facts of a process (:class:`ProcessFacts`, read by
:func:`gpushare.node.procs.facts.process_facts`) and the rules (``[[adopt]]`` in the config, or a
request from a scheduler's prolog) go in; a :class:`Decision` per process comes out, and
:func:`scan` folds the descendants of an adopted process into it and names the rules that matched
nothing.

Rights: a rule may adopt a process of its own owner, or one whose owner asked for that class in its
environment (``GPUSHARE_CLASS``); a rule from root (root's config file, a root prolog) may adopt
anyone's process into any class. A process that runs with rights its user lacks (setuid or setgid:
:attr:`ProcessFacts.setuid`) is adopted by root's rules only. Anything else is refused with a reason
that says so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from gpushare.config import AdoptRule
from gpushare.control.pods import ENV_CLIENT_SCOPE, POD_SCOPE, pod_cgroup
from gpushare.model import ClientClass, ProcessFacts
from gpushare.mpsenv import (
    ENV_CLASS,
    ENV_GPU_UUID,
    ENV_SLO_P99,
    ENV_SLO_TPOT_P99,
    ENV_SLO_TTFT_P99,
    check_limits,
    slo_problem,
)
from gpushare.units import format_duration, format_size, parse_duration, parse_size

ENV_SM = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MEM = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
FACT_ENV: tuple[str, ...] = (
    ENV_CLASS, ENV_SLO_P99, ENV_GPU_UUID, ENV_SM, ENV_MEM, ENV_PIPE, ENV_CLIENT_SCOPE,
    ENV_SLO_TTFT_P99, ENV_SLO_TPOT_P99,
)  # fmt: skip
"""The environment variables adoption always reads; rules' ``env`` conditions add their own.

Only these are kept from ``/proc/<pid>/environ``: the rest of a process's environment may hold
secrets and is none of gpushare's business."""


@dataclass(frozen=True, slots=True)
class Rule:
    """An adoption rule and who stands behind it."""

    spec: AdoptRule
    owner_uid: int
    """0: root's config or a root request, which may adopt anyone's processes."""
    source: str
    """Where it came from, for messages: a config file, ``slurm job 42``."""


@dataclass(frozen=True, slots=True)
class Marker:
    """The class a process declares in its environment, or why the declaration is unusable."""

    cls: ClientClass | None
    slo_p99_s: float | None
    error: str | None
    slo_ttft_p99_s: float | None = None
    slo_tpot_p99_s: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one process: adopt it as a client (with what), or why not."""

    pid: int
    adopt: bool
    rule: str | None
    reason: str
    cls: ClientClass | None = None
    slo_p99_s: float | None = None
    sm_pct: float | None = None
    mem_bytes: int | None = None
    gpu_uuid: str | None = None
    notes: tuple[str, ...] = ()
    slo_ttft_p99_s: float | None = None
    slo_tpot_p99_s: float | None = None


@dataclass(frozen=True, slots=True)
class Scan:
    """Decisions for one pass over the host's processes."""

    decisions: tuple[Decision, ...]
    """One per process a rule matched, descendants of an adopted process excluded."""
    members: Mapping[int, int]
    """Every adopted pid (roots and folded descendants) to the root pid of its client."""
    unmatched: tuple[str, ...]
    """A message for each rule that decided no process."""


def read_marker(environ: Mapping[str, str] | None) -> Marker | None:
    """The ``GPUSHARE_CLASS``/``GPUSHARE_SLO_P99`` declaration; ``None`` when there is none."""
    if environ is None or ENV_CLASS not in environ:
        return None
    raw = environ[ENV_CLASS]
    try:
        cls = ClientClass(raw.strip().lower())
    except ValueError:
        return Marker(None, None, f"{ENV_CLASS}={raw!r} is not a class: use online or offline")
    slo_raw = environ.get(ENV_SLO_P99)
    slo = None
    if slo_raw is not None and slo_raw.strip():
        try:
            slo = parse_duration(slo_raw)
            check_limits(cls, None, None, slo)
        except ValueError as exc:
            return Marker(cls, None, f"{ENV_SLO_P99}={slo_raw!r}: {exc}")
    tokens: list[float | None] = []
    for name, flag in ((ENV_SLO_TTFT_P99, "--slo-ttft-p99"), (ENV_SLO_TPOT_P99, "--slo-tpot-p99")):
        raw = environ.get(name, "").strip()
        try:
            value = parse_duration(raw) if raw else None
        except ValueError as exc:
            return Marker(cls, None, f"{name}={raw!r}: {exc}")
        if value is not None and (problem := slo_problem(flag, cls, value)) is not None:
            return Marker(cls, None, f"{name}={raw!r}: {problem}")
        tokens.append(value)
    return Marker(cls, slo, None, slo_ttft_p99_s=tokens[0], slo_tpot_p99_s=tokens[1])


def matches(spec: AdoptRule, facts: ProcessFacts) -> bool:
    """Whether every condition the rule gives holds for the process."""
    env = facts.environ
    if spec.marker and (env is None or ENV_CLASS not in env):
        return False
    if spec.unit and (facts.unit is None or not fnmatch.fnmatchcase(facts.unit, spec.unit)):
        return False
    if spec.cgroup and (facts.cgroup is None or not fnmatch.fnmatchcase(facts.cgroup, spec.cgroup)):
        return False
    if spec.user and spec.user not in (facts.user, str(facts.uid)):
        return False
    if spec.uses_gpu and not facts.gpu_uuids:
        return False
    return not spec.env or (
        env is not None
        and all(k in env and fnmatch.fnmatchcase(env[k], v) for k, v in spec.env.items())
    )


def decide(rules: Sequence[Rule], facts: ProcessFacts) -> Decision:
    """The first matching rule's decision for one process (refusals included)."""
    for rule in rules:
        if matches(rule.spec, facts):
            return _decision(rule, facts)
    return Decision(facts.pid, adopt=False, rule=None, reason="no rule matches")


def scan(rules: Sequence[Rule], processes: Sequence[ProcessFacts]) -> Scan:
    """Decide every process, fold descendants of adopted ones into them, report idle rules.

    A process forked by an adopted one (a data loader, a worker) is part of that client: its
    pid maps to the ancestor's in :attr:`Scan.members` and it gets no decision of its own. So is
    an adopted process of a pod whose first adopted process asked for pod scope
    (:func:`pod_key`): the containers of one pod are one client.
    """
    by_pid = {p.pid: p for p in processes}
    raw = {p.pid: decide(rules, p) for p in processes}
    members: dict[int, int] = {}
    decisions: list[Decision] = []
    pod_roots: dict[str, int] = {}
    for p in processes:
        root = _adopted_ancestor(p, by_pid, raw)
        pod = pod_key(p) if raw[p.pid].adopt else None
        if root is None and pod is not None:
            root = pod_roots.get(pod)
        if root is not None:
            members[p.pid] = root
            continue
        d = raw[p.pid]
        if d.rule is None:
            continue
        decisions.append(d)
        if d.adopt:
            members[p.pid] = p.pid
            if pod is not None:
                pod_roots[pod] = p.pid
    # A descendant of a process folded into its pod's client belongs to that client too.
    members = {pid: members.get(root, root) for pid, root in members.items()}
    deciding = {d.rule for d in raw.values()}
    gpu_known = any(p.gpu_uuids is not None for p in processes)
    unmatched = tuple(_unmatched(r, gpu_known) for r in rules if r.spec.name not in deciding)
    return Scan(tuple(decisions), members, unmatched)


def pod_key(facts: ProcessFacts) -> str | None:
    """The pod cgroup a process is a client with, when it asks for pod scope and is in a pod.

    ``GPUSHARE_CLIENT_SCOPE=pod`` (the device plugin sets it) in a container's cgroup directly
    inside a pod's: every adopted process of that pod folds into one client, frozen through the
    pod's cgroup (:func:`gpushare.node.cgroups.route.freeze_route`).
    """
    env = facts.environ or {}
    if env.get(ENV_CLIENT_SCOPE) != POD_SCOPE or facts.cgroup is None:
        return None
    return pod_cgroup(facts.cgroup)


def _adopted_ancestor(
    p: ProcessFacts, by_pid: Mapping[int, ProcessFacts], raw: Mapping[int, Decision]
) -> int | None:
    found = None
    seen = {p.pid}
    parent = by_pid.get(p.ppid)
    while parent is not None and parent.pid not in seen:
        seen.add(parent.pid)
        if raw[parent.pid].adopt:
            found = parent.pid  # keep climbing: the topmost adopted ancestor is the client
        parent = by_pid.get(parent.ppid)
    return found


def _unmatched(rule: Rule, gpu_known: bool) -> str:
    s = rule.spec
    conds = [
        f"{k} {v!r}" for k, v in (("unit", s.unit), ("cgroup", s.cgroup), ("user", s.user)) if v
    ]
    conds += ["marker"] * s.marker + ["uses_gpu"] * s.uses_gpu
    conds += [f"env {k}={v!r}" for k, v in s.env.items()]
    text = f"rule {s.name!r} ({rule.source}) matches no process: " + ", ".join(conds)
    if s.uses_gpu and not gpu_known:
        text += "; NVML is not available here, so uses_gpu never holds"
    return text


def _who(facts: ProcessFacts) -> str:
    return f"pid {facts.pid} ({facts.name}) of {facts.user}"


def _decision(rule: Rule, facts: ProcessFacts) -> Decision:
    spec = rule.spec
    marker = read_marker(facts.environ)
    notes: list[str] = []
    if spec.cls == "marker":
        if marker is None or marker.cls is None:
            why = marker.error if marker is not None else f"no {ENV_CLASS} in its environment"
            return Decision(facts.pid, adopt=False, rule=spec.name,
                            reason=f"{_who(facts)} not adopted: {why}")  # fmt: skip
        if marker.error:
            return Decision(facts.pid, adopt=False, rule=spec.name,
                            reason=f"{_who(facts)} not adopted: {marker.error}")  # fmt: skip
        cls = marker.cls
    else:
        cls = ClientClass(spec.cls)
        if marker is not None and marker.error:
            notes.append(f"{marker.error} (ignored: rule {spec.name!r} gives the class)")
    asked = marker is not None and marker.cls is cls
    if facts.setuid and rule.owner_uid != 0:
        return Decision(
            facts.pid, adopt=False, rule=spec.name,
            reason=f"{_who(facts)} not adopted by rule {spec.name!r} ({rule.source}, uid "
            f"{rule.owner_uid}): it runs with rights its user lacks (setuid); only root's rules "
            "adopt such processes",
        )  # fmt: skip
    if facts.uid != rule.owner_uid and rule.owner_uid != 0 and not asked:
        declared = f"{ENV_CLASS}={marker.cls.value}" if marker and marker.cls else f"no {ENV_CLASS}"
        return Decision(
            facts.pid, adopt=False, rule=spec.name,
            reason=f"rule {spec.name!r} ({rule.source}, uid {rule.owner_uid}) would adopt "
            f"{_who(facts)} as {cls.value}, which its owner did not ask for ({declared} in its "
            "environment); only a rule in root's config may do that",
        )  # fmt: skip
    if marker is not None and marker.cls is not None and marker.cls is not cls:
        notes.append(
            f"its owner asked for {marker.cls.value} ({ENV_CLASS}); rule {spec.name!r} "
            f"({rule.source}) makes it {cls.value}"
        )
    slo = spec.slo_p99_s
    ttft, tpot = spec.slo_ttft_p99_s, spec.slo_tpot_p99_s
    if cls is ClientClass.ONLINE and marker is not None:
        slo = slo if slo is not None else marker.slo_p99_s
        ttft = ttft if ttft is not None else marker.slo_ttft_p99_s
        tpot = tpot if tpot is not None else marker.slo_tpot_p99_s
    sm, mem, gpu = _running_limits(facts, notes)
    if spec.sm_pct is not None and sm is not None and sm != spec.sm_pct:
        notes.append(
            f"runs with SM share {sm:g}%, rule {spec.name!r} expects {spec.sm_pct:g}% (MPS fixes it "
            "at start: restart it with the environment `gpushare env` prints)"
        )
    if spec.mem_bytes is not None and mem != spec.mem_bytes:
        have = format_size(mem) if mem is not None else "no"
        notes.append(
            f"runs with {have} pinned-memory limit, rule {spec.name!r} expects "
            f"{format_size(spec.mem_bytes)} (restart it with `gpushare env --mem ...`)"
        )
    if gpu is None and facts.gpu_uuids is not None and len(facts.gpu_uuids) == 1:
        gpu = facts.gpu_uuids[0]
    what = f"{cls.value}" + (f", SLO p99 {format_duration(slo)}" if slo is not None else "")
    return Decision(
        facts.pid, adopt=True, rule=spec.name, reason=f"rule {spec.name!r} ({rule.source}): {what}",
        cls=cls, slo_p99_s=slo, sm_pct=sm if sm is not None else spec.sm_pct,
        mem_bytes=mem if mem is not None else spec.mem_bytes, gpu_uuid=gpu, notes=tuple(notes),
        slo_ttft_p99_s=ttft if cls is ClientClass.ONLINE else None,
        slo_tpot_p99_s=tpot if cls is ClientClass.ONLINE else None,
    )  # fmt: skip


def _running_limits(
    facts: ProcessFacts, notes: list[str]
) -> tuple[float | None, int | None, str | None]:
    """SM share, memory cap and GPU the process was started with (its MPS environment)."""
    env = facts.environ or {}
    gpu = env.get(ENV_GPU_UUID) or None
    pipe = env.get(ENV_PIPE)
    if pipe is None:
        notes.append(
            f"started without {ENV_PIPE}: MPS does not limit it; start it with the environment "
            "`gpushare env` prints"
        )
        return None, None, gpu
    if gpu is None and PurePosixPath(pipe).name.startswith(("GPU-", "MIG-")):
        gpu = PurePosixPath(pipe).name
    sm = None
    if ENV_SM in env:
        try:
            sm = float(env[ENV_SM])
            check_limits(ClientClass.OFFLINE, sm, None, None)
        except ValueError:
            notes.append(f"{ENV_SM}={env[ENV_SM]!r} is not a percentage in (0, 100]")
            sm = None
    return sm, _pinned_limit(env.get(ENV_MEM), gpu, notes), gpu


def _pinned_limit(text: str | None, gpu: str | None, notes: list[str]) -> int | None:
    # "<uuid or ordinal>=<size>[,...]"; inside an MPS client its GPU is ordinal 0.
    if not text:
        return None
    found: dict[str, int] = {}
    for item in text.split(","):
        dev, _, size = item.strip().partition("=")
        try:
            found[dev.strip()] = parse_size(size.strip())
        except ValueError:
            notes.append(f"{ENV_MEM}={text!r} is not <device>=<size>[,...]")
            return None
    for key in (gpu, "0"):
        if key is not None and key in found:
            return found[key]
    return next(iter(found.values())) if len(found) == 1 else None


def idle_rule_messages(
    rules: Sequence[Rule], unmatched: Sequence[str], facts: Sequence[ProcessFacts]
) -> list[str]:
    """The messages of config rules that match no process (a full scan's)."""
    # A job whose processes have not started yet matches nothing: only config rules that match
    # nothing are worth a message. A rule whose processes are clients already (or too young
    # yet) is not idle.
    idle = {
        r.spec.name for r in rules
        if r.spec.name != r.source and not any(matches(r.spec, f) for f in facts)
    }  # fmt: skip
    idle_rules = [m for m in unmatched if any(f"rule {n!r} " in m for n in idle)]
    hidden = sum(1 for f in facts if f.environ is None)
    if not hidden:
        return idle_rules
    # marker and env conditions never hold on an environment the daemon cannot read.
    env_rules = {r.spec.name for r in rules if r.spec.marker or r.spec.env}
    return [
        m + f"; the environment of {hidden} process(es) of other users cannot be read "
        "(run the daemon as root)"
        if any(f"rule {n!r} " in m for n in env_rules) else m
        for m in idle_rules
    ]  # fmt: skip


def descendants_of(roots: Collection[int], facts: Sequence[ProcessFacts]) -> set[int]:
    """The processes among ``facts`` descended from any of ``roots`` (by their parent pids)."""
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
