"""The gate delay beside a gang: no loose-SLO room from readings taken beside an idle rank.

Issue 35, docs/controller.md "A loose SLO". A gang's rank waits at each all-reduce for its slowest
peer with nothing in flight, so the service beside it reads near its latency alone and a tight
SLO reads loose; beside a client spanning GPUs (a DDP rank, a TP server's shard) only the room
rule's worst-case bound decides. Pure: the controller stepped on fake observations, gated with a
shallow offline queue.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.support.observations import GPU, observation, offline, online
from gpushare.config import ControlConfig
from gpushare.control.controller import GpushareController
from gpushare.model import ClientView, GateReading, SetGating

CFG = ControlConfig()


def _delays(p99s: list[float], *, job: ClientView, server: ClientView) -> list[float]:
    """Step gated with each tick's app p99 beside ``job``; every delay sent."""
    ctl = GpushareController(CFG)
    gate = GateReading(
        enabled=True, closed=False, inflight=0, signalled_clients=1, busy_fraction=0.3
    )
    state = ctl.initial_state(GPU, 0.0)
    sent: list[float] = []
    for i, p99 in enumerate(p99s):
        obs = replace(observation((replace(server, p99_ms=p99), job)), gate=gate)
        state, actions = ctl.step(state, obs, round(i * 0.1, 6))
        sent += [a.delay_s for a in actions if isinstance(a, SetGating) and a.on]
    return sent


# SLO 100 ms, each tick's window at 30 or 80 ms in turn (mean 0.55 of the SLO, worst 0.8): the
# reading that gets a one-GPU job a loose room of about 90 ms (test_controller_loose.py).
READINGS = [30.0 if (i // 10) % 2 == 0 else 80.0 for i in range(200)]
# The room rule alone: (1 - 0.8) x 100 ms, times the trust ramp (20 s of a 60 s memory).
ROOM_S = 0.020 * 20.0 / 60.0


def test_beside_a_one_gpu_job_the_loose_room_is_given() -> None:
    sent = _delays(READINGS, job=replace(offline(), shallow=True), server=online(slo_ms=100.0))
    assert max(sent) >= 0.085, sent


@pytest.mark.parametrize("side", ["offline rank", "online shard"])
def test_beside_a_gang_only_the_worst_case_room_decides(side: str) -> None:
    job = replace(offline(), shallow=True)
    server = online(slo_ms=100.0)
    if side == "offline rank":
        job = replace(job, gang_gpus=8)  # a DDP rank: its readings are taken beside idle time
    else:
        server = replace(server, gang_gpus=4)  # a TP server: a request meets every shard's delay
    sent = _delays(READINGS, job=job, server=server)
    assert sent, "the room rule still raises a delay"
    assert max(sent) <= ROOM_S + 1e-9, sent
