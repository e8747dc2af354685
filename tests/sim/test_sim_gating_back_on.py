"""Issue 32 in the simulator: gating back on reaches the controller while the job stays throttled.

The hour-long Azure trace (``scenarios/long/azure-bursty-1h.toml``) turns request gating off at
865 s (requests in flight 90 % of the time) and on again at 870.7 s. The live ``--queue auto``
job is switched deep and back shallow without a restart, but the daemon kept each client's view
until its registry record changed: the job stayed ``THROTTLED`` throughout, so the controller
went on seeing a deep queue, kept the duty cycle in charge and the share cut, and after 76 s
restarted the job under the cut (offline 0.919 -> 0.830 over the hour, 2 restarts per job-hour).
Here the same spell of the trace (from 850 s, 25 s of it), through the daemon's own loop.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpushare.control.registry import make_policy
from gpushare.model import Action, Observation, RestartClient, SetGating, SetOfflineShare
from gpushare.sim import runner
from gpushare.sim import scenario as sc_mod
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.runner import SimDaemon

AZURE_1H = Path(__file__).resolve().parents[2] / "gpushare/scenarios/long/azure-bursty-1h.toml"


class _Watching:
    """gpushare's policy, keeping its actions and whether each tick saw the job shallow."""

    def __init__(self, config: Any) -> None:
        self.inner = make_policy("gpushare", config)
        self.name = self.inner.name
        self.offline_mps_priority = 1
        self.actions: list[tuple[float, Action]] = []
        self.shallow: list[tuple[float, bool]] = []

    def initial_state(self, gpu_uuid: str, now: float) -> Any:
        return self.inner.initial_state(gpu_uuid, now)

    def step(self, state: Any, observation: Observation, now: float) -> tuple[Any, list[Action]]:
        for job in observation.offline():
            self.shallow.append((now, job.shallow))
        state, actions = self.inner.step(state, observation, now)
        self.actions += [(now, a) for a in actions]
        return state, actions


def test_gating_back_on_switches_the_throttled_job_shallow_and_the_share_recovers() -> None:
    sc = sc_mod.load(AZURE_1H)
    sc = dataclasses.replace(
        sc,
        duration_s=25.0,
        online=tuple(
            dataclasses.replace(o, trace_start_s=850.0, slo_factor=1.1) for o in sc.online
        ),
    )
    _, slo = runner.standalone(sc)
    sc = dataclasses.replace(
        sc, online=tuple(dataclasses.replace(o, slo_p99_ms=slo[o.name]) for o in sc.online)
    )
    policy = _Watching(sc.config.control)
    node = SimNode(sc, traits=PolicyTraits.of(policy.inner))
    node.start()
    sim = SimDaemon(node, policy)
    sim.run(sc.duration_s)
    sim.close()

    flips = [(t, a.on) for t, a in policy.actions if isinstance(a, SetGating)]
    off = next(t for t, on in flips if not on and t > 1.0)
    back = next(t for t, on in flips if on and t > off)
    shares = [(t, a.sm_pct) for t, a in policy.actions if isinstance(a, SetOfflineShare)]
    assert any(t > off and pct < 100.0 for t, pct in shares), "gating off: the share was cut"
    # The tick after gating turned back on sees the job shallow (switched live), and the share
    # goes back to the ceiling: the cut is not left standing for a restart to apply.
    seen = [s for t, s in policy.shallow if back < t <= back + 2 * sc.config.control.period_s]
    assert seen and all(seen), policy.shallow
    assert any(t >= back and pct == 100.0 for t, pct in shares), shares
    assert not [a for _, a in policy.actions if isinstance(a, RestartClient)]
