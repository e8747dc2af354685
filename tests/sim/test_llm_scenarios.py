"""LLM servers in scenarios (``[[llm]]``): loading, the daemon's token windows, the shipped files."""

from __future__ import annotations

import math

import pytest

from gpushare.control import registry
from gpushare.sim import llm_node, llm_smshare, runner, scenario
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.runner import SimDaemon

PAIR = """
[scenario]
duration = "40s"
warmup = "4s"
[gpu]
mem_total = "32GiB"
[[offline]]
name = "train"
profile = "orion-v100-kernels/resnet50_32_fb1.csv"
mem = "10GiB"
submit = "0s"
[[llm]]
name = "chat"
load = 0.5
slo_ttft_p99 = "1.4s"
slo_tpot_p99 = "45ms"
"""


def test_an_llm_table_is_read_with_its_defaults_and_bad_values_get_one_line() -> None:
    sc = scenario.loads(PAIR)
    (spec,) = sc.llm
    assert spec.name == "chat" and spec.load == 0.5 and spec.trace_start_s == 600.0
    assert spec.slo_ttft_p99_s == pytest.approx(1.4) and spec.slo_tpot_p99_s == pytest.approx(0.045)
    assert spec.tpot_report == "request" and spec.kv_cache_bytes == 6 << 30 and spec.sm_pct == 100.0
    # The server's kernels follow the measured SM law by default (docs/simulator.md L3b).
    assert spec.s_sat == llm_smshare.FITTED_S_SAT
    assert scenario.loads(PAIR + "s_sat = 0\n").llm[0].s_sat == 0.0
    for bad, key in (
        ("load = 1.2", "llm[0].load"),
        ('tpot_report = "bytes"', "llm[0].tpot_report"),
        ("gpu = 3", "llm[0].gpu"),
        ('kv_cache = "1k"', "llm[0].kv_cache"),
        ("colour = 1", "llm[0].colour"),
        ("sm_pct = 0", "llm[0].sm_pct"),
        ("sm_pct = 101", "llm[0].sm_pct"),
        ("s_sat = 1.5", "llm[0].s_sat"),
        ("s_sat = -0.1", "llm[0].s_sat"),
    ):
        text = PAIR.replace("load = 0.5", bad) if "load" in bad else PAIR + bad + "\n"
        with pytest.raises(scenario.ScenarioError) as err:
            scenario.loads(text)
        assert key in str(err.value) and "\n" not in str(err.value)
    dup = PAIR.replace('name = "chat"', 'name = "train"')
    with pytest.raises(scenario.ScenarioError, match="unique"):
        scenario.loads(dup)


@pytest.mark.parametrize("report", ["request", "token"])
def test_the_daemon_gets_the_servers_token_timings_and_protects_both_slos(report: str) -> None:
    sc = scenario.loads(PAIR + f'tpot_report = "{report}"\n')
    policy = registry.make_policy("gpushare", sc.config.control)
    node = SimNode(sc, traits=PolicyTraits.of(policy))
    (srv,) = node.llm
    node.start()
    sim = SimDaemon(node, policy)
    sim.run(40.0)
    rec = sim.state.registry.get("chat")
    assert rec is not None and rec.slo_ttft_p99_ms == pytest.approx(1400.0)
    assert rec.slo_tpot_p99_ms == pytest.approx(45.0) and rec.slo_p99_ms is None
    ttft, tpot = sim.state.latency.tokens.p99s("chat", node.loop.now)
    assert ttft is not None and tpot is not None
    # 40 s at ~0.44 requests/s: fewer first tokens than min_samples, and one TPOT per finished
    # request (its mean, the default) or thousands (one per further token).
    assert ttft.samples >= 10
    if report == "request":
        assert 0 < tpot.samples <= len(srv.stats.finished) and tpot.p99_ms is None
    else:
        assert tpot.samples > 1000 and tpot.p99_ms is not None and tpot.p99_ms < 45.0
    # The last tick read them: the p99s the controller's view of the server is built from.
    seen = sim.state.p99["chat"]
    sim.close()
    assert srv.stats.finished and seen.ttft is not None and seen.tpot is not None
    assert seen.ttft.samples > 0 and seen.tpot.samples > 0


@pytest.mark.parametrize("name", [n for n in scenario.shipped() if n.startswith("llm/")])
def test_every_shipped_llm_scenario_loads(name: str) -> None:
    sc = scenario.load(name)
    assert sc.llm and sc.offline and sc.gpu.mem_total_bytes >= 32 << 30


def test_gpushare_sim_runs_an_llm_scenario_and_scores_both_slos() -> None:
    sc = scenario.loads(PAIR.replace('duration = "40s"', 'duration = "30s"'))
    res = runner.run_scenario(
        sc, [("gpushare", registry.make_policy("gpushare", sc.config.control))]
    )
    assert res.alone is not None and res.slo_ms == {"chat/ttft": 1400.0, "chat/tpot": 45.0}
    (alone,) = res.alone.llm
    (run,) = res.runs
    (llm,) = run.llm
    assert alone.slo_attainment is not None and llm.slo_attainment is not None
    assert math.isfinite(llm.ttft_p99_ms) and llm.requests > 0
    assert run.offline[0].iterations > 0


def test_slos_not_given_are_a_factor_times_the_p99s_alone() -> None:
    text = PAIR.replace('slo_ttft_p99 = "1.4s"\nslo_tpot_p99 = "45ms"', "slo_factor = 2.0")
    sc = scenario.loads(text.replace('duration = "40s"', 'duration = "30s"'))
    alone, slo = runner.standalone(sc)
    assert alone is not None
    (a,) = alone.llm
    assert slo[llm_node.slo_keys("chat")[0]] == pytest.approx(2.0 * a.ttft_p99_ms)
    assert slo["chat/tpot"] == pytest.approx(2.0 * a.tpot_p99_ms)


def test_an_llm_server_submitted_with_an_sm_share_runs_and_is_registered_at_it() -> None:
    sc = scenario.loads(PAIR.replace("load = 0.5", "load = 0.5\nsm_pct = 85"))
    policy = registry.make_policy("gpushare", sc.config.control)
    node = SimNode(sc, traits=PolicyTraits.of(policy))
    (srv,) = node.llm
    # MPS's active-thread percentage: round(0.85 x 80) slots, as `submit --online --sm 85`.
    assert srv.sm_pct == 85.0 and srv.stream.cap_sms == 68
    # Its kernels follow the saturating law on fewer SMs (L3b, the default); the trainer's G7.
    assert srv.cfg.s_sat == srv.stream.sat == llm_smshare.FITTED_S_SAT
    assert all(job.stream.sat == 0.0 for job in node.offline)
    node.start()
    sim = SimDaemon(node, policy)
    sim.run(5.0)
    rec = sim.state.registry.get("chat")
    sim.close()
    assert rec is not None and rec.sm_pct == 85.0
    assert srv.stream.held_max == 68
