"""Policies by name, for the daemon (``control.policy``) and the simulator (``gpushare sim``).

``POLICY_NAMES`` lists every policy; :func:`make_policy` builds one from the control config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpushare.config import ControlConfig
from gpushare.control import baselines
from gpushare.control.controller import GpushareController
from gpushare.control.policy import Policy

_FACTORIES: dict[str, Callable[[ControlConfig], Policy[Any]]] = {
    "gpushare": GpushareController,
    "exclusive": baselines.exclusive,
    "time-slicing": baselines.time_slicing,
    "mps": baselines.plain_mps,
    "mps-priority": baselines.mps_priority,
    "static-split": baselines.static_split,
    "tgs": baselines.tgs,
    "tally-like": baselines.tally_like,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, config: ControlConfig) -> Policy[Any]:
    """Build the named policy.

    Args:
        name: one of :data:`POLICY_NAMES`.
        config: the control section of the config (thresholds, steps, shares).

    Raises:
        ValueError: the name is not a known policy; the message lists the valid names.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        valid = ", ".join(POLICY_NAMES)
        raise ValueError(f"unknown policy {name!r}; valid policies: {valid}")
    return factory(config)
