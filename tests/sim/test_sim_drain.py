"""The daemon's drain signal and the GPU's sharing mode, as the simulated node reports them.

Issue 15, difference 1: a frozen client's queued kernels keep running, so the loop marks probe
samples "quiet" only after the simulated NVML stops listing the client's process as using the
SMs. And the simulated GPU's compute mode tells the policies whether the driver time-slices it.
"""

from __future__ import annotations

from pathlib import Path

from gpushare.control.baselines import TimeSlicingPolicy
from gpushare.model import SetDuty
from gpushare.sim import adapters, runner, scenario
from gpushare.sim.node import PolicyTraits, SimNode
from gpushare.sim.workloads import OfflineTrainer
from tests.fakes.fake_policy import FixedPolicy

ORION = "orion-v100-kernels"
ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_CLIENT_PRIORITY": "1"}


def pair(duration: str = "4s") -> scenario.Scenario:
    return scenario.loads(f"""
[scenario]
name = "t"
duration = "{duration}"
warmup = "0.5s"
[[online]]
name = "inf"
profile = "{ORION}/resnet50_4_fwd.csv"
load = 0.5
[[offline]]
name = "train"
profile = "{ORION}/bert_8_fb1.csv"
submit = "0.2s"
""")


def _in_flight(train: OfflineTrainer) -> bool:
    return train.pos < len(train.profile) or train.run is not None


def test_backend_lists_a_frozen_client_until_its_queued_kernels_end() -> None:
    node = SimNode(pair())
    node.start()
    adapters.SimProcesses(node).spawn(
        ["train"], uid=1000, gid=1000, cwd="/", env=ENV, log_dir=Path("/nonexistent"),
        client_id="train",
    )  # fmt: skip
    backend = adapters.SimGpuBackend(node)
    train = node.offline[0]
    node.loop.run_until(2.0)
    backend.sample()
    node.loop.run_until(2.05)
    (s,) = backend.sample()
    assert s.compute_mode == "exclusive_process"
    assert s.sm_periods is not None
    ((period,),) = (s.sm_periods,)
    assert period.at_wall_s == 2.05
    assert train.pid in period.pids
    train.set_frozen(True, node.loop.now)
    assert _in_flight(train)  # a deep queue: the rest of the iteration is still to run
    listed_while_draining = 0
    while _in_flight(train):
        node.loop.run_until(node.loop.now + 0.005)
        (s,) = backend.sample()
        assert s.sm_periods is not None
        assert train.pid in s.sm_periods[0].pids
        listed_while_draining += 1
    assert listed_while_draining >= 2
    node.loop.run_until(node.loop.now + 0.05)
    (s,) = backend.sample()
    assert s.sm_periods is not None
    assert train.pid not in s.sm_periods[0].pids


def test_time_sliced_gpu_reads_default_compute_mode() -> None:
    node = SimNode(pair(), traits=PolicyTraits(gpu_mode="time_slice"))
    node.start()
    node.loop.run_until(0.1)
    (s,) = adapters.SimGpuBackend(node).sample()
    assert s.compute_mode == "default"


def test_probe_is_quiet_only_once_the_frozen_trainer_has_drained() -> None:
    """At every tick, "quiet" for the period just ended means nothing of the trainer was queued."""
    freezes = [1.6, 3.25, 4.85]  # the trainer starts at 1.2 s (submit + [gpu] start)
    script: list[tuple[float, object]] = []
    for t in freezes:
        script.append((t, lambda obs: [SetDuty(obs.gpu_uuid, 0.0, "test")]))
        script.append((t + 1.2, lambda obs: [SetDuty(obs.gpu_uuid, 1.0, "test")]))
    # At a 30 % share next to online work an iteration takes several ticks: so does its drain.
    policy = FixedPolicy(duty=1.0, share_pct=30.0, script=script)
    node = SimNode(pair(duration="6.5s"))
    node.start()
    sim = runner.SimDaemon(node, policy)
    probe = node.probes[node.gpus[0].uuid]
    train = node.offline[0]
    quiet_ticks = 0
    drained_late = 0

    def check(t: float) -> None:
        nonlocal quiet_ticks, drained_late
        if not probe.offline_running:
            quiet_ticks += 1
            assert not _in_flight(train), f"probe samples marked quiet at {t:.2f} s while draining"
        elif train.frozen and train.active and not _in_flight(train):
            drained_late += 1

    sim.run(6.5, check)
    sim.close()
    assert quiet_ticks >= 3 * len(freezes)  # each freeze gave quiet ticks, after its drain
    # The evidence follows the drain within two ticks (the sampling period that shows it idle
    # ends at the next tick, and the loop reads it then), far sooner than the 1 s bound.
    assert drained_late <= len(freezes) * 2


def test_time_slicing_baseline_sends_no_duty_on_a_time_sliced_gpu() -> None:
    policy = TimeSlicingPolicy()
    seen: list[bool] = []
    sent: list[str] = []
    step = policy.step

    def recording_step(state, obs, now):  # type: ignore[no-untyped-def]
        seen.append(obs.time_sliced)
        state, actions = step(state, obs, now)
        sent.extend(type(a).__name__ for a in actions)
        return state, actions

    policy.step = recording_step  # type: ignore[method-assign]
    res = runner.run_policy(pair(duration="2s"), policy)
    assert seen and all(seen)
    assert sent == ["SetOfflineShare"]  # the policy itself, not a filter, leaves the duty alone
    assert "SetDuty" not in res.actions


def test_the_simulator_applies_every_action_of_a_time_slicing_policy() -> None:
    """No filter between policy and daemon: a duty sent on a time-sliced GPU is applied."""
    policy = FixedPolicy(duty=0.0, name="time-slicing", offline_mps_priority=0)
    res = runner.run_policy(pair(duration="2s"), policy)
    assert res.actions.get("SetDuty") == 1
    assert res.offline[0].iterations == 0  # frozen from its start: the duty held it
