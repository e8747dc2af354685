"""The policy registry: every name builds a policy that steps through a tick."""

from __future__ import annotations

import pytest

from gpushare.config import ControlConfig
from gpushare.control.registry import POLICY_NAMES, make_policy
from gpushare.model import SetDuty, SetOfflineShare
from tests.fake_observations import GPU, observation, offline, online


def test_names_are_the_documented_set() -> None:
    assert set(POLICY_NAMES) == {
        "gpushare",
        "exclusive",
        "time-slicing",
        "mps",
        "mps-priority",
        "static-split",
        "tgs",
    }


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_builds_and_steps(name: str) -> None:
    policy = make_policy(name, ControlConfig())
    assert policy.name == name
    state = policy.initial_state(GPU, 0.0)
    state, actions = policy.step(state, observation((online(), offline())), 0.0)
    # The first step tells the runner the duty and the offline share it starts from.
    assert any(isinstance(a, SetDuty) for a in actions)
    assert any(isinstance(a, SetOfflineShare) for a in actions)
    for a in actions:
        assert a.reason
    duties = [a.duty for a in actions if isinstance(a, SetDuty)]
    assert all(0.0 <= d <= 1.0 for d in duties)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid policies: gpushare, exclusive") as info:
        make_policy("gpushar", ControlConfig())
    assert "'gpushar'" in str(info.value)
