"""Fake :class:`gpushare.control.policy.Policy` objects (the controller's policies live elsewhere).

:class:`FixedPolicy` sets a fixed offline duty and share on its first step and can emit scripted
actions at given times, which is all the simulator's tests need to exercise the runner's action
handling. :class:`ScriptedPolicy` returns whatever the test queued, at the next tick: the daemon's
tests drive its actions one by one with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.model import Action, Observation, SetDuty, SetOfflineShare


class FixedPolicy:
    """Fixed duty and offline share; optional scripted actions ``(at_s, factory(obs))``."""

    def __init__(
        self,
        duty: float = 1.0,
        share_pct: float = 100.0,
        *,
        name: str = "fixed",
        offline_mps_priority: int = 1,
        script: Sequence[tuple[float, object]] = (),
    ) -> None:
        self.name = name
        self.gpu_mode = "mps"
        self.preemption: str | None = None
        self.duty = duty
        self.share_pct = share_pct
        self.offline_mps_priority = offline_mps_priority
        self.script = list(script)
        self.observations: list[Observation] = []

    def initial_state(self, gpu_uuid: str, now: float) -> int:
        return 0

    def step(
        self, state: int, observation: Observation, now: float
    ) -> tuple[int, Sequence[Action]]:
        self.observations.append(observation)
        actions: list[Action] = []
        if state == 0:
            actions += [
                SetOfflineShare(observation.gpu_uuid, self.share_pct, "test"),
                SetDuty(observation.gpu_uuid, self.duty, "test"),
            ]
        due = [item for item in self.script if item[0] <= now]
        for item in due:
            self.script.remove(item)
            actions += item[1](observation)  # type: ignore[operator]
        return state + 1, actions


class ScriptedPolicy:
    """Returns the actions queued in ``pending`` at the next step, and records observations.

    An action that names no GPU (a freeze, an eviction: they name a client) goes to
    ``default_gpu``.
    """

    name = "scripted"
    offline_mps_priority = 1
    gpu_mode = "mps"
    preemption = None

    def __init__(self, default_gpu: str) -> None:
        self.default_gpu = default_gpu
        self.pending: list[Action] = []
        self.seen: list[Observation] = []

    def initial_state(self, gpu_uuid: str, now: float) -> int:
        return 0

    def step(
        self, state: int, observation: Observation, now: float
    ) -> tuple[int, Sequence[Action]]:
        self.seen.append(observation)
        mine = [a for a in self.pending if self._gpu(a) == observation.gpu_uuid]
        self.pending = [a for a in self.pending if a not in mine]
        return state + 1, mine

    def _gpu(self, action: Action) -> str:
        gpu = getattr(action, "gpu_uuid", None)  # only some action types name a GPU
        return gpu if isinstance(gpu, str) else self.default_gpu
