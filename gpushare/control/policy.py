"""The interface every sharing policy implements: gpushare's own controller and the baselines.

A policy is a pure function of its previous state and one GPU's observation. The daemon and the
simulator keep one state per GPU and apply the returned actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from gpushare.model import Action, Observation

StateT = TypeVar("StateT")


class Policy(Protocol, Generic[StateT]):
    """A sharing policy: ``step(state, observation, now) -> (state, actions)`` per GPU."""

    name: str

    def initial_state(self, gpu_uuid: str, now: float) -> StateT:
        """The state of a GPU the policy has not seen yet."""
        ...

    def step(
        self, state: StateT, observation: Observation, now: float
    ) -> tuple[StateT, Sequence[Action]]:
        """Decide this tick's actions for one GPU. Must not do I/O or read a clock."""
        ...
