"""A minimal sharing policy for the simulator's tests (the controller's policies live elsewhere).

It sets a fixed offline duty and share on its first step and can emit scripted actions at given
times, which is all the tests need to exercise the runner's action handling.
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
