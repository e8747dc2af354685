"""The simulator's start-up is what the daemon measures as a relaunched job's restart cost (issue 32).

The daemon's own loop in virtual time: a restartable job relaunched by a ``RestartClient`` issues
its first kernel ``[gpu] restart`` after its spawn, and the per-process SM periods the simulated
NVML reports show it then.
"""

from __future__ import annotations

from gpushare.model import RestartClient
from gpushare.sim import runner
from gpushare.sim.node import PolicyTraits, SimNode
from tests.fakes.fake_policy import FixedPolicy
from tests.sim.test_sim_model import pair


def test_a_relaunched_simulated_job_measures_its_simulated_start_up() -> None:
    sc = pair(duration="5s", extra='restartable = true\n[gpu]\nrestart = "1.5s"')
    node = SimNode(sc, traits=PolicyTraits())
    node.start()
    # Restarted once running (its first start takes [gpu] start, 1 s, from its submit at 0.2 s).
    restart = (2.0, lambda obs: [RestartClient("train", 60.0, "test")])
    sim = runner.SimDaemon(node, FixedPolicy(duty=1.0, share_pct=50.0, script=[restart]))
    try:
        sim.run(3.0)
        rec = sim.state.registry.get("train")
        assert rec.restarts == 1
        assert rec.startup_s is None, "relaunched, no kernel yet"
        sim.run(5.0)
        measured = sim.state.registry.get("train").startup_s
        period = sc.config.control.period_s
        assert measured is not None
        assert 1.5 <= measured <= 1.5 + 2 * period
    finally:
        sim.close()
