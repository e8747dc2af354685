"""Issue 32 in the simulator: a ``--queue auto`` job switches queues live when gating turns on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpushare.control.registry import make_policy
from gpushare.model import Action, Observation, RestartClient
from gpushare.sim import runner
from gpushare.sim import scenario as sc_mod
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.runner import SimDaemon

SCENARIOS = Path(__file__).resolve().parents[2] / "gpushare" / "scenarios"


class _Recording:
    """gpushare's policy, keeping every action it asks for."""

    def __init__(self, config: Any) -> None:
        self.inner = make_policy("gpushare", config)
        self.name = self.inner.name
        self.offline_mps_priority = 1
        self.actions: list[tuple[float, Action]] = []

    def initial_state(self, gpu_uuid: str, now: float) -> Any:
        return self.inner.initial_state(gpu_uuid, now)

    def step(self, state: Any, observation: Observation, now: float) -> tuple[Any, list[Action]]:
        state, actions = self.inner.step(state, observation, now)
        self.actions += [(now, a) for a in actions]
        return state, actions


def test_an_auto_job_admitted_before_gating_turns_shallow_without_a_restart() -> None:
    # genai-idle admits its --queue auto job (t = 1 s) before the service's first request
    # boundary turns gating on: it starts deep (bound 0 in its GPU's control file).
    sc = sc_mod.load(SCENARIOS / "genai-idle.toml")
    _, slo = runner.standalone(sc)
    sc = dataclasses.replace(
        sc,
        duration_s=12.0,
        online=tuple(dataclasses.replace(o, slo_p99_ms=slo[o.name]) for o in sc.online),
    )
    policy = _Recording(sc.config.control)
    node = SimNode(sc, traits=PolicyTraits.of(policy.inner))
    node.start()
    sim = SimDaemon(node, policy)
    switch = node.inflight_switch
    assert switch is not None
    (trainer,) = node.offline
    k = sc.config.gate.inflight_kernels
    pid = None
    while not any(b == k for _, _, b in switch.writes) and node.loop.now < 4.0:
        sim.run(node.loop.now + 0.1)
        if pid is None and trainer.pid in node.processes:
            pid = trainer.pid
    sim.close()
    assert pid is not None
    # Launched under the file's 0 (unbounded: deep), then gating wrote k into the same file.
    assert switch.writes[0][2] == 0
    assert any(b == k for _, _, b in switch.writes[1:])
    assert trainer.inflight_bound == k
    assert trainer.pid == pid, "the same process: switched live, not relaunched"
    queue_restarts = [
        a for _, a in policy.actions if isinstance(a, RestartClient) and "--queue auto" in a.reason
    ]
    assert queue_restarts == []
