"""An LLM server next to a training job under gpushare's own daemon loop, in virtual time.

The node is built from a one-job scenario (the training job on a V100-32GB); the server
(:class:`gpushare.sim.llm.LlmServer`) is added to it and registered with the daemon as an online
service with TTFT and TPOT SLOs. Each control period its finished requests are reported to the
daemon's latency tracker, one value per request: ``slo_p99_ms x max(TTFT / TTFT SLO, TPOT / TPOT
SLO)`` (``LlmServer.completed``), so the controller, which keeps a service's windowed p99 under
its ``slo_p99_ms``, keeps 99 % of requests inside both SLOs, whatever it does to get there.
"""

from __future__ import annotations

from gpushare.control import registry
from gpushare.sim import scenario
from gpushare.sim.llm import LlmServer, LlmServerConfig, load_trace, trace_requests
from gpushare.sim.llm_pairs import TRACE_START_S, PairResult, capacity_rps
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.runner import SimDaemon
from gpushare.sim.workloads import SimClient

#: The p99 SLO the daemon is given for the server's SLO-ratio reports (any positive value works:
#: a report is this times the request's SLO ratio).
RATIO_SLO_MS = 1000.0


class LlmNode(SimNode):
    """A simulated node that also holds LLM servers (its other clients as :class:`SimNode`'s)."""

    def __init__(self, scen: scenario.Scenario, *, traits: PolicyTraits) -> None:
        super().__init__(scen, traits=traits)
        self.llm: list[SimClient] = []

    @property
    def clients(self) -> list[SimClient]:
        """Every online, LLM and offline client."""
        return [*self.online, *self.llm, *self.offline]


def _scenario(trainer: str, duration_s: float, control: str = "") -> scenario.Scenario:
    return scenario.loads(
        f"""
[scenario]
name = "llm-pair"
duration = "{duration_s}s"
warmup = "{0.1 * duration_s}s"
[gpu]
sm_count = 80
mem_total = "32GiB"
[[offline]]
name = "train"
profile = "{trainer}"
mem = "10GiB"
submit = "0s"
{control}
"""
    )


def run_policy(
    policy_name: str,
    trainer: str,
    load: float,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    duration_s: float = 120.0,
    config: LlmServerConfig | None = None,
    control: str = "",
) -> PairResult:
    """The pair under a registered policy (``gpushare``, ...) driven by the daemon's loop.

    ``control`` is TOML appended to the pair's scenario (a ``[control]`` table of overrides).

    Raises:
        ValueError: an unknown policy name or a load outside (0, 1].
    """
    if not 0.0 < load <= 1.0:
        raise ValueError(f"load {load!r}: expected a fraction of capacity in (0, 1]")
    cfg = config or LlmServerConfig()
    scen = _scenario(trainer, duration_s, control)
    policy = registry.make_policy(policy_name, scen.config.control)
    node = LlmNode(scen, traits=PolicyTraits.of(policy))
    trace = load_trace()
    span = trace[-1].arrival_s - trace[0].arrival_s
    scale = min(1.0, load * capacity_rps(cfg) / (len(trace) / span))
    reqs = trace_requests(trace, rate_scale=scale, start_s=TRACE_START_S, end_s=duration_s)
    srv = LlmServer("llm", node.gpus[0], reqs, cfg)
    srv.pid = node.next_pid()
    srv.slo_p99_ms = RATIO_SLO_MS
    srv.slo_ttft_s, srv.slo_tpot_s = slo_ttft_s, slo_tpot_s
    node.processes[srv.pid] = srv
    node.llm.append(srv)
    node.start()
    srv.start(node.loop)
    sim = SimDaemon(node, policy)
    sim.add_online(srv)
    tracker = sim.state.latency.tracker

    def report(_: float) -> None:
        if srv.completed:
            tracker.add_many(srv.cid, [(t, lat) for t, lat in srv.completed])
            srv.completed.clear()

    sim.run(duration_s, report)
    sim.close()
    warm = 0.1 * duration_s
    fin = [f for f in srv.stats.finished if f.arrival_s >= warm]
    (job,) = node.offline
    its = [t for t in job.iterations if t >= warm]
    return PairResult(
        policy_name,
        trainer,
        load,
        tuple((f.ttft_s, f.tpot_s) for f in fin),
        len(its) / (duration_s - warm),
        srv.stats.preemptions,
    )
