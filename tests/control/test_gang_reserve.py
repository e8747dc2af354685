"""A waiting gang reserves its GPUs (control/admission.py, docs/design.md D15: EASY backfill).

The plain rule skips a gang that cannot start, so a stream of one-GPU jobs that always keeps one
of its GPUs busy holds it back forever. Under the reservation rule the first gang that has waited
``after_s`` reserves the GPUs it would take once their offline jobs end, no other queued job is
placed on them, and the gang starts when they free. Driven here tick by tick by a small node
model: each started job holds its GPU's memory for its length, then ends.
"""

from __future__ import annotations

import dataclasses

from bench.support.observations import GIB, gpu_uuid, job, observation, offline
from gpushare.control.admission import GangReserve, plan
from gpushare.model import Observation, QueuedJob

TOTAL = 20 * GIB
RESERVE = GangReserve(after_s=300.0, max_hold_s=3600.0)


def gang(client_id: str, ranks: int, **kw: object) -> QueuedJob:
    return dataclasses.replace(job(client_id, **kw), ranks=ranks)  # type: ignore[arg-type]


def node(running: dict[str, tuple[int, float, int]], gpus: int = 2) -> dict[str, Observation]:
    """``gpus`` GPUs of 20 GiB; ``running``: job id -> (GPU index, end time, uid), 16 GiB each."""
    out = {}
    for k in range(gpus):
        here = tuple(offline(cid, mem=16 * GIB, uid=uid)
                     for cid, (g, _, uid) in running.items() if g == k)  # fmt: skip
        out[gpu_uuid(k)] = observation(here, gpu=gpu_uuid(k), index=k, mem_total=TOTAL)
    return out


def run(reserve: GangReserve | None, until_s: float = 1200.0) -> tuple[float | None, list[str]]:
    """A gang of 2 (uid 2000) and one-GPU jobs of 100 s (uid 1000) submitted every 50 s.

    Returns when the gang started (``None``: never) and its last waiting reason.
    """
    running: dict[str, tuple[int, float, int]] = {"a": (0, 60.0, 1000), "b": (1, 110.0, 1000)}
    queue = [gang("g", 2, mem=16 * GIB, duration=None, uid=2000, submitted=0.0)]
    reasons: list[str] = []
    n, t = 0, 0.0
    while t < until_s:
        running = {c: r for c, r in running.items() if r[1] > t}
        if t % 50 == 0:
            n += 1
            queue.append(job(f"s{n}", mem=16 * GIB, duration=100.0, submitted=t))
        p = plan(queue, node(running), {}, t, reserve=reserve)
        for a in p.admits:
            if a.client_id == "g":
                return t, reasons
            index = int(a.gpu_uuid == gpu_uuid(1))
            running[a.client_id] = (index, t + 100.0, 1000)
        started = {a.client_id for a in p.admits}
        queue = [j for j in queue if j.client_id not in started]
        reasons.append(p.waiting["g"])
        t += 10.0
    return None, reasons


def test_a_stream_of_one_gpu_jobs_starves_a_gang_under_the_plain_rule() -> None:
    started, reasons = run(None)
    assert started is None, "one GPU is always busy: the plain rule never starts the gang"
    assert "reserving" not in reasons[-1]


def test_the_gang_reserves_its_gpus_after_waiting_and_starts_when_they_free() -> None:
    started, reasons = run(RESERVE)
    # Reserved at 300 s; the one-GPU jobs already running end by 400 s, none starts after 300 s.
    assert started is not None and 300.0 < started <= 400.0, (started, reasons[-3:])
    assert reasons[-1].startswith("reserving GPUs 0,1 since "), reasons[-1]
    assert "EASY backfill" in reasons[-1]


def test_other_gpus_keep_admitting_and_the_reserved_ones_say_why() -> None:
    # Three GPUs, a gang of 2 waited 400 s; GPU 0 and 1 busy, GPU 2 busy too: the gang reserves
    # two (the most memory left: D12 at a tie, index order), a one-GPU job goes to the third.
    running = {"a": (0, 1e9, 1000), "b": (1, 1e9, 1000)}
    queue = [gang("g", 2, mem=16 * GIB, duration=None, uid=2000), job("j", mem=16 * GIB)]
    p = plan(queue, node(running, gpus=3), {}, 400.0, reserve=RESERVE)
    assert [a.client_id for a in p.admits] == ["j"] and p.admits[0].gpu_uuid == gpu_uuid(2)
    assert p.waiting["g"].startswith("reserving GPUs 0,1 since 100s"), p.waiting["g"]
    # A job that fits only on a reserved GPU waits and is told so.
    pinned = job("k", mem=2 * GIB, gpu="0")
    p = plan([*queue, pinned], node(running, gpus=3), {}, 400.0, reserve=RESERVE)
    assert "GPU 0: reserved for the gang g since 100s" in p.waiting["k"], p.waiting
    # Another gang is kept off them too, and told so.
    other = gang("h", 2, mem=2 * GIB, duration=None)
    p = plan([*queue, other], node(running, gpus=3), {}, 400.0, reserve=RESERVE)
    assert "h" not in {a.client_id for a in p.admits}
    assert p.waiting["h"].endswith("GPUs 0,1 are reserved for the gang g"), p.waiting["h"]


def test_no_reservation_for_an_owner_with_work_running_nor_past_the_hold_limit() -> None:
    # Security bound (docs/security.md): a user with a job running reserves nothing, and a
    # reservation lapses max_hold_s after it began, so a wide gang cannot idle GPUs for ever.
    running = {"a": (0, 1e9, 2000)}
    queue = [gang("g", 2, mem=16 * GIB, duration=None, uid=2000), job("j", mem=16 * GIB)]
    p = plan(queue, node(running), {}, 400.0, reserve=RESERVE)
    assert [a.client_id for a in p.admits] == ["j"], "the owner runs work: nothing is reserved"
    running = {"a": (0, 1e9, 1000)}
    late = 300.0 + RESERVE.max_hold_s + 1.0
    p = plan(queue, node(running), {}, late, reserve=RESERVE)
    assert [a.client_id for a in p.admits] == ["j"], "the reservation lapsed"
    assert "reserving" not in p.waiting["g"]
    p = plan(queue, node(running), {}, late - 2.0, reserve=RESERVE)
    assert p.admits == () and p.waiting["g"].startswith("reserving GPUs 0,1")


def test_a_gang_online_work_keeps_out_reserves_nothing() -> None:
    # GPU 1 has too little memory even with no offline job: nothing to wait for there, so the
    # gang does not reserve and the one-GPU job still starts on GPU 0.
    obs = node({})
    obs[gpu_uuid(1)] = observation(gpu=gpu_uuid(1), index=1, mem_total=TOTAL, mem_free=4 * GIB)
    queue = [gang("g", 2, mem=16 * GIB, duration=None, uid=2000), job("j", mem=16 * GIB)]
    p = plan(queue, obs, {}, 400.0, reserve=RESERVE)
    assert [a.client_id for a in p.admits] == ["j"] and "reserving" not in p.waiting["g"]
