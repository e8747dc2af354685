"""``[control] offline_mps_priority``: the MPS priority gpushare launches offline clients with.

Every path that launches or describes an offline client reads it from the policy: the daemon
(tests/daemon/test_daemon.py), the Slurm and Kubernetes environments (``envresolve``), the
simulator's node (``PolicyTraits``), and a gang-duty wrapper of the controller.
"""

from __future__ import annotations

import pytest

from gpushare import config
from gpushare.control.controller import GpushareController
from gpushare.control.gang import GangDuty
from gpushare.control.registry import make_policy
from gpushare.roots import envresolve
from gpushare.sim.node import PolicyTraits


@pytest.mark.parametrize("prio", [0, 1])
def test_every_reader_of_the_policy_gets_the_configured_priority(prio: int) -> None:
    cfg = config.loads(f"[control]\noffline_mps_priority = {prio}\n")
    policy = make_policy("gpushare", cfg.control)
    assert isinstance(policy, GpushareController)
    assert policy.offline_mps_priority == prio
    assert GangDuty(policy, [["GPU-a", "GPU-b"]]).offline_mps_priority == prio
    assert envresolve.offline_priority(cfg) == prio
    assert PolicyTraits.of(policy).offline_priority == prio


def test_the_default_stays_below_normal() -> None:
    assert make_policy("gpushare", config.loads("").control).offline_mps_priority == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [("2", "out of range: 2"), ("0.5", "expected an integer"), ('"low"', "expected an integer")],
)
def test_a_bad_priority_is_one_line_naming_the_key(value: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=f"control.offline_mps_priority: {message}"):
        config.loads(f"[control]\noffline_mps_priority = {value}\n")
