"""Bounded in-flight mode (``GPUSHARE_MAX_INFLIGHT=k``, the interposer; docs/simulator.md W3b).

Hand-made kernels whose timing follows from the rule (source kernel ``j`` launches the wake
latency after kernel ``j - k`` completed), a real training profile against the source-level
timeline, freezes mid-iteration, and the launch environment and scenario key that select it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpushare.sim import data
from gpushare.sim import scenario as sc_mod
from gpushare.sim.inflight import (
    DEFAULT_INFLIGHT_WAKE_S,
    INFLIGHT_NAP_LAG_S,
    INFLIGHT_SPIN_S,
    bound_tables,
    bounded_timeline,
    launch_queue,
    source_durations,
)
from gpushare.sim.workloads import FREEZE_S, THAW_S, request_alone_s
from tests.sim.test_sim_gating import _scenario, _started
from tests.sim.test_sim_physics import US, gpu_with_beta0, profile, trainer


def _alone(prof: data.KernelProfile, bound: int, wake_s: float, iterations: int = 1) -> list[float]:
    loop, gpu = gpu_with_beta0()
    t = trainer(gpu, prof)
    t.set_inflight(bound, wake_s)
    t.start(0.0)
    loop.run_until(iterations * (prof.total_s + len(prof) * 1e-3))
    return t.iterations[:iterations]


def test_with_two_in_flight_kernels_longer_than_the_wake_hide_it() -> None:
    # Kernel j launches 5 us after kernel j-2 ended, i.e. while kernel j-1 (20 us) still runs.
    prof = profile(*[(20.0, 40)] * 10)
    assert _alone(prof, 2, 5 * US) == [pytest.approx(200 * US, rel=1e-9)]
    assert _alone(prof, 4, 5 * US) == [pytest.approx(200 * US, rel=1e-9)]


def test_with_one_in_flight_every_kernel_after_the_first_pays_the_wake() -> None:
    prof = profile(*[(20.0, 40)] * 10)
    # The iteration's first launch follows its start (the sync before it is free, as when deep).
    assert _alone(prof, 1, 5 * US, iterations=2) == [
        pytest.approx((200 + 9 * 5) * US, rel=1e-9),
        pytest.approx(2 * (200 + 9 * 5) * US, rel=1e-9),
    ]


def test_short_kernels_expose_what_the_queue_cannot_hide() -> None:
    # 2 us kernels with k = 2: kernel j launches 5 us after j-2 ended, j+1 5 us after j-1 ended
    # (2 us later): after the first two, two kernels every 5 + 2 us.
    prof = profile(*[(2.0, 1)] * 10)
    _, done = bounded_timeline([2 * US] * 10, 2, 5 * US)
    assert done[-1] == pytest.approx((2 * 2 + 4 * (5 + 2)) * US)
    assert _alone(prof, 2, 5 * US) == [pytest.approx(done[-1], rel=1e-9)]


@pytest.mark.parametrize("bound", [1, 2, 4])
def test_a_merged_training_profile_alone_matches_its_source_kernel_timeline(bound: int) -> None:
    # Chunks of up to 100 us of source kernels (G11): the stalls the bound gives each chunk's
    # source kernels are paid before it, so alone the iteration takes the source-level time.
    prof = data.load_profile(
        "orion-v100-kernels/transformer_xl_8_fb1.csv", data.DEFAULT_MERGE_OFFLINE_US
    )
    assert prof.source_kernels > 2 * len(prof)  # really merged
    flat = [d for part in source_durations(prof) for d in part]
    _, done = bounded_timeline(flat, bound, DEFAULT_INFLIGHT_WAKE_S)
    assert bound_tables(prof, bound, DEFAULT_INFLIGHT_WAKE_S).alone_s == pytest.approx(done[-1])
    (it,) = _alone(prof, bound, DEFAULT_INFLIGHT_WAKE_S)
    assert it == pytest.approx(done[-1], rel=1e-9)
    _, gpu = gpu_with_beta0()
    t = trainer(gpu, prof)
    t.set_inflight(bound)  # the default wake
    assert t.inflight_cost() == pytest.approx(it / prof.total_s)
    assert it > prof.total_s * 1.001  # the wake costs something on this profile
    if bound == 1:
        # One in flight: every source kernel after the first pays the wake, and the nap's lag
        # after a kernel longer than the spin (the CPU waited all of it).
        naps = sum(1 for d in flat[:-1] if d > INFLIGHT_SPIN_S)
        assert naps > 0
        assert it == pytest.approx(
            prof.total_s + (len(flat) - 1) * DEFAULT_INFLIGHT_WAKE_S + naps * INFLIGHT_NAP_LAG_S
        )


def test_a_wait_past_the_spin_sees_the_completion_a_nap_late() -> None:
    # k = 2: kernel 2 waits for kernel 0 (2 ms: past the 1 ms spin, so the interposer naps and
    # sees its end 50 us late); kernel 1 (20 us) cannot hide that, the later waits are short.
    prof = profile((2000.0, 40), *[(20.0, 40)] * 5)
    expected = (2000 + 50 + 5 + 20 * 4) * US  # kernel 2 launched at 2055 us, then back to back
    assert _alone(prof, 2, 5 * US) == [pytest.approx(expected, rel=1e-9)]


def test_a_training_host_cost_is_hidden_only_within_the_bound() -> None:
    # 2 kernels of 100 us, then 8 of 5 us, the CPU 20 us per kernel: deep, the CPU runs ahead
    # during the long ones; with k = 2 it can be only 2 ahead and its 20 us show per short kernel.
    prof = profile(*[(100.0, 40)] * 2, *[(5.0, 40)] * 8)
    durs = [100 * US] * 2 + [5 * US] * 8
    loop, gpu = gpu_with_beta0()
    deep = trainer(gpu, prof)
    deep.set_host_cost(20 * US)
    deep.start(0.0)
    loop.run_until(5e-3)
    assert deep.iterations[0] == pytest.approx(request_alone_s(prof, 20 * US), rel=1e-9)
    loop, gpu = gpu_with_beta0()
    bounded = trainer(gpu, prof)
    bounded.set_host_cost(20 * US)
    bounded.set_inflight(2, 0.0)
    bounded.start(0.0)
    loop.run_until(5e-3)
    _, done = bounded_timeline(durs, 2, 0.0, 20 * US)
    assert bounded.iterations[0] == pytest.approx(done[-1], rel=1e-9)
    assert done[-1] > request_alone_s(prof, 20 * US) + 50 * US


def test_a_frozen_cpu_issues_nothing_more_with_a_host_cost() -> None:
    # Deep queue, 20 us of CPU per 50 us kernel: the CPU has issued the chunks up to the freeze;
    # the GPU runs those, nothing the CPU would have issued after it.
    loop, gpu = gpu_with_beta0()
    t = trainer(gpu, profile(*[(50.0, 40)] * 40))
    t.set_host_cost(20 * US)
    t.start(0.0)
    loop.run_until(0.2e-3)
    t.set_frozen(True, loop.now)
    loop.run_until(5e-3)
    issued_by_freeze = int((0.2e-3 + FREEZE_S) / (20 * US))
    assert t.counts.done <= issued_by_freeze + 1
    assert t.iterations == []
    t.set_frozen(False, loop.now)
    loop.run_until(loop.now + THAW_S + 2.1e-3)  # the rest of the iteration: < 40 x 50 us
    assert len(t.iterations) == 1


def _frozen_mid_iteration(bound: int) -> tuple[int, int, int]:
    """40 kernels of 50 us, frozen 1 ms in: kernels run after the freeze held, kernels run in
    1 ms after the thaw, iterations ended while frozen."""
    loop, gpu = gpu_with_beta0()
    t = trainer(gpu, profile(*[(50.0, 40)] * 40))
    t.set_inflight(bound, 5 * US)
    t.start(0.0)
    loop.run_until(1e-3)
    t.set_frozen(True, loop.now)
    loop.run_until(loop.now + FREEZE_S)
    held = t.counts.done
    loop.run_until(loop.now + 20e-3)  # far longer than the iteration alone (2 ms)
    ran = t.counts.done - held
    assert t.stream.run is None and t.stream.nxt is None, "nothing launched while frozen"
    ended = len(t.iterations)
    stopped = t.counts.done
    t.set_frozen(False, loop.now)
    loop.run_until(loop.now + THAW_S + 1e-3)
    return ran, t.counts.done - stopped, ended


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_a_freeze_leaves_at_most_k_launched_kernels_and_the_thaw_resumes(bound: int) -> None:
    ran, resumed, ended = _frozen_mid_iteration(bound)
    assert 1 <= ran <= bound, ran
    assert ended == 0
    assert resumed >= 10  # 1 ms of 50 us kernels after the thaw


def test_without_a_bound_the_freeze_lets_the_iteration_drain() -> None:
    ran, _, ended = _frozen_mid_iteration(0)
    assert ran > 3 and ended == 1  # the whole rest of the iteration was issued and runs


def test_bad_bounds_and_wakes_are_refused() -> None:
    _, gpu = gpu_with_beta0()
    t = trainer(gpu, profile((20.0, 40)))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="whole number >= 0"):
            t.set_inflight(bad)  # type: ignore[arg-type]
    for wake in (-1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite time >= 0"):
            t.set_inflight(2, wake)
    assert t.inflight_bound == 0


def test_the_launch_environment_selects_the_queue() -> None:
    assert launch_queue({}) == (False, 0)
    assert launch_queue({"CUDA_LAUNCH_BLOCKING": "1"}) == (True, 0)
    lib = "/opt/gpushare/native/libgpushare_inflight.so"
    assert launch_queue({"GPUSHARE_MAX_INFLIGHT": "3", "LD_PRELOAD": lib}) == (False, 3)
    assert launch_queue({"GPUSHARE_MAX_INFLIGHT": "3", "LD_PRELOAD": f"a.so:{lib} b.so"}) == (
        False,
        3,
    )
    # Not preloaded, nothing reads the variable.
    assert launch_queue({"GPUSHARE_MAX_INFLIGHT": "3"}) == (False, 0)
    assert launch_queue({"GPUSHARE_MAX_INFLIGHT": "3", "LD_PRELOAD": "libother.so"}) == (False, 0)
    # As the interposer reads it: not a whole number >= 1 is no bound.
    for bad in ("0", "-2", "two", "", "1.5"):
        assert launch_queue({"GPUSHARE_MAX_INFLIGHT": bad, "LD_PRELOAD": lib}) == (False, 0)


@pytest.mark.parametrize("shallow", ["bounded", "blocking"])
def test_the_daemons_shallow_queue_setting_reaches_the_simulated_trainer(shallow: str) -> None:
    # [gate] shallow_queue and inflight_kernels: the daemon launches the shallow client with
    # GPUSHARE_MAX_INFLIGHT=3 (or CUDA_LAUNCH_BLOCKING=1); the simulated launcher decodes it.
    sc = _scenario(duration_s=3.0)
    gate = dataclasses.replace(sc.config.gate, shallow_queue=shallow, inflight_kernels=3)
    sc = dataclasses.replace(
        sc,
        config=dataclasses.replace(sc.config, gate=gate),
        gpu=dataclasses.replace(sc.gpu, inflight_wake_s=7e-6),
    )
    node, sim = _started(sc)
    sim.run(sc.duration_s)
    sim.close()
    (t,) = node.offline
    assert t.started_at_s is not None and t.iterations
    if shallow == "bounded":
        assert not t.launch_blocking
        assert (t.inflight_bound, t.inflight_wake_s) == (3, 7e-6)
    else:
        assert t.launch_blocking and t.inflight_bound == 0


def test_the_wake_is_a_scenario_key_checked_like_the_launch_gap() -> None:
    base = sc_mod.load(_scenario().file)
    assert base.gpu.inflight_wake_s == DEFAULT_INFLIGHT_WAKE_S
    good = '[scenario]\nname = "x"\nduration = "10s"\n[gpu]\ninflight_wake = "{}"\n' + (
        '[[online]]\nname = "inf"\nprofile = "orion-v100-kernels/resnet50_4_fwd.csv"\n'
    )
    assert sc_mod.loads(good.format("8us"), "x.toml").gpu.inflight_wake_s == pytest.approx(8e-6)
    for bad in ("-5us", "soon"):
        with pytest.raises(sc_mod.ScenarioError, match=r"x.toml: gpu.inflight_wake: .*duration"):
            sc_mod.loads(good.format(bad), "x.toml")
    host = good.replace("inflight_wake", "train_host_per_kernel")
    assert sc_mod.loads(host.format("20us"), "x.toml").gpu.train_host_per_kernel_s == pytest.approx(
        20e-6
    )
    assert base.gpu.train_host_per_kernel_s == 0.0
    with pytest.raises(sc_mod.ScenarioError, match=r"gpu.train_host_per_kernel: .*duration"):
        sc_mod.loads(host.format("-1us"), "x.toml")
