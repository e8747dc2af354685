"""Driving gpushare's controller tick by tick in tests: the default config, a run over a sequence
of observations, and the duties it sent.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from bench.support.observations import GPU
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController, GpuState
from gpushare.model import Action, Observation, SetDuty

#: The default control configuration the scenarios run under.
CFG = ControlConfig()


def run(
    ctl: GpushareController, obs_seq: list[Observation], state: GpuState | None = None
) -> tuple[GpuState, list[list[Action]]]:
    """Steps ``ctl`` over ``obs_seq``, one period apart, from ``state`` (or a fresh GPU's).

    Returns the last state and each tick's actions.
    """
    state = state if state is not None else ctl.initial_state(GPU, 0.0)
    out = []
    for i, obs in enumerate(obs_seq):
        state, actions = ctl.step(state, obs, float(i) * ctl.config.period_s)
        out.append(list(actions))
    return state, out


def duties(actions: list[list[Action]]) -> list[float]:
    """The duties sent (``SetDuty``) over the ticks of a :func:`run`, in order."""
    return [a.duty for tick in actions for a in tick if isinstance(a, SetDuty)]


#: Hypothesis settings of the controller's property tests.
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
