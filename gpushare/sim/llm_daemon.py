"""An LLM server next to a training job under gpushare's own daemon loop, in virtual time.

The pair is a scenario of one ``[[llm]]`` server and one ``[[offline]]`` training job on a
V100-32GB (:mod:`gpushare.sim.llm_node`): the daemon registers the server as an online service
with TTFT and TPOT SLOs, and each control period the server's token timings go into the
daemon's token windows, as ``client.report_ttft`` and ``report_tpot`` datagrams do on a host (a
TTFT at each first token, a TPOT per completed request: its mean, by default). The controller
protects both SLOs with the worst of their observed/SLO ratios.

:func:`tpot_slo_s` is the TPOT SLO a setup gives the daemon: ``factor`` x the p99 alone of the
per-request mean TPOT (what the pairs are scored on), or, for :data:`ITL_SETUP`, of the
inter-token gaps (what a per-token report, and vLLM's inter-token histogram, measure).
"""

from __future__ import annotations

from gpushare.control import registry
from gpushare.sim import scenario
from gpushare.sim.llm import LlmServerConfig
from gpushare.sim.llm_pairs import TRACE_START_S, PairResult, p99
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.runner import SimDaemon

#: gpushare with per-token reports (each inter-token gap) and the TPOT SLO set on the quantity
#: those reports measure: ``factor`` x the p99 of the inter-token gaps alone, as an operator
#: reading vLLM's inter-token histogram would set it.
ITL_SETUP = "gpushare-itl"


def tpot_slo_s(setup: str, alone: PairResult, factor: float) -> float:
    """The TPOT SLO (s) the daemon is given under ``setup``, from the server's run ``alone``.

    ``factor`` x the p99 of the inter-token gaps alone for :data:`ITL_SETUP`; ``factor`` x the
    p99 of the per-request mean TPOTs alone for every other setup. NaN if ``alone`` has none.
    """
    values = alone.itl_s if setup == ITL_SETUP else alone.tpot_s
    return factor * p99(values)


def _scenario(
    trainer: str,
    duration_s: float,
    llm: str,
    control: str = "",
    queue: str = "auto",
    after_s: float = 0.0,
) -> scenario.Scenario:
    return scenario.loads(
        f"""
[scenario]
name = "llm-pair"
duration = "{after_s + duration_s}s"
warmup = "{after_s + 0.1 * duration_s}s"
[gpu]
sm_count = 80
mem_total = "32GiB"
[[offline]]
name = "train"
profile = "{trainer}"
mem = "10GiB"
submit = "{after_s}s"
queue = "{queue}"
[[llm]]
name = "llm"
{llm}
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
    tpot_report: str = "request",
    queue: str = "auto",
    server_sm_pct: float = 100.0,
    trainer_after_s: float = 0.0,
) -> PairResult:
    """The pair under a registered policy (``gpushare``, ...) driven by the daemon's loop.

    ``control`` is TOML appended to the pair's scenario (a ``[control]`` table of overrides);
    ``tpot_report`` is how the server reports TPOT (``"request"``: each request's mean, the
    default; ``"token"``: each inter-token gap; ``"running"``: the sequence's mean so far);
    ``queue`` is the training job's ``submit --queue``;
    ``server_sm_pct`` is the server's ``submit --online --sm`` (its MPS active-thread percentage);
    ``trainer_after_s``: the training job is submitted after the server has served alone that
    long (a server running before the job arrives, as on a host where servers run for days); the
    run goes on ``duration_s`` from then and is scored as if that were 0 (warm-up, requests,
    iterations).
    Of ``config`` the scheduler limits, the KV cache and ``s_sat`` are used (the ``[[llm]]``
    keys); the model and the roof are the defaults.

    Raises:
        ValueError: an unknown policy name or a load outside (0, 1].
    """
    if not 0.0 < load <= 1.0:
        raise ValueError(f"load {load!r}: expected a fraction of capacity in (0, 1]")
    cfg = config or LlmServerConfig()
    llm = (
        f'load = {load!r}\ntrace_start = "{TRACE_START_S}s"\nslo_ttft_p99 = "{slo_ttft_s * 1e3:.6f}ms"\n'
        f'slo_tpot_p99 = "{slo_tpot_s * 1e3:.6f}ms"\nkv_cache = {cfg.kv_cache_bytes}\n'
        f"max_batched_tokens = {cfg.max_batched_tokens}\nmax_seqs = {cfg.max_seqs}\n"
        f'tpot_report = "{tpot_report}"\nsm_pct = {server_sm_pct!r}\ns_sat = {cfg.s_sat!r}'
    )
    after = trainer_after_s
    scen = _scenario(trainer, duration_s, llm, control, queue, after)
    policy = registry.make_policy(policy_name, scen.config.control)
    node = SimNode(scen, traits=PolicyTraits.of(policy))
    (srv,) = node.llm
    node.start()
    sim = SimDaemon(node, policy)
    sim.run(after + duration_s)
    sim.close()
    warm = after + 0.1 * duration_s
    fin = [f for f in srv.stats.finished if f.arrival_s >= warm]
    (job,) = node.offline
    its = [t for t in job.iterations if t >= warm]
    return PairResult(
        policy_name,
        trainer,
        load,
        tuple((f.ttft_s, f.tpot_s) for f in fin),
        len(its) / (after + duration_s - warm),
        srv.stats.preemptions,
        srv.stats.busy_s / (after + duration_s),
        trainer_priority=job.priority,
    )
