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
    """A sharing policy: ``step(state, observation, now) -> (state, actions)`` per GPU.

    Besides its step, a policy says how the node must be set up for it (read once, when the
    daemon or the simulator starts): the MPS priority of offline clients, and for the simulator
    the GPU's compute mode and whether offline kernels are preempted.
    """

    name: str

    @property
    def offline_mps_priority(self) -> int:
        """``CUDA_MPS_CLIENT_PRIORITY`` offline clients start with: 1 (below normal) or 0."""
        ...

    @property
    def gpu_mode(self) -> str:
        """``"mps"``, or ``"time_slice"``: the simulator runs the GPU time-sliced, without MPS."""
        ...

    @property
    def preemption(self) -> str | None:
        """``"kernel"``: the simulator preempts offline kernels (``tally-like``); else ``None``."""
        ...

    def initial_state(self, gpu_uuid: str, now: float) -> StateT:
        """The state of a GPU the policy has not seen yet."""
        ...

    def step(
        self, state: StateT, observation: Observation, now: float
    ) -> tuple[StateT, Sequence[Action]]:
        """Decide this tick's actions for one GPU. Must not do I/O or read a clock."""
        ...
