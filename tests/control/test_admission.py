"""Node-level admission: SJF order, skip-blocked, memory fit, best sharing benefit, D11."""

from __future__ import annotations

from bench.support.observations import GIB, gpu_uuid, job, observation, offline, online
from gpushare.control.admission import admit, plan
from gpushare.model import ClientState, MpsState, Observation


def gpus(*observations: Observation) -> dict[str, Observation]:
    return {o.gpu_uuid: o for o in observations}


def one_gpu(**kwargs: object) -> dict[str, Observation]:
    clients = kwargs.pop("clients", (online(mem=10 * GIB),))
    return gpus(observation(clients, gpu=gpu_uuid(0), index=0, **kwargs))  # type: ignore[arg-type]


def test_shortest_expected_job_first_then_submission_order() -> None:
    queue = [
        job("long", duration=500.0, submitted=0.0),
        job("unknown", duration=None, submitted=0.0),
        job("short", duration=10.0, submitted=5.0),
        job("mid-late", duration=100.0, submitted=9.0),
        job("mid-early", duration=100.0, submitted=1.0),
    ]
    admits = admit(queue, one_gpu(), {}, now=10.0)
    assert [a.client_id for a in admits] == ["short", "mid-early", "mid-late", "long", "unknown"]
    assert all(a.reason for a in admits)


def test_a_job_that_cannot_start_does_not_block_later_ones() -> None:
    # 80 GiB GPU, online holds 10, reserve 2: 68 GiB left for offline work.
    queue = [
        job("huge-short", mem=70 * GIB, duration=1.0),
        job("small-long", mem=4 * GIB, duration=1000.0),
    ]
    result = plan(queue, one_gpu(), {}, now=0.0)
    assert [a.client_id for a in result.admits] == ["small-long"]
    # The one fit rule's words (gpushare.control.fit), as submit says them: the job's 70 GiB and the
    # 2 GiB reserve need 72 of the 70 GiB free.
    assert "needs 72G with 2G kept for online clients, 70G free" in result.waiting["huge-short"]


def test_memory_must_fit_beside_the_online_reserve_including_this_round() -> None:
    # free = 80 - 10 = 70 GiB, reserve 2 GiB: exactly 68 GiB fits, one byte more does not.
    assert [a.client_id for a in admit([job("a", mem=68 * GIB)], one_gpu(), {}, 0.0)] == ["a"]
    assert admit([job("a", mem=68 * GIB + 1)], one_gpu(), {}, 0.0) == []
    # Two jobs of 40 GiB: the second no longer fits once the first is placed.
    admits = admit([job("x", mem=40 * GIB), job("y", mem=40 * GIB)], one_gpu(), {}, 0.0)
    assert [a.client_id for a in admits] == ["x"]


def test_best_sharing_benefit_prefers_headroom_and_idle_gpus() -> None:
    busy = observation(
        (online(mem=4 * GIB), offline("o1", mem=4 * GIB)), gpu=gpu_uuid(0), index=0, sm_active=90.0
    )
    idle = observation((online(mem=4 * GIB),), gpu=gpu_uuid(1), index=1, sm_active=20.0)
    (a,) = admit([job("j")], gpus(busy, idle), {}, 0.0)
    assert a.gpu_uuid == gpu_uuid(1)
    assert "slowdown" in a.reason
    # With equal headroom, the GPU without offline co-runners wins (SJF-BSBF: idle GPUs first).
    busy2 = observation(
        (online(mem=4 * GIB), offline("o1", mem=4 * GIB)), gpu=gpu_uuid(0), index=0, sm_active=20.0
    )
    (b,) = admit([job("j", sm_pct=50.0)], gpus(busy2, idle), {}, 0.0)
    assert b.gpu_uuid == gpu_uuid(1)


def test_admitted_share_is_the_gpu_share_capped_by_the_job_and_gpu_ceiling() -> None:
    obs = one_gpu(offline_max=60.0)
    (a,) = admit([job("a")], obs, {gpu_uuid(0): 40.0}, 0.0)
    assert a.sm_pct == 40.0
    (b,) = admit([job("b", sm_pct=25.0)], obs, {gpu_uuid(0): 40.0}, 0.0)
    assert b.sm_pct == 25.0
    (c,) = admit([job("c")], obs, {gpu_uuid(0): 90.0}, 0.0)
    assert c.sm_pct == 60.0


def test_backoff_lost_closed_fault_and_unknown_memory_keep_jobs_waiting() -> None:
    result = plan([job("later", not_before=30.0)], one_gpu(), {}, now=10.0)
    assert result.admits == () and "backing off" in result.waiting["later"]
    for kwargs, words in (
        ({"lost": True}, "the GPU is lost"),
        ({"admissions_open": False}, "admissions closed"),
        ({"mps_state": MpsState.FAULT}, "MPS is fault"),
        ({"mem_total": None}, "free memory unknown"),
    ):
        result = plan([job("j")], one_gpu(**kwargs), {}, now=0.0)
        assert result.admits == (), kwargs
        assert words in result.waiting["j"], (kwargs, result.waiting)


def test_mps_client_slots_count_the_probe_and_this_round() -> None:
    clients = (online(mem=1 * GIB), offline("o", mem=1 * GIB))
    # 4 slots: probe + 2 live clients leave one.
    admits = admit([job("a"), job("b")], one_gpu(clients=clients), {}, 0.0, max_clients=4)
    assert [a.client_id for a in admits] == ["a"]
    result = plan([job("a")], one_gpu(clients=clients), {}, 0.0, max_clients=3)
    assert "all 3 MPS client slots are taken (2 clients + the latency probe)" in result.waiting["a"]


def test_foreign_uid_is_not_placed_without_multiuser_d11() -> None:
    obs = one_gpu(clients=(online(uid=1000, mem=1 * GIB),))
    result = plan([job("other", uid=2000)], obs, {}, 0.0)
    assert result.admits == ()
    assert "uid 1000" in result.waiting["other"] and "multiuser" in result.waiting["other"]
    # Same uid is fine, and with -multiuser-server any uid is.
    assert admit([job("same", uid=1000)], obs, {}, 0.0)
    assert admit([job("other", uid=2000)], obs, {}, 0.0, multiuser=True)
    # Two uids in one round: the second is kept off the GPU the first just took.
    empty = one_gpu(clients=())
    admits = admit([job("u1", uid=1, duration=1.0), job("u2", uid=2, duration=2.0)], empty, {}, 0)
    assert [a.client_id for a in admits] == ["u1"]
    # A finished client of another uid does not count.
    gone = one_gpu(clients=(online(uid=1000, state=ClientState.EXITED),))
    assert admit([job("other", uid=2000)], gone, {}, 0.0)


def test_foreign_uid_goes_to_a_gpu_without_a_foreign_server() -> None:
    mine = observation((online(uid=5, mem=1 * GIB),), gpu=gpu_uuid(0), index=0, sm_active=0.0)
    free = observation((), gpu=gpu_uuid(1), index=1, sm_active=90.0)
    (a,) = admit([job("j", uid=7)], gpus(mine, free), {}, 0.0)
    assert a.gpu_uuid == gpu_uuid(1)


def test_requested_gpu_is_respected_by_uuid_or_index() -> None:
    g0 = observation((), gpu=gpu_uuid(0), index=0, sm_active=90.0)
    g1 = observation((), gpu=gpu_uuid(1), index=1, sm_active=0.0)
    (a,) = admit([job("j", gpu="0")], gpus(g0, g1), {}, 0.0)
    assert a.gpu_uuid == gpu_uuid(0)
    (b,) = admit([job("j", gpu=gpu_uuid(0))], gpus(g0, g1), {}, 0.0)
    assert b.gpu_uuid == gpu_uuid(0)
    result = plan([job("j", gpu="7")], gpus(g0, g1), {}, 0.0)
    assert "no shared GPU matches --gpu 7" in result.waiting["j"]


def test_a_job_admitted_last_tick_holds_its_mem_until_nvml_shows_it() -> None:
    # 80 GiB GPU, online holds 10, reserve 2: 68 GiB for offline work. x and y fit alone, not both.
    (first,) = admit([job("x", mem=40 * GIB)], one_gpu(), {}, now=0.0)
    assert first.gpu_uuid == gpu_uuid(0)
    # The next tick, 100 ms later: x is starting and has no CUDA context yet, so NVML's free
    # memory is what it was. Its --mem is promised to it all the same (docs/design.md D12).
    x = offline("x", state=ClientState.STARTING, mem=None, mem_limit=40 * GIB, started=0.0)
    after = one_gpu(clients=(online(mem=10 * GIB), x))
    assert after[gpu_uuid(0)].sample.mem_free_bytes == 70 * GIB
    result = plan([job("y", mem=40 * GIB)], after, {}, now=0.1)
    assert result.admits == ()
    assert "after 40G promised" in result.waiting["y"], result.waiting
    # With a second GPU, y goes there, though x's GPU predicts the smaller slowdown on NVML alone.
    other = observation(
        (online(mem=10 * GIB), offline("o", mem=8 * GIB)), gpu=gpu_uuid(1), index=1, sm_active=90.0
    )
    (second,) = admit([job("y", mem=40 * GIB)], gpus(after[gpu_uuid(0)], other), {}, now=0.1)
    assert second.gpu_uuid == gpu_uuid(1)


def test_a_promise_counts_only_what_nvml_does_not_show_and_only_while_it_may() -> None:
    # x's context holds 30 GiB of its 40 GiB --mem: free 80 - 10 - 30 = 40, 10 GiB still promised,
    # so 40 - 10 - 2 (reserve) = 28 GiB are left.
    x = offline("x", state=ClientState.RUNNING, mem=30 * GIB, mem_limit=40 * GIB, started=0.0)
    obs = one_gpu(clients=(online(mem=10 * GIB), x))
    assert [a.client_id for a in admit([job("y", mem=28 * GIB)], obs, {}, now=5.0)] == ["y"]
    assert admit([job("y", mem=28 * GIB + 1)], obs, {}, now=5.0) == []
    # Promises and this round's placements add up: x's 10 GiB, then a's 20, leave 8 for b.
    both = [job("a", mem=20 * GIB, duration=1.0), job("b", mem=9 * GIB, duration=2.0)]
    assert [a.client_id for a in admit(both, obs, {}, now=5.0)] == ["a"]
    # A minute after x started, NVML's reading stands alone (where it cannot attribute memory to
    # processes, the double count ends there): 70 - 2 GiB are left, as NVML says.
    unseen = offline("x", state=ClientState.RUNNING, mem=None, mem_limit=40 * GIB, started=0.0)
    late = one_gpu(clients=(online(mem=10 * GIB), unseen))
    assert admit([job("y", mem=68 * GIB)], late, {}, now=59.0) == []
    assert [a.client_id for a in admit([job("y", mem=68 * GIB)], late, {}, now=60.0)] == ["y"]
