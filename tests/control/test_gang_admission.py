"""Queued gangs in the admission round (control/admission.py, issue 35): all GPUs at once or wait.

A gang waits until ``ranks`` GPUs each fit a rank by the one fit rule, counted against what the
same round already placed; then it starts on the GPUs it named, in its rank order, or on those
D14 chooses (docs/design.md D14): where the online services' gates leave it the most time.
"""

from __future__ import annotations

import dataclasses

from bench.support.observations import GIB, gpu_uuid, job, observation, online
from gpushare.control.admission import plan
from gpushare.model import GateReading, Observation, QueuedJob


def gated(obs: Observation, busy: float) -> Observation:
    reading = GateReading(enabled=True, closed=False, inflight=0, signalled_clients=1,
                          busy_fraction=busy)  # fmt: skip
    return dataclasses.replace(obs, gate=reading)


def node(**mem_free_gib: float) -> dict[str, Observation]:
    """Four GPUs: a TP server (``tp``) on 0 and 1 busy 0.5, services on 2 and 3 busy 0.4."""
    layout = [("tp", 0.5), ("tp", 0.5), ("a", 0.4), ("b", 0.4)]
    out = {}
    for k, (service, busy) in enumerate(layout):
        free = mem_free_gib.get(f"g{k}", 20.0 if k < 2 else 40.0)
        obs = observation((online(service),), gpu=gpu_uuid(k), index=k, mem_free=int(free * GIB))
        out[gpu_uuid(k)] = gated(obs, busy)
    return out


def gang(client_id: str, ranks: int, *named: int, **kw: object) -> QueuedJob:
    named_uuids = tuple(gpu_uuid(k) for k in named)
    return dataclasses.replace(job(client_id, **kw), ranks=ranks, gang_gpus=named_uuids)  # type: ignore[arg-type]


def test_a_queued_gang_starts_where_the_gates_leave_it_most_time_d14() -> None:
    # D12 (memory) would take GPUs 2 and 3: 0.6 * 0.6 = 0.36 of the time; the TP server's two
    # GPUs are busy together and leave 0.5.
    (admit,) = plan([gang("g", 2)], node(), {}, 0.0).admits
    assert admit.gang == (gpu_uuid(0), gpu_uuid(1)) and admit.gpu_uuid == gpu_uuid(0)
    assert "D14" in admit.reason


def test_a_gang_waits_for_all_its_gpus_and_does_not_hold_up_a_one_gpu_job() -> None:
    # Only GPUs 2 and 3 hold 20 GiB beside the 2 GiB reserve: a gang of 3 waits.
    p = plan([gang("g", 3, mem=20 * GIB), job("j", mem=20 * GIB, duration=500.0)], node(), {}, 0)
    assert "the gang of 3 GPUs fits on 2: GPU 0: needs 22G" in p.waiting["g"], p.waiting
    assert [a.client_id for a in p.admits] == ["j"]


def test_a_named_gang_keeps_its_rank_order_and_the_round_counts_its_memory() -> None:
    first, second = gang("g1", 2, 3, 1, mem=16 * GIB), gang("g2", 2, 1, 2, mem=16 * GIB)
    p = plan([first, second], node(), {}, 0.0)
    (admit,) = p.admits
    assert admit.client_id == "g1" and admit.gang == (gpu_uuid(3), gpu_uuid(1))
    # GPU 1's 20 GiB less g1's 16 GiB no longer fits g2's rank there: it waits, all or nothing.
    assert "GPU 1:" in p.waiting["g2"]


def test_a_gang_takes_the_smallest_share_of_its_gpus() -> None:
    shares = {gpu_uuid(0): 60.0, gpu_uuid(1): 40.0}
    (admit,) = plan([gang("g", 2, 0, 1)], node(), shares, 0.0).admits
    assert admit.sm_pct == 40.0


def test_beside_a_gate_delay_the_memory_rule_d12_stands() -> None:
    # D14 is for gates that close on every request: with a delay, offline work runs beside
    # short requests and the shares do not tell what the gang would get.
    gpus = node()
    obs = gpus[gpu_uuid(2)]
    assert obs.gate is not None
    gpus[gpu_uuid(2)] = dataclasses.replace(obs, gate=dataclasses.replace(obs.gate, delay_s=0.002))
    (admit,) = plan([gang("g", 2)], gpus, {}, 0.0).admits
    assert admit.gang == (gpu_uuid(2), gpu_uuid(3)) and "D12" in admit.reason
