"""What the run loop observes and tells the probe: clients and limits, time-slicing, whether offline
work runs, and which signal judges an online client (its app p99, else the probe).

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import time

import pytest

from gpushare.daemon.core import Daemon
from gpushare.daemon.drain import DEEP_DRAIN_S
from gpushare.latency.p99 import LatencyP99
from gpushare.model import ProbeReading, SetDuty
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.fakes.fake_probe import FakeProbe
from tests.support.actions_daemon import BUSY, GPU0, ROOT, _submit


def test_observation_carries_clients_and_limits(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, policy, _ = env
    r = _submit(d, ["sleep", "30"], sm_pct=25.0, mem_bytes=1 << 30)
    d.run(max_ticks=1)
    obs = next(o for o in policy.seen if o.gpu_uuid == GPU0)
    (view,) = obs.offline()
    assert (view.client_id, view.pid, view.limits.sm_pct, view.limits.pinned_mem_bytes) == (
        r["client_id"], r["pid"], 25.0, 1 << 30,
    )  # fmt: skip
    assert view.limits.priority == 1
    assert obs.mem_reserve_bytes == 2 << 30
    assert obs.admissions_open


def _recording_probe() -> FakeProbe:
    """A probe with no readings: the tests look at what the daemon tells it (``offline``)."""
    return FakeProbe([(0.0, 0.05)], fixed=ProbeReading(reason="test: no reading"))


def test_probe_is_told_offline_work_runs_under_a_partial_duty(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    """Frozen at the tick's start is not idle: under duty 0.5 offline work runs every period.

    The probe learns its baseline only while told offline work is quiet, so a wrong "quiet"
    would teach it contended latencies as the baseline. Frozen for good, a deep-queue client is
    quiet once its queued kernels can have drained: with no per-process reading (this fake GPU),
    the bound of gpushare.daemon.drain after the freeze.
    """
    d, policy, _ = env
    probe = _recording_probe()
    d.state.probe = probe
    _submit(d, BUSY)
    policy.pending = [SetDuty(GPU0, 0.5, "test")]
    d.run(max_ticks=4)
    assert probe.offline[GPU0][-3:] == [True, True, True]
    policy.pending = [SetDuty(GPU0, 0.0, "test")]
    frozen_at = time.monotonic()
    d.run(max_ticks=3)
    assert probe.offline[GPU0][-1] is True  # draining: 0.3 s < DEEP_DRAIN_S
    d.run(max_ticks=round(DEEP_DRAIN_S / 0.1))
    assert time.monotonic() - frozen_at >= DEEP_DRAIN_S
    assert probe.offline[GPU0][-1] is False
    policy.pending = [SetDuty(GPU0, 1.0, "test")]
    d.run(max_ticks=2)
    assert probe.offline[GPU0][-1] is True


def test_probe_quiet_waits_for_the_frozen_clients_sm_use_to_end(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    """Issue 15, difference 1: a frozen client's queued kernels still run; NVML shows when not.

    Once the driver has listed the client's pid using the SMs, the samples are quiet from the
    first period after the freeze that no longer lists it, well before the bound.
    """
    d, policy, _ = env
    gpu = d.state.gpu
    assert isinstance(gpu, FakeGpuBackend)
    probe = _recording_probe()
    d.state.probe = probe
    r = _submit(d, BUSY)
    pid = d.registry.get(r["client_id"]).pid
    assert pid is not None
    online_pid = 4242  # someone else keeps using the SMs, so the driver's periods go on
    gpu.sm_busy = {pid, online_pid}
    d.run(max_ticks=2)
    policy.pending = [SetDuty(GPU0, 0.0, "test")]
    frozen_at = time.monotonic()
    d.run(max_ticks=4)
    assert probe.offline[GPU0][-3:] == [
        True,
        True,
        True,
    ]  # frozen, but the driver still sees it busy
    gpu.sm_busy = {online_pid}
    d.run(max_ticks=2)
    assert probe.offline[GPU0][-1] is False
    assert time.monotonic() - frozen_at < DEEP_DRAIN_S  # the evidence, not the bound


def test_observation_says_whether_the_driver_time_slices_the_gpu(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    """Default compute mode on a GPU the MPS supervisor puts in exclusive-process: no MPS there."""
    d, policy, _ = env
    gpu = d.state.gpu
    assert isinstance(gpu, FakeGpuBackend)
    for mode, sliced in (("default", True), ("exclusive_process", False), (None, False)):
        gpu.compute_mode = mode
        policy.seen.clear()
        d.run(max_ticks=1)
        assert {o.time_sliced for o in policy.seen} == {sliced}, mode


def _ratio_probe() -> FakeProbe:
    return FakeProbe([(0.0, 0.05)], fixed=ProbeReading(latency_ms=2.7, baseline_ms=1.5, ratio=1.8))


def test_online_client_without_reports_is_judged_by_the_probe(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, _, _ = env
    d.state.probe = _ratio_probe()
    web = _submit(d, ["sleep", "30"], cls="online", slo_p99_ms=40.0)
    d.run(max_ticks=1)
    st = d.api.status(ROOT, {"gpu": "0"})
    lat = next(c for c in st["clients"] if c["id"] == web["client_id"])["latency"]
    assert (lat["p99_ms"], lat["source"]) == (None, "probe")
    assert lat["ratio"] == pytest.approx(1.8 / d.config.control.probe_slo_ratio)
    assert st["gpus"][0]["online_slo"]["probe_ratio"] == 1.8
    assert st["gpus"][0]["online_slo"]["state"] == "degraded"  # the probe over its SLO


def test_online_slo_follows_the_app_p99_over_the_probe_where_there_is_one(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    # The demo showed "degraded" at p99/SLO 0.49: the probe (2.5x its baseline with gated
    # offline work between requests) overrode the service's own p99.
    d, _, _ = env
    d.state.probe = _ratio_probe()
    web = _submit(d, ["sleep", "30"], cls="online", slo_p99_ms=40.0)
    d.run(max_ticks=1)
    d.state.p99 = {web["client_id"]: LatencyP99(p99_ms=19.6, samples=100, source="app")}
    slo = d.api.status(ROOT, {"gpu": "0"})["gpus"][0]["online_slo"]
    assert (slo["state"], slo["violating_clients"]) == ("ok", [])
    # A second online client without a p99 of its own: the probe speaks for it.
    _submit(d, ["sleep", "30"], cls="online", slo_p99_ms=40.0)
    d.run(max_ticks=1)
    d.state.p99 = {web["client_id"]: LatencyP99(p99_ms=19.6, samples=100, source="app")}
    slo = d.api.status(ROOT, {"gpu": "0"})["gpus"][0]["online_slo"]
    assert slo["state"] == "degraded"
