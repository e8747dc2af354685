"""Gangs in the simulated node: a DDP job's all-reduce waits for its slowest rank (a frozen rank
stalls all), a TP request runs on every shard with a collective per layer, and the daemon's own
loop runs them (issue 35)."""

from __future__ import annotations

import pytest

from gpushare.control.registry import make_policy
from gpushare.sim.gang import DdpGang, DdpSpec, TpSpec, tp_alone_s
from gpushare.sim.gangrun import (
    GangNode,
    GangScenario,
    base_scenario,
    run_gang_policy,
    slos,
    tell_spans,
)
from gpushare.sim.node import PolicyTraits
from gpushare.sim.runner import SimDaemon

K = "orion-v100-kernels/"
TRAIN = K + "resnet50_32_fb1.csv"


def ddp_node(gpus: int = 2) -> tuple[GangNode, DdpGang]:
    base = base_scenario("t", gpus, (), duration_s=5.0)
    sc = GangScenario("t", base, ddp=(DdpSpec("ddp", TRAIN, tuple(range(gpus)), allreduce_s=1e-3),))
    gn = GangNode(sc, traits=PolicyTraits(), with_offline=True)
    for r in gn.node.offline:
        r.set_limits(100.0)  # the whole GPU, as alone
        r.start(0.0)
    return gn, gn.gangs[0][1]


def test_ddp_alone_runs_at_iteration_plus_allreduce() -> None:
    gn, gang = ddp_node()
    gn.node.loop.run_until(2.0)
    per_iter = gang.ranks[0].profile.total_s + 1e-3
    assert len(gang.iterations) == pytest.approx(2.0 / per_iter, abs=1.5)
    # Every rank did the gang's iterations, no more than one ahead.
    for r in gang.ranks:
        assert len(gang.iterations) <= len(r.iterations) <= len(gang.iterations) + 1


def test_a_frozen_rank_stalls_every_rank() -> None:
    gn, gang = ddp_node(4)
    loop = gn.node.loop
    loop.run_until(1.0)
    gang.ranks[2].set_frozen(True, loop.now)
    before = [len(r.iterations) for r in gang.ranks]
    released = len(gang.iterations)
    loop.run_until(2.0)
    after = [len(r.iterations) for r in gang.ranks]
    # The frozen rank finishes the iteration it had issued; its peers that one and the next,
    # then wait at the all-reduce for a rank that issues nothing: at most one more gang
    # iteration in a second that holds ten.
    assert after[2] - before[2] <= 1
    assert all(a - b <= 2 for a, b in zip(after, before, strict=True))
    stalled = len(gang.iterations)
    assert stalled - released <= 1
    loop.run_until(2.5)
    assert len(gang.iterations) == stalled
    gang.ranks[2].set_frozen(False, loop.now)
    loop.run_until(3.0)
    assert len(gang.iterations) > stalled + 2


def test_a_tp_request_runs_on_every_shard_with_a_collective_per_layer() -> None:
    base = base_scenario("t", 4, (), duration_s=3.0)
    tp = TpSpec("tp", K + "bert_2_fwd.csv", (0, 1, 2, 3), load=0.05, layers=24)
    gn = GangNode(GangScenario("t", base, tp=(tp,)), traits=PolicyTraits(), with_offline=False)
    gn.node.start()
    gn.node.loop.run_until(3.0)
    server = gn.servers[0][1]
    assert server.completed, "no TP request completed"
    alone = tp_alone_s(server.shards[0].profile, tp) * len(tp.gpus)  # the unsplit pass
    one = min(lat for _, lat in server.completed)
    # A lone request takes one shard's part plus 24 collectives (the profile split four ways).
    assert one == pytest.approx(server.shards[0].profile.total_s + 24 * tp.collective_s, rel=1e-6)
    assert one < alone
    # Every shard reports the server's latencies (the daemon sees them on each GPU).
    assert all(s.completed is server.completed for s in server.shards)


def test_the_daemon_runs_a_gang_beside_online_services() -> None:
    base = base_scenario("t", 4, ((("bert", K + "bert_2_fwd.csv", 0, 0.5)),), duration_s=4.0)
    sc = GangScenario("t", base, ddp=(DdpSpec("ddp", TRAIN, (0, 1, 2, 3)),))
    _, slo = slos(sc, 1.5)
    run, gn = run_gang_policy(
        sc, make_policy("gpushare", base.config.control), name="g", slo_ms=slo
    )
    (svc,) = run.services
    (g,) = run.gangs
    assert svc.requests > 0 and svc.slo_attainment >= 0.95
    # Every rank was admitted on its own GPU and the gang made progress, at less than alone
    # (the rank on GPU 0 runs only while BERT is idle).
    assert [r.gpu.index for r in gn.gangs[0][1].ranks] == [0, 1, 2, 3]
    assert 0.0 < g.norm < 1.0


def test_every_shards_gate_protects_a_tp_server() -> None:
    # A TP=2 server on GPUs 0-1 and a DDP job over all four GPUs: the shards' request boundaries
    # close the gate on both of the server's GPUs, so its attainment holds where plain MPS with
    # priorities (no gate) lets the ranks beside it break it.
    base = base_scenario("t", 4, (), duration_s=4.0)
    tp = TpSpec("tp", K + "bert_2_fwd.csv", (0, 1), load=0.5)
    sc = GangScenario("t", base, ddp=(DdpSpec("ddp", TRAIN, (0, 1, 2, 3)),), tp=(tp,))
    _, slo = slos(sc, 1.5)
    att = {}
    for name in ("gpushare", "mps-priority"):
        run, _ = run_gang_policy(sc, make_policy(name, base.config.control), name=name, slo_ms=slo)
        ((svc,), (g,)) = run.services, run.gangs
        assert svc.gpus == (0, 1) and g.norm > 0.0
        att[name] = svc.slo_attainment
    assert att["gpushare"] >= 0.95
    assert att["mps-priority"] < att["gpushare"] - 0.05


def test_the_daemon_sees_ranks_and_shards_as_gangs() -> None:
    # The controller's rules for gangs (no loose-SLO gate delay beside one) read
    # ClientView.gang_gpus: each rank and shard is a one-GPU client of the simulated daemon, so
    # the run tells the views the GPUs its gang spans; a one-GPU service stays a one-GPU client.
    base = base_scenario("t", 4, ((("rn50", K + "resnet50_4_fwd.csv", 3, 0.5)),), duration_s=3.0)
    tp = TpSpec("tp", K + "bert_2_fwd.csv", (0, 1), load=0.5)
    sc = GangScenario("t", base, ddp=(DdpSpec("ddp", TRAIN, (0, 1, 2, 3)),), tp=(tp,))
    policy = make_policy("gpushare", base.config.control)
    gn = GangNode(sc, traits=PolicyTraits.of(policy), with_offline=True)
    gn.node.start()
    sim = SimDaemon(gn.node, policy)
    tell_spans(sim, gn)
    sim.run(1.5)  # past the gang's submission (1 s) and a tick after
    spans = {v.client_id: v.gang_gpus for g in gn.node.gpus for v in sim.loop.views.of_gpu(g.uuid)}
    sim.close()
    assert spans == {
        "rn50": 1,
        "tp.s0": 2,
        "tp.s1": 2,
        **{f"ddp.r{k}": 4 for k in range(4)},
    }
