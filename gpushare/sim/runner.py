"""Run one sharing policy on one scenario in virtual time, with the daemon's own control loop.

There is one implementation of the runner contract (docs/controller.md): the daemon's
:class:`~gpushare.daemon.loop.ControlLoop` and :class:`~gpushare.daemon.lifecycle.Lifecycle`, over
its registry (in memory here). :func:`run_policy` wires them to the simulated node's adapters
(:mod:`gpushare.sim.adapters`) and a virtual clock, registers the scenario's online services as
running foreground clients and its offline jobs as queued ones when they are submitted, and ticks
the loop every control period; waiting for the next tick (and for the duty edges within it)
advances the simulation. :func:`run_scenario` adds the standalone reference (online alone) that
overheads and normalised throughputs are measured against.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gpushare import native
from gpushare.control.policy import Policy
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.loop import ControlLoop
from gpushare.daemon.registry import Registry
from gpushare.daemon.state import NodeState
from gpushare.model import ClientClass, ClientState
from gpushare.sim import adapters, llm_node
from gpushare.sim.gating import BoundarySender, GateDriver
from gpushare.sim.inflight_switch import SimBoundWriter
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.results import RunResult, ScenarioResult, collect
from gpushare.sim.scenario import OnlineSpec, Scenario
from gpushare.sim.workloads import SimClient

__all__ = ["RunResult", "ScenarioResult", "run_policy", "run_scenario", "slo_of", "standalone"]

ProgressFn = Callable[[float], None]
#: The user every simulated client runs as (one user: MPS needs no multi-user server).
SIM_UID = 1000
#: Where the simulated MPS pipe directories are said to be (nothing is created there).
SIM_RUNTIME_DIR = Path("/nonexistent/gpushare-sim")
#: Allocations between two collections of the youngest generation during a run (default 700).
GC_YOUNG_THRESHOLD = 20_000


class SimDaemon:
    """The daemon's state, lifecycle and control loop on a simulated node, in virtual time."""

    def __init__(self, node: SimNode, policy: Policy[Any] | None) -> None:
        self.node = node
        clock = adapters.VirtualClock(node.loop)
        self.state = NodeState(
            node.cfg,
            registry=Registry.in_memory(clock=clock.time),
            gpu=adapters.SimGpuBackend(node),
            mps=adapters.SimMpsNode(node, SIM_RUNTIME_DIR),
            pauser=adapters.SimPauser(node),
            probe=adapters.SimLatencyProbe(node),
            policy=policy,
            clock=clock,
            procs=adapters.SimProcesses(node),
            # The simulated clients take the bound from its variables; no file is opened.
            shallow_library=str(native.library_path()),
        )
        # Issue 32: live --queue auto clients follow the daemon's bound in virtual time.
        node.inflight_switch = SimBoundWriter(node)
        self.state.bound_writer = node.inflight_switch
        self.lifecycle = Lifecycle(self.state)
        self.loop = ControlLoop(
            self.state, self.lifecycle, notify=lambda *_: True, metrics=None, reload=lambda: False
        )
        self.lifecycle.start_watching()
        self._reported: dict[str, int] = {}
        self._submitted: set[str] = set()
        #: Each GPU's offline duty after every tick.
        self.duty_series: dict[str, list[tuple[float, float]]] = {g.uuid: [] for g in node.gpus}
        #: Request gating: the services' boundaries reach the daemon's own Gatekeeper.
        self.gates = GateDriver(self.state.gate, node.loop)
        boundaries = {o.name for o in node.scenario.online if o.request_boundaries}
        for server in node.online:
            self.add_online(server)
            if server.cid in boundaries:
                server.on_boundary = BoundarySender(self.gates.send, server).boundary
        for srv in node.llm:
            self.add_online(srv)
            llm_node.register(self.state.registry, srv)

    def add_online(self, server: SimClient) -> None:
        """Register a running online service as a foreground client (it started at t = 0)."""
        s = self.state
        rec = s.registry.add_client(
            client_id=server.cid, cls=ClientClass.ONLINE, argv=[server.cid], uid=SIM_UID,
            gid=SIM_UID, user="sim", state=ClientState.STARTING, priority=s.priority(server.cls),
            gpu_request=server.gpu.uuid, gpu_uuid=server.gpu.uuid, gpu_index=server.gpu.index,
            sm_pct=server.sm_pct, mem_bytes=server.mem_bytes, slo_p99_ms=server.slo_p99_ms,
            pause_mechanism=s.pauser.mechanism.value, now=s.clock.time(),
        )  # fmt: skip
        if server.state.is_live:
            self.lifecycle.adopt_foreground(rec.id, server.pid, None, owner_uid=SIM_UID)
        else:  # its memory could not be allocated: it never ran
            s.registry.transition(rec.id, ClientState.FAILED, reason=server.fail_reason)

    def submit_due(self, now: float) -> None:
        """Queue the offline jobs whose submit time has come (as a batch scheduler would)."""
        s = self.state
        for job in self.node.offline:
            if job.cid in self._submitted or self.node.submit_at.get(job.cid, now + 1) > now:
                continue
            self._submitted.add(job.cid)
            # The user's --mem is the pinned-memory limit when the scenario sets one, else what
            # the job allocates.
            mem = job.pinned_mem_bytes if job.pinned_mem_bytes is not None else job.mem_bytes
            s.registry.add_client(
                client_id=job.cid, cls=ClientClass.OFFLINE, argv=[job.cid], uid=SIM_UID,
                gid=SIM_UID, user="sim", state=ClientState.QUEUED,
                priority=s.priority(ClientClass.OFFLINE), gpu_request=job.gpu.uuid,
                mem_bytes=mem, restartable=job.restartable, detach=True, cwd="/",
                pause_mechanism=s.pauser.mechanism.value, now=s.clock.time(),
            )  # fmt: skip
            s.registry.update(job.cid, queue=self.node.queue_mode.get(job.cid))
            spec = next((o for o in self.node.scenario.offline if o.name == job.cid), None)
            if spec is not None and spec.restart_cost_s is not None:  # issue 32
                s.registry.update(job.cid, restart_cost_s=spec.restart_cost_s)

    def report_latencies(self) -> None:
        """Hand the services' completed requests to the daemon, as ``report_latency`` would."""
        tracker = self.state.latency.tracker
        for server in self.node.online:
            done = server.completed
            start = self._reported.get(server.cid, 0)
            if start < len(done):
                reports = [(arrival + latency, latency) for arrival, latency in done[start:]]
                tracker.add_many(server.cid, reports)
                self._reported[server.cid] = len(done)
        llm_node.report_tokens(self.state.latency.tokens, self.node.llm)

    def run(self, end_s: float, before_tick: ProgressFn | None = None) -> None:
        """Tick the daemon's loop every control period from now until ``end_s`` (virtual)."""
        node = self.node
        period = node.cfg.control.period_s
        t = node.loop.now
        ticks = round(t / period)
        while t < end_s - 1e-12:
            # On the tick grid itself: a sum of periods would drift.
            t_next = min(end_s, (ticks + 1) * period)
            self.submit_due(t)
            self.report_latencies()
            if before_tick is not None:
                before_tick(t)
            self.loop.tick()
            for gpu in node.gpus:
                self.duty_series[gpu.uuid].append((t, self.state.duty.get(gpu.uuid, 1.0)))
            self.loop.wait_until(t_next)
            t = t_next
            ticks += 1

    def ended(self) -> dict[str, tuple[str, str | None]]:
        """Each registered client's final state and reason as the registry has them."""
        recs = self.state.registry.clients(include_final=True)
        return {r.id: (r.state.value, r.reason) for r in recs}

    def close(self) -> None:
        """Stop the exit reports and close the registry."""
        self.lifecycle.stop_watching()
        self.state.registry.close()


def run_policy(
    scenario: Scenario,
    policy: Policy[Any] | None,
    *,
    name: str | None = None,
    with_offline: bool = True,
    with_online: bool = True,
    slo_ms: dict[str, float] | None = None,
    progress: ProgressFn | None = None,
) -> RunResult:
    """Run ``policy`` (None: no controller, every client runs free) on the scenario.

    ``slo_ms`` gives the online SLOs (the scenario's, or derived from the standalone run).
    """
    with _fewer_collections():
        return _run_policy(scenario, policy, name, with_offline, with_online, slo_ms, progress)


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Collect the youngest generation less often while a run lasts.

    A run allocates millions of small objects that live to its end (requests, samples, kernels);
    at the default threshold (700 allocations) the collector walks them again and again, several
    per cent of a run. Results do not depend on it.
    """
    old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _run_policy(
    scenario: Scenario,
    policy: Policy[Any] | None,
    name: str | None,
    with_offline: bool,
    with_online: bool,
    slo_ms: dict[str, float] | None,
    progress: ProgressFn | None,
) -> RunResult:
    wall0 = time.perf_counter()
    traits = PolicyTraits.of(policy) if policy is not None else PolicyTraits()
    node = SimNode(scenario, traits=traits, with_offline=with_offline, with_online=with_online)
    for c in node.online:
        if slo_ms and c.cid in slo_ms:
            c.slo_p99_ms = slo_ms[c.cid]
    llm_node.apply_slos(node.llm, slo_ms)
    node.start()
    busy_total = {g.uuid: 0.0 for g in node.gpus}
    sm_total = {g.uuid: 0.0 for g in node.gpus}
    warmup, end = scenario.warmup_s, scenario.duration_s

    def account(t: float) -> None:
        # GPU busy and SM integrals of the measured window (after the warm-up), per period.
        for gpu in node.gpus:
            stats = gpu.take_stats()
            dt = t - stats.since_s
            if t > warmup:
                lo = max(stats.since_s, warmup)
                frac = (t - lo) / dt if dt > 0 else 0.0
                busy_total[gpu.uuid] += stats.busy_s * frac
                sm_total[gpu.uuid] += stats.sm_s * frac
        if progress is not None and t > 0:
            progress(t / end)

    if policy is None and not node.offline:
        # The reference run (online services alone) has nothing a daemon would act on: the
        # model runs alone, period by period.
        duty_series = _run_alone(node, end, account)
        ended: dict[str, tuple[str, str | None]] = {}
        actions: dict[str, int] = {}
    else:
        sim = SimDaemon(node, policy)
        sim.run(end, account)
        duty_series = sim.duty_series
        ended = sim.ended()
        actions = dict(sim.loop.applied)
        sim.close()
    for gpu in node.gpus:
        stats = gpu.take_stats()
        if node.loop.now > warmup:
            busy_total[gpu.uuid] += stats.busy_s
            sm_total[gpu.uuid] += stats.sm_s
    if progress is not None:
        progress(1.0)
    wall = time.perf_counter() - wall0
    return collect(
        node, scenario, policy, name, wall, duty_series, busy_total, sm_total, actions, ended
    )


def _run_alone(
    node: SimNode, end_s: float, before_tick: ProgressFn
) -> dict[str, list[tuple[float, float]]]:
    """Run the model without a daemon on the control-period grid; the duty is 1 throughout."""
    period = node.cfg.control.period_s
    series: dict[str, list[tuple[float, float]]] = {g.uuid: [] for g in node.gpus}
    t = 0.0
    ticks = 0
    while t < end_s - 1e-12:
        t_next = min(end_s, (ticks + 1) * period)
        before_tick(t)
        for gpu in node.gpus:
            series[gpu.uuid].append((t, 1.0))
        node.loop.run_until(t_next)
        t = t_next
        ticks += 1
    return series


def slo_of(spec: OnlineSpec, p99_alone_ms: float) -> float:
    """An online service's SLO in ms (the simulator's one SLO rule).

    Its ``slo_p99_ms`` or, when absent, ``slo_factor`` x its p99 alone.
    """
    return spec.slo_p99_ms or spec.slo_factor * p99_alone_ms


def standalone(
    scenario: Scenario, *, progress: ProgressFn | None = None
) -> tuple[RunResult | None, dict[str, float]]:
    """Run the online services alone; return that run and each service's SLO (:func:`slo_of`).

    An LLM server's TTFT and TPOT SLOs are keyed ``NAME/ttft`` and ``NAME/tpot``
    (:func:`gpushare.sim.llm_node.slos_from_alone`).
    """
    if not scenario.online and not scenario.llm:
        return None, {}
    alone = run_policy(scenario, None, name="alone", with_offline=False, progress=progress)
    slo = {
        spec.name: slo_of(spec, res.p99_ms)
        for spec, res in zip(scenario.online, alone.online, strict=True)
    }
    slo.update(llm_node.slos_from_alone(scenario, alone.llm))
    return alone, slo


def run_scenario(
    scenario: Scenario,
    policies: Sequence[tuple[str, Policy[Any]]],
    *,
    progress: Callable[[str, float], None] | None = None,
    on_run: Callable[[str, RunResult], None] | None = None,
) -> ScenarioResult:
    """Run the standalone reference and then every policy on the scenario.

    ``progress(label, fraction)`` follows each run as it goes and ``on_run(label, result)`` hears
    of each finished one; the label is ``"alone"`` for the reference, else the policy's name.
    """

    def tick(label: str) -> ProgressFn | None:
        return None if progress is None else lambda frac: progress(label, frac)

    alone, slo = standalone(scenario, progress=tick("alone"))
    if alone is not None and on_run is not None:
        on_run("alone", alone)
    runs = []
    for pname, policy in policies:
        run = run_policy(scenario, policy, name=pname, slo_ms=slo, progress=tick(pname))
        runs.append(run)
        if on_run is not None:
            on_run(pname, run)
    return ScenarioResult(scenario, alone, slo, runs)
