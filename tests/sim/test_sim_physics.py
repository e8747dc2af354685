"""The GPU model's mechanisms, one at a time, on hand-made kernels (docs/simulator.md G5-G9, W3-W4).

Each test builds kernels whose timing follows from the rule under test, so a change to the rule
shows up as a wrong time, not as a drift in some aggregate.
"""

from __future__ import annotations

import pytest

from gpushare.sim import data
from gpushare.sim.gpu import EventLoop, Gpu
from gpushare.sim.workloads import FREEZE_S, OfflineTrainer, OnlineServer, request_alone_s

US = 1e-6


def profile(*kernels: tuple[float, int]) -> data.KernelProfile:
    """A profile of unmerged kernels given as (duration_us, SM_usage); compute-bound."""
    rows = [(d, min(u, 80), 0.0, u) for d, u in kernels]
    return data.merge_kernels(rows, 0.0, "test", 80)


def trainer(gpu: Gpu, prof: data.KernelProfile, prio: int = 1, name: str = "t") -> OfflineTrainer:
    t = OfflineTrainer(name, gpu, prof, sm_pct=100, mem_bytes=0)
    t.priority = prio
    return t


def one_request_at(
    gpu: Gpu, loop: EventLoop, prof: data.KernelProfile, at_s: float
) -> OnlineServer:
    server = OnlineServer("inf", gpu, prof, iter([at_s]), sm_pct=100, mem_bytes=0)
    gpu.attach(server)
    server.start(loop)
    return server


def gpu_with_beta0(**kw: object) -> tuple[EventLoop, Gpu]:
    loop = EventLoop()
    return loop, Gpu(loop, uuid="GPU-t", index=0, bw_beta=0.0, **kw)  # type: ignore[arg-type]


def test_higher_priority_work_takes_the_slots_at_the_next_wave_end() -> None:
    loop, gpu = gpu_with_beta0()
    # 1 ms over 400 full-occupancy SMs of 80: five waves of 200 us.
    trainer(gpu, profile((1000.0, 400))).start(0.0)
    server = one_request_at(gpu, loop, profile((10.0, 20)), 250 * US)
    loop.run_until(2e-3)
    ((arrival, latency),) = server.completed
    # Waits for the wave ending at 400 us, not for the kernel ending at 1 ms.
    assert arrival + latency == pytest.approx(410 * US, abs=1 * US)
    assert gpu.stats.wave_yields == 1


def test_a_single_wave_kernel_keeps_its_slots_to_its_end() -> None:
    loop, gpu = gpu_with_beta0()
    trainer(gpu, profile((1000.0, 80))).start(0.0)
    server = one_request_at(gpu, loop, profile((10.0, 20)), 250 * US)
    loop.run_until(2e-3)
    ((arrival, latency),) = server.completed
    assert arrival + latency == pytest.approx(1010 * US, abs=1 * US)


def test_equal_priority_waits_for_the_partial_last_wave_not_for_every_wave() -> None:
    loop, gpu = gpu_with_beta0()
    # 360 SMs' worth of blocks: 4.5 waves, five of 200 us; the last fills half the slots.
    trainer(gpu, profile((1000.0, 360)), prio=0).start(0.0)
    server = one_request_at(gpu, loop, profile((10.0, 20)), 250 * US)
    loop.run_until(2e-3)
    ((arrival, latency),) = server.completed
    # Left-over rule: the earlier grid's blocks go first; the tail (from 800 us) leaves room.
    assert arrival + latency == pytest.approx(810 * US, abs=1 * US)
    assert gpu.stats.wave_yields == 0


def test_without_the_tail_equal_priority_waits_for_the_kernel() -> None:
    loop, gpu = gpu_with_beta0()
    trainer(gpu, profile((1000.0, 400)), prio=0).start(0.0)
    server = one_request_at(gpu, loop, profile((10.0, 20)), 250 * US)
    loop.run_until(2e-3)
    ((arrival, latency),) = server.completed
    assert arrival + latency == pytest.approx(1010 * US, abs=1 * US)


def test_fair_sharing_gives_an_equal_priority_waiter_slots_at_the_next_wave() -> None:
    loop, gpu = gpu_with_beta0(share="fair")
    trainer(gpu, profile((1000.0, 400)), prio=0).start(0.0)
    server = one_request_at(gpu, loop, profile((10.0, 20)), 250 * US)
    loop.run_until(2e-3)
    ((arrival, latency),) = server.completed
    assert arrival + latency == pytest.approx(410 * US, abs=1 * US)


def test_the_next_kernel_of_a_completing_stream_does_not_get_its_slots_first() -> None:
    loop, gpu = gpu_with_beta0()
    t = trainer(gpu, profile((1000.0, 400)))  # priority 1, five waves of 200 us
    # The request's first kernel holds every slot; when it ends, the trainer's pending blocks
    # take the slots before the request's second kernel is dispatchable.
    server = one_request_at(gpu, loop, profile((100.0, 80), (10.0, 80)), 0.0)
    loop.at(50 * US, lambda _: t.start(loop.now))
    loop.run_until(3e-3)
    ((_, latency),) = server.completed
    # Kernel 1 ends at 100 us; the trainer starts then, its first wave ends at 300 us.
    assert latency == pytest.approx(310 * US, abs=1 * US)


def test_time_slicing_preempts_a_long_kernel_and_pays_the_switch() -> None:
    loop, gpu = gpu_with_beta0(mode="time_slice", slice_s=2e-3, switch_s=100 * US)
    a = trainer(gpu, profile((10_000.0, 80)), name="a")
    b = trainer(gpu, profile((10_000.0, 80)), name="b")
    a.start(0.0)
    b.start(0.0)
    loop.run_until(40e-3)
    first_a, first_b = a.iterations[0], b.iterations[0]
    # Both 10 ms kernels alternate in 2 ms slices (mid-kernel), each switch idles 100 us:
    # a finishes its 5th slice after 4 of b's, with 9 switches before it ends.
    assert first_a == pytest.approx(9 * 2e-3 + 10 * 100 * US, rel=0.02)
    assert first_b == pytest.approx(first_a + 2e-3 + 100 * US, rel=0.02)
    assert gpu.stats.context_switches >= 10


def test_time_slicing_a_newly_runnable_context_waits_for_the_running_slice() -> None:
    # NVIDIA's host manual (docs/simulator.md section 4, "The slice rule"): the scheduler stays on
    # a TSG until its timeslice expires or it runs out of work; a TSG that gets work meanwhile
    # waits, and one that runs out of work is switched off at once.
    loop, gpu = gpu_with_beta0(mode="time_slice", slice_s=1e-3, switch_s=100 * US)
    t = trainer(gpu, profile((10_000.0, 80)))
    t.start(0.0)
    server = one_request_at(gpu, loop, profile((100.0, 80)), 300 * US)
    loop.run_until(20e-3)
    ((arrival, latency),) = server.completed
    # The trainer's slice runs 0.1-1.1 ms (after the first switch); the server's kernel runs
    # 1.2-1.3 ms, after the trainer's slice and a switch, not at its arrival.
    assert arrival + latency == pytest.approx(1.3e-3, abs=1 * US)
    # The server, out of work, hands the GPU back at once: the trainer resumes at 1.4 ms and,
    # alone, keeps the GPU for its last 9 ms.
    assert t.iterations[0] == pytest.approx(10.4e-3, abs=1 * US)
    assert gpu.stats.context_switches == 3


def test_a_freeze_bites_only_after_the_measured_freeze_latency() -> None:
    loop, gpu = gpu_with_beta0()
    iteration = profile((1000.0, 80))  # 1 ms per iteration
    late = trainer(gpu, iteration)
    late.start(0.0)
    loop.run_until(1e-3 - FREEZE_S / 2)
    late.set_frozen(True, loop.now)  # the iteration ends before the process is stopped
    loop.run_until(5e-3)
    assert len(late.iterations) == 2

    loop2, gpu2 = gpu_with_beta0()
    early = trainer(gpu2, iteration)
    early.start(0.0)
    loop2.run_until(1e-3 - 2 * FREEZE_S)
    early.set_frozen(True, loop2.now)
    loop2.run_until(5e-3)
    assert len(early.iterations) == 1


def test_launch_blocking_pays_a_gap_per_source_kernel() -> None:
    loop, gpu = gpu_with_beta0()
    prof = profile(*[(20.0, 40)] * 10)
    t = trainer(gpu, prof)
    t.launch_blocking = True
    t.launch_gap_s = 5 * US
    t.start(0.0)
    loop.run_until(1e-3)
    assert t.iterations[0] == pytest.approx(10 * (20 + 5) * US, rel=1e-9)
    assert t.blocking_cost() == pytest.approx(250 / 200)


def test_a_host_bound_request_takes_the_cpus_issue_time_plus_its_last_kernel() -> None:
    # 10 kernels of 20 us issued 50 us apart: the GPU waits for the CPU, each kernel starts when
    # issued, and the request ends 20 us after the last issue.
    loop, gpu = gpu_with_beta0()
    prof = profile(*[(20.0, 40)] * 10)
    server = one_request_at(gpu, loop, prof, 1e-3)
    server.set_host_cost(50 * US)
    loop.run_until(5e-3)
    assert server.completed[0][1] == pytest.approx((10 * 50 + 20) * US, rel=1e-9)
    assert request_alone_s(prof, 50 * US) == pytest.approx((10 * 50 + 20) * US, rel=1e-9)


def test_a_gpu_bound_request_hides_the_host_cost_behind_its_kernels() -> None:
    # A long first kernel lets the CPU run ahead: the rest start back to back after it.
    loop, gpu = gpu_with_beta0()
    prof = profile((1000.0, 40), *[(20.0, 40)] * 9)
    server = one_request_at(gpu, loop, prof, 0.0)
    server.set_host_cost(50 * US)
    loop.run_until(5e-3)
    expected = (50 + 1000 + 9 * 20) * US  # first issue, then the GPU never waits again
    assert server.completed[0][1] == pytest.approx(expected, rel=1e-9)
    assert request_alone_s(prof, 50 * US) == pytest.approx(expected, rel=1e-9)
    assert request_alone_s(prof, 0.0) == pytest.approx(prof.total_s)


def test_request_alone_matches_the_simulated_pass_of_a_merged_profile() -> None:
    # Merged chunks (several source kernels each) are issued once their last kernel is.
    prof = data.load_profile("orion-v100-kernels/transformer_xl_4_fwd.csv")
    assert sum(len(p) for p in prof.parts) > len(prof)  # the profile is merged
    loop, gpu = gpu_with_beta0()
    server = one_request_at(gpu, loop, prof, 0.0)
    server.set_host_cost(56 * US)
    loop.run_until(1.0)
    assert server.completed[0][1] == pytest.approx(request_alone_s(prof, 56 * US), rel=1e-9)
    assert request_alone_s(prof, 56 * US) > 459 * 56 * US > prof.total_s


def test_launch_blocking_adds_the_host_cost_to_the_gap() -> None:
    loop, gpu = gpu_with_beta0()
    prof = profile(*[(20.0, 40)] * 10)
    server = one_request_at(gpu, loop, prof, 0.0)
    server.launch_blocking = True
    server.launch_gap_s = 5 * US
    server.set_host_cost(30 * US)
    loop.run_until(5e-3)
    assert server.completed[0][1] == pytest.approx(10 * (20 + 5 + 30) * US, rel=1e-9)
    assert server.blocking_cost() == pytest.approx(550 / 200)


def test_a_stopped_server_issues_nothing_more() -> None:
    loop, gpu = gpu_with_beta0()
    prof = profile(*[(20.0, 40)] * 10)
    server = one_request_at(gpu, loop, prof, 0.0)
    server.set_host_cost(50 * US)
    loop.run_until(120 * US)  # two kernels issued, the third not yet
    server.stop()
    loop.run_until(5e-3)
    assert server.completed == []
    assert server.stream.nxt is None and server.stream.run is None
    c = server.counts
    assert c.done + c.discarded == c.issued == 10


def test_wave_rule_counts_waves_from_sm_usage() -> None:
    assert data.wave_s(((1000.0, 400),)) == pytest.approx(200 * US)
    assert data.wave_s(((1000.0, 80),)) == pytest.approx(1000 * US)
    assert data.wave_s(((1000.0, 400),), wave_scale=0.5) == pytest.approx(1000 / 3 * US)
    assert data.wave_tail(((1000.0, 360),)) == pytest.approx(0.5)
    assert data.wave_tail(((1000.0, 80),)) == 1.0
    # A chunk's wave length is duration-weighted: a long single-wave kernel dominates.
    assert data.wave_s(((90.0, 80), (10.0, 800))) == pytest.approx((90 * 90 + 10 * 1) / 100 * US)
