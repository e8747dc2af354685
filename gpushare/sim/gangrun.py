"""Run a sharing policy on a node with gangs: DDP jobs and TP servers across GPUs (issue 35).

A :class:`GangScenario` is a one-GPU :class:`~gpushare.sim.scenario.Scenario` (its online
services, each on one GPU) plus DDP jobs and TP servers from :mod:`gpushare.sim.gang`. The run is
the daemon's own loop on the simulated node, as in :mod:`gpushare.sim.runner`: every rank of a DDP
job is an offline client queued for its own GPU, and every shard of a TP server an online client
of its GPU that reports the server's request latencies and boundaries (so the daemon's gate on
that GPU closes while a TP request is in flight). The daemon itself knows nothing of gangs unless
the policy does (:class:`gpushare.control.gang.GangDuty`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpushare.control.policy import Policy
from gpushare.sim import data
from gpushare.sim.arrivals import poisson_arrivals
from gpushare.sim.gang import (
    DdpGang,
    DdpSpec,
    TpServer,
    TpSpec,
    make_ranks,
    make_shards,
    tp_alone_s,
)
from gpushare.sim.gating import BoundarySender
from gpushare.sim.node import PolicyTraits, SimNode, launch_costs
from gpushare.sim.runner import SimDaemon, _fewer_collections
from gpushare.sim.scenario import Scenario
from gpushare.sim.scenario import loads as scenario_loads
from gpushare.sim.workloads import OnlineServer
from gpushare.stats import percentile


@dataclass(frozen=True, slots=True)
class GangScenario:
    """A node with one-GPU online services (``base``), DDP jobs and TP servers."""

    name: str
    base: Scenario
    ddp: tuple[DdpSpec, ...] = ()
    tp: tuple[TpSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class ServiceResult:
    """One online service (a one-GPU server or a whole TP server) over the measured window."""

    name: str
    gpus: tuple[int, ...]
    requests: int
    p99_ms: float
    slo_p99_ms: float
    slo_attainment: float


@dataclass(frozen=True, slots=True)
class GangResult:
    """One DDP job: its iterations per second, against the job alone on idle GPUs."""

    name: str
    gpus: tuple[int, ...]
    iter_per_s: float
    alone_iter_per_s: float

    @property
    def norm(self) -> float:
        """Throughput as a fraction of the job alone."""
        return self.iter_per_s / self.alone_iter_per_s if self.alone_iter_per_s else math.nan


@dataclass(frozen=True, slots=True)
class GangRun:
    """What one policy got on one gang scenario."""

    scenario: str
    policy: str
    services: tuple[ServiceResult, ...]
    gangs: tuple[GangResult, ...]
    #: Each GPU's mean offline duty over the measured window (1: never duty-cycled).
    duty_mean: tuple[float, ...] = ()
    #: Per rank of each DDP job (in order), the share of its life the daemon kept it thawed
    #: (its gate open and its duty on): what its GPU's online service left to offline work.
    thawed: tuple[tuple[float, ...], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with each gang's normalised throughput)."""
        d = dataclasses.asdict(self)
        for g, gd in zip(self.gangs, d["gangs"], strict=True):
            gd["norm"] = g.norm
        return d


class GangNode:
    """A :class:`SimNode` with the scenario's gangs added: ranks offline, shards online."""

    def __init__(self, sc: GangScenario, *, traits: PolicyTraits, with_offline: bool) -> None:
        self.sc = sc
        base = sc.base
        self.node = node = SimNode(base, traits=traits, with_offline=False)
        g = base.gpu
        self.gangs: list[tuple[DdpSpec, DdpGang]] = []
        self.servers: list[tuple[TpSpec, TpServer]] = []
        for k, tp in enumerate(sc.tp):
            prof = data.load_profile(tp.profile, g.merge_online_us, g.sm_count)
            rps = tp.load / tp_alone_s(prof, tp)
            arrivals = poisson_arrivals(rps, base.seed * 1000 + 500 + k, base.duration_s)
            server, shards = make_shards(tp, node.gpus, prof, arrivals, _pids(node))
            node.online.extend(shards)
            self.servers.append((tp, server))
        if not with_offline:
            return
        for ddp in sc.ddp:
            prof = data.load_profile(ddp.profile, g.merge_offline_us, g.sm_count)
            gang, ranks = make_ranks(
                ddp, node.gpus, prof, base.config.control.offline_sm_pct_default
            )
            for r in ranks:
                r.priority = traits.offline_priority
                launch_costs(r, g)
                node.offline.append(r)
                node.submit_at[r.cid] = ddp.submit_s
                node.queue_mode[r.cid] = "auto"
            self.gangs.append((ddp, gang))

    def tp_of(self, server: OnlineServer) -> TpServer | None:
        """The TP server a shard belongs to."""
        return next((s for _, s in self.servers if server in s.shards), None)


def _pids(node: SimNode) -> Iterator[int]:
    while True:
        yield node.next_pid()


def run_gang_policy(
    sc: GangScenario,
    policy: Policy[Any] | None,
    *,
    name: str,
    slo_ms: dict[str, float] | None = None,
    with_offline: bool = True,
    boundaries: bool = True,
) -> tuple[GangRun, GangNode]:
    """Run ``policy`` (None: no daemon, the services alone) on the gang scenario.

    ``boundaries=False``: no service tells the daemon of its requests (no request gating).
    """
    if not boundaries:
        online = tuple(dataclasses.replace(o, request_boundaries=False) for o in sc.base.online)
        sc = dataclasses.replace(sc, base=dataclasses.replace(sc.base, online=online))
    with _fewer_collections():
        traits = PolicyTraits.of(policy) if policy is not None else PolicyTraits()
        gn = GangNode(sc, traits=traits, with_offline=with_offline)
        node = gn.node
        for c in node.online:
            key = _service_of(gn, c)
            if slo_ms and key in slo_ms:
                c.slo_p99_ms = slo_ms[key]
        node.start()
        end = sc.base.duration_s
        duty: dict[str, list[tuple[float, float]]] = {}
        thawed: tuple[tuple[float, ...], ...] = ()
        if policy is None:
            period = node.cfg.control.period_s
            t = 0.0
            while t < end:
                t = min(end, t + period)
                node.loop.run_until(t)
        else:
            sim = SimDaemon(node, policy)
            tell_spans(sim, gn)
            # TP shards tell the daemon of their requests as one-GPU services do.
            for _, server in gn.servers if boundaries else ():
                for shard in server.shards:
                    shard.on_boundary = BoundarySender(sim.gates.send, shard).boundary
            sim.run(end)
            thawed = tuple(_thawed(sim, gang) for _, gang in gn.gangs)
            sim.close()
            duty = sim.duty_series
        run = _results(gn, name, slo_ms or {})
        warm = sc.base.warmup_s
        means = []
        for gpu in node.gpus:
            ds = [d for t, d in duty.get(gpu.uuid, []) if t >= warm]
            means.append(sum(ds) / len(ds) if ds else 1.0)
        return dataclasses.replace(run, duty_mean=tuple(means), thawed=thawed), gn


def tell_spans(sim: SimDaemon, gn: GangNode) -> None:
    """Tell the daemon's views how many GPUs each rank's and shard's gang spans.

    The daemon sees each rank and shard as a one-GPU client; its views then carry what a gang
    record would (``ClientView.gang_gpus``), so the controller's rules for gangs apply. Call it
    before the first tick: a view is made anew only when its record changes.
    """
    spans = sim.loop.views.spans
    for _, gang in gn.gangs:
        spans.update(dict.fromkeys((r.cid for r in gang.ranks), len(gang.ranks)))
    for _, server in gn.servers:
        spans.update(dict.fromkeys((s.cid for s in server.shards), len(server.shards)))


def _thawed(sim: SimDaemon, gang: DdpGang) -> tuple[float, ...]:
    now = sim.node.loop.now
    out = []
    for r in gang.ranks:
        total = sim.state.ops.thaw.total_s(r.cid, now)
        life = now - r.started_at_s if r.started_at_s is not None else 0.0
        # The thaw log counts from the launch, the life from the process's start: clamp at 1.
        out.append(min(1.0, total / life) if total is not None and life > 0 else math.nan)
    return tuple(out)


def _service_of(gn: GangNode, c: OnlineServer) -> str:
    server = gn.tp_of(c)
    return server.name if server is not None else c.cid


def _results(gn: GangNode, policy: str, slo_ms: dict[str, float]) -> GangRun:
    sc = gn.sc
    warm, end = sc.base.warmup_s, sc.base.duration_s
    services: list[ServiceResult] = []
    seen: set[str] = set()
    for c in gn.node.online:
        key = _service_of(gn, c)
        if key in seen:
            continue
        seen.add(key)
        server = gn.tp_of(c)
        gpus = tuple(s.gpu.index for s in server.shards) if server else (c.gpu.index,)
        lats = [lat * 1e3 for arr, lat in c.completed if arr >= warm]
        slo = slo_ms.get(key, math.inf)
        att = sum(1 for x in lats if x <= slo) / len(lats) if lats else math.nan
        services.append(ServiceResult(key, gpus, len(lats), percentile(lats, 99.0), slo, att))
    gangs = []
    for spec, gang in gn.gangs:
        its = [t for t in gang.iterations if t >= warm]
        alone = 1.0 / (gang.ranks[0].profile.total_s + spec.allreduce_s)
        gangs.append(GangResult(spec.name, spec.gpus, len(its) / (end - warm), alone))
    return GangRun(sc.name, policy, tuple(services), tuple(gangs))


def slos(sc: GangScenario, factor: float) -> tuple[GangRun, dict[str, float]]:
    """The services alone, and each one's SLO: ``factor`` x its p99 alone."""
    alone, _ = run_gang_policy(sc, None, name="alone", with_offline=False)
    return alone, {s.name: factor * s.p99_ms for s in alone.services}


def base_scenario(
    name: str,
    gpus: int,
    online: tuple[tuple[str, str, int, float], ...],
    *,
    duration_s: float = 10.0,
    warmup_s: float = 2.0,
    seed: int = 1,
) -> Scenario:
    """A node of ``gpus`` GPUs with one-GPU online services ``(name, profile, gpu, load)``.

    Built through the scenario parser, so every default (the config, the GPU model) is the
    shipped scenarios'. A node whose online services are all TP servers passes ``online=()``.
    """
    lines = [
        "[scenario]",
        f'name = "{name}"',
        f'duration = "{duration_s:g}s"',
        f'warmup = "{warmup_s:g}s"',
        f"seed = {seed}",
        "[gpu]",
        f"count = {gpus}",
    ]
    for svc, profile, gpu, load in online or (
        ("placeholder", "orion-v100-kernels/bert_2_fwd.csv", 0, 0.5),
    ):
        lines += ["[[online]]", f'name = "{svc}"', f'profile = "{profile}"', f"gpu = {gpu}"]
        lines += [f"load = {load:g}", 'mem = "2GiB"']
    sc = scenario_loads("\n".join(lines) + "\n", f"<gang scenario {name}>")
    return sc if online else dataclasses.replace(sc, online=())
