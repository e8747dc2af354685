"""The policy registry: every name builds a policy that steps through a tick."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.support.observations import GPU, observation, offline, online
from gpushare.config import ControlConfig
from gpushare.control.registry import POLICY_NAMES, make_policy
from gpushare.model import SetDuty, SetOfflineShare


def test_names_are_the_documented_set() -> None:
    assert set(POLICY_NAMES) == {
        "gpushare",
        "exclusive",
        "time-slicing",
        "mps",
        "mps-priority",
        "static-split",
        "tgs",
        "tally-like",  # issue 14: the simulator's kernel-preemption reference (docs/controller.md)
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


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(POLICY_NAMES),
    st.lists(
        st.tuples(
            st.booleans(),  # online present
            st.one_of(st.none(), st.floats(0.1, 20.0)),  # probe ratio
            st.floats(1.0, 500.0),  # online p99
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_every_policy_keeps_duty_in_range_and_never_targets_online(
    name: str, ticks: list[tuple[bool, float | None, float]]
) -> None:
    policy = make_policy(name, ControlConfig())
    state = policy.initial_state(GPU, 0.0)
    for i, (has_online, probe, p99) in enumerate(ticks):
        clients = (online(p99_ms=p99), offline()) if has_online else (offline(),)
        state, actions = policy.step(state, observation(clients, probe_ratio=probe), i * 0.5)
        for a in actions:
            assert a.reason
            if isinstance(a, SetDuty):
                assert 0.0 <= a.duty <= 1.0
            assert getattr(a, "client_id", "off1") == "off1"
