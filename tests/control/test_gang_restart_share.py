"""Issue 35: a gang's restart for a new share weighs every GPU it spans (pure).

A gang runs one SM share on all its ranks, the smallest of its GPUs' offline shares (as the
queue's admission starts it). One GPU's controller sees the gang's other GPUs' smallest share on
its view (``ClientView.gang_share_pct``, the daemon's :mod:`gpushare.daemon.clientviews`): it asks
a restart only for what that share allows, and the restart cost is weighed against that gain.
"""

from __future__ import annotations

import dataclasses

from bench.support.observations import GPU, observation, offline
from gpushare.config import ControlConfig
from gpushare.control.gpu_state import GpuState
from gpushare.control.restarts import restarts
from gpushare.control.signals import online_signals
from gpushare.model import Action, ClientView, RestartClient

CONFIG = ControlConfig()


def _gang(sm_pct: float, others_pct: float | None) -> ClientView:
    view = offline("g1", sm_pct=sm_pct, restartable=True, started=0.0)
    return dataclasses.replace(view, gang_gpus=2, gang_share_pct=others_pct)


def _asked(client: ClientView, share_pct: float, duty: float = 1.0) -> list[tuple[str, float]]:
    obs = observation((client,))
    state = GpuState(gpu_uuid=GPU, share_pct=share_pct, share_changed_at_s=0.0, duty=duty)
    actions: list[Action] = []
    restarts(CONFIG, state, obs, online_signals(obs, CONFIG.probe_slo_ratio), 1000.0, actions)
    return [(a.client_id, a.sm_pct) for a in actions if isinstance(a, RestartClient)]


def test_a_gang_is_not_restarted_for_a_share_its_other_gpu_does_not_give() -> None:
    # This GPU's share went up to 100 %, the gang's other GPU's stays at 30 %: it runs at 30 %
    # anyway, so a restart gains nothing.
    assert _asked(_gang(30.0, others_pct=30.0), 100.0) == []
    # A one-GPU client at 30 % under the same share is restarted to it.
    assert _asked(_gang(30.0, others_pct=None), 100.0) == [("g1", 100.0)]


def test_a_gangs_restart_goes_to_the_smallest_share_of_its_gpus() -> None:
    # Raised: to the other GPU's 60 %, not this GPU's 100 %.
    assert _asked(_gang(30.0, others_pct=60.0), 100.0) == [("g1", 60.0)]
    # Cut on the other GPU alone (its duty cycle freezing the gang, so the cut pays, issue 32):
    # the gang crowds that GPU's online work and is restarted to 30 %, from either GPU.
    assert _asked(_gang(100.0, others_pct=30.0), 100.0, duty=0.0) == [("g1", 30.0)]
    assert _asked(_gang(100.0, others_pct=100.0), 30.0, duty=0.0) == [("g1", 30.0)]
