"""The NVML adapter against a pynvml-shaped fake: error policy, time-boxing, versions, events."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from bench.support import fake_nvml
from bench.support.fake_nvml import GIB, MIB, FakeNvmlLib, uuid_of
from gpushare.model import GpuEvent, SmPeriod
from gpushare.node.nvml import NvmlBackend
from gpushare.node.nvml_errors import NvmlError, NvmlInitError
from tests.fakes.fake_clock import ManualClock


@pytest.fixture
def backends() -> Iterator[list[NvmlBackend]]:
    made: list[NvmlBackend] = []
    yield made
    for b in made:
        b.close()


def make(backends: list[NvmlBackend], lib: FakeNvmlLib, **kw: object) -> NvmlBackend:
    kw.setdefault("events", False)
    b = NvmlBackend(nvml=lib, **kw)  # type: ignore[arg-type]
    backends.append(b)
    return b


def test_healthy_snapshot_has_every_reading(backends: list[NvmlBackend]) -> None:
    clock = ManualClock(1000.0)
    b = make(backends, fake_nvml.healthy(2), clock=clock)
    first = b.sample()
    assert [s.index for s in first] == [0, 1]
    s = first[0]
    assert s.uuid == uuid_of(0)
    assert s.name == "NVIDIA H100 80GB HBM3"
    assert s.sm_count == 132
    assert (s.mem_total_bytes, s.mem_used_bytes, s.mem_free_bytes) == (80 * GIB, 10 * GIB, 70 * GIB)
    assert (s.gpu_util_pct, s.mem_util_pct) == (40.0, 20.0)
    assert (s.temperature_c, s.power_mw, s.sm_clock_mhz, s.throttle_reasons) == (
        45,
        250_000,
        1980,
        0,
    )
    # The MPS server (compute list) and both MPS clients, by pid.
    assert [(p.pid, p.used_bytes) for p in s.processes] == [
        (100, 30 * MIB),
        (201, 2 * GIB),
        (202, 3 * GIB),
    ]
    assert s.error is None
    assert not s.lost
    # GPM needs two samples >= 100 ms apart: nothing on the first tick.
    assert s.sm_active_pct is None
    clock.t += 0.05
    assert b.sample()[0].sm_active_pct is None
    clock.t += 0.06
    assert b.sample()[0].sm_active_pct == 33.0


def test_gpm_samples_are_freed_and_reused(backends: list[NvmlBackend]) -> None:
    clock = ManualClock(1000.0)
    lib = fake_nvml.healthy(1)
    b = make(backends, lib, clock=clock)
    for _ in range(5):
        b.sample()
        clock.t += 0.2
    # One live sample is kept as the next tick's sample1; every other one was freed.
    assert lib.count("nvmlGpmSampleAlloc") == 5
    assert lib.count("nvmlGpmSampleFree") == 4


def test_gpu_lost_is_a_value_not_an_outage(backends: list[NvmlBackend]) -> None:
    b = make(backends, fake_nvml.gpu_lost(n=2, lost=1))
    with capture_logs() as logs:
        s0, s1 = b.sample()
    assert s1.lost
    assert s1.error is not None
    assert "gpu lost" in s1.error
    assert s1.uuid == uuid_of(1)
    assert s1.mem_used_bytes is None
    assert not s0.lost
    assert s0.error is None
    assert s0.mem_used_bytes == 10 * GIB
    assert any(e["event"] == "gpu_lost" and e["gpu"] == uuid_of(1) for e in logs)


def test_unknown_error_also_marks_lost(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    lib.fail[("nvmlDeviceGetUtilizationRates", 0)] = fake_nvml.UNKNOWN
    (s,) = make(backends, lib).sample()
    assert s.lost
    assert "nvmlDeviceGetUtilizationRates" in (s.error or "")


def test_not_supported_everywhere_gives_none_and_logs_once(backends: list[NvmlBackend]) -> None:
    b = make(backends, fake_nvml.not_supported_everywhere(1))
    with capture_logs() as logs:
        for _ in range(3):
            (s,) = b.sample()
    assert s.error is None
    assert not s.lost
    assert s.mem_used_bytes == 10 * GIB  # memory is always supported
    for name in (
        "sm_count",
        "gpu_util_pct",
        "sm_active_pct",
        "temperature_c",
        "power_mw",
        "sm_clock_mhz",
        "throttle_reasons",
    ):
        assert getattr(s, name) is None, name
    assert s.processes == ()
    power = [e for e in logs if e.get("function") == "nvmlDeviceGetPowerUsage"]
    assert len(power) == 1
    assert power[0]["event"] == "nvml_not_supported"
    assert b.get_compute_mode(uuid_of(0)) is None


def test_other_errors_empty_one_reading_and_name_it(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    lib.fail[("nvmlDeviceGetPowerUsage", 0)] = fake_nvml.INSUFFICIENT_POWER
    (s,) = make(backends, lib).sample()
    assert s.power_mw is None
    assert not s.lost
    assert s.error is not None
    assert s.error.startswith("nvmlDeviceGetPowerUsage:")
    assert s.temperature_c == 45  # the rest of the GPU is still read


def test_pid_vanished_keeps_the_pid_with_unknown_memory(backends: list[NvmlBackend]) -> None:
    (s,) = make(backends, fake_nvml.pid_vanished()).sample()
    assert (999_999, None) in [(p.pid, p.used_bytes) for p in s.processes]
    assert s.error is None


def test_old_driver_falls_back_once_and_remembers(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.old_driver()
    b = make(backends, lib)
    for _ in range(3):
        (s,) = b.sample()
    assert [p.pid for p in s.processes] == [100, 201, 202]
    assert s.temperature_c == 45
    assert s.throttle_reasons == 0
    assert s.sm_count is None
    assert s.sm_active_pct is None
    assert b.chosen_variant("compute_processes") == "nvmlDeviceGetComputeRunningProcesses_v2"
    assert b.chosen_variant("temperature") == "nvmlDeviceGetTemperature"
    assert b.chosen_variant("clock_reasons") == "nvmlDeviceGetCurrentClocksThrottleReasons"
    # Probed once: the missing _v3 was tried on the first tick only.
    assert lib.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    assert lib.count("nvmlDeviceGetComputeRunningProcesses_v2") == 3
    assert lib.count("nvmlDeviceGetTemperatureV") == 1


def test_a_hanging_call_does_not_delay_the_tick_beyond_its_bound(
    backends: list[NvmlBackend],
) -> None:
    lib = fake_nvml.hanging_call(n=2, index=0)
    bound = 0.2
    b = make(backends, lib, call_timeout_s=bound)
    b.open()
    try:
        t0 = time.monotonic()
        s0, s1 = b.sample()
        took = time.monotonic() - t0
        # Slack for a loaded CI machine; without the time-box this call would block for 60 s.
        assert took < bound + 0.5, took
        assert lib.hung.is_set()
        assert s0.lost
        assert (s0.error or "").startswith("nvml call timed out")
        assert "nvmlDeviceGetPowerUsage" in (s0.error or "")
        assert not s1.lost
        assert s1.power_mw == 250_000
        # The next tick answers at once for the stuck GPU and queues nothing more to it.
        reads_before = lib.count("nvmlDeviceGetMemoryInfo")
        t0 = time.monotonic()
        s0, s1 = b.sample()
        assert time.monotonic() - t0 < bound + 0.5
        assert s0.lost
        assert (s0.error or "").startswith("nvml call timed out")
        assert lib.count("nvmlDeviceGetMemoryInfo") == reads_before + 1  # GPU 1 only
        with pytest.raises(NvmlError, match="timed out"):
            b.set_compute_mode(uuid_of(0), "exclusive_process")
        assert b.get_compute_mode(uuid_of(0)) is None  # unreadable while stuck
    finally:
        # The driver unwedges: the stuck call returns, and the GPU is read again.
        del lib.fail[("nvmlDeviceGetPowerUsage", 0)]
        lib.release()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s0, _ = b.sample()
        if not s0.lost:
            break
        time.sleep(0.02)
    assert not s0.lost
    assert s0.power_mw == 250_000


def test_init_failure_carries_a_hint_and_sample_stays_quiet(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    lib.init_error = fake_nvml.LIBRARY_NOT_FOUND
    b = make(backends, lib)
    with pytest.raises(NvmlInitError, match="HINT: .*install the driver"):
        b.open()
    assert b.sample() == ()
    # sample() does not hammer a broken driver: the failed init is retried only after a while.
    assert lib.count("nvmlInit") == 1


def test_init_that_hangs_is_time_boxed(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    lib.fail[("nvmlInit", None)] = fake_nvml.HANG
    b = make(backends, lib, init_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(NvmlInitError, match="persistence mode"):
        b.open()
    assert time.monotonic() - t0 < 2.0
    # Retrying while the first nvmlInit is still stuck queues nothing more to the driver.
    with pytest.raises(NvmlInitError, match="did not initialise"):
        b.open()
    assert lib.count("nvmlInit") == 1
    # The driver wakes up: the stuck attempt's result (here a failure) is taken, then a retry works.
    del lib.fail[("nvmlInit", None)]
    lib.release()
    wait_until = time.monotonic() + 5
    while time.monotonic() < wait_until:
        try:
            b.open()
            break
        except NvmlInitError:
            time.sleep(0.02)
    assert len(b.sample()) == 1


def test_xid_events_are_read_on_their_own_thread(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(2)
    b = make(backends, lib, events=True, event_wait_ms=50, wall_clock=lambda: 42.0)
    b.open()
    lib.events.put((1, 79))
    lib.events.put((0, 13))
    got: list[GpuEvent] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got.extend(b.drain_events())
        time.sleep(0.01)
    assert got == [
        GpuEvent(gpu_uuid=uuid_of(1), xid=79, at_s=42.0, fatal=True),
        GpuEvent(gpu_uuid=uuid_of(0), xid=13, at_s=42.0, fatal=False),
    ]
    assert sorted(lib.registered) == [0, 1]
    assert b.drain_events() == ()
    b.close()
    assert lib.shutdown_calls == 1
    assert lib.count("nvmlEventSetFree") == 1


def test_compute_mode_get_and_set(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(2)
    b = make(backends, lib)
    assert b.get_compute_mode(uuid_of(1)) == "default"
    b.set_compute_mode(uuid_of(1), "exclusive_process")
    assert lib.compute_mode_sets == [(1, 3)]
    assert b.get_compute_mode(uuid_of(1)) == "exclusive_process"
    b.set_compute_mode(uuid_of(1), "default")
    assert b.get_compute_mode(uuid_of(1)) == "default"
    with pytest.raises(ValueError, match="'exclusive_process'"):
        b.set_compute_mode(uuid_of(1), "exclusive")
    with pytest.raises(NvmlError, match="no GPU with UUID GPU-nope"):
        b.set_compute_mode("GPU-nope", "default")
    lib.fail[("nvmlDeviceSetComputeMode", None)] = fake_nvml.NO_PERMISSION
    with pytest.raises(NvmlError, match="needs root"):
        b.set_compute_mode(uuid_of(0), "exclusive_process")
    assert lib.compute_mode_sets == [(1, 3), (1, 0)]


def test_not_supported_setter_is_an_error(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    lib.fail[("nvmlDeviceSetComputeMode", None)] = fake_nvml.NOT_SUPPORTED
    b = make(backends, lib)
    with pytest.raises(NvmlError) as info:
        b.set_compute_mode(uuid_of(0), "exclusive_process")
    assert info.value.code == fake_nvml.NOT_SUPPORTED


def test_close_is_idempotent_and_final(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    b = make(backends, lib)
    b.sample()
    b.close()
    b.close()
    assert lib.shutdown_calls == 1
    assert b.sample() == ()


def test_process_utilisation_is_read_as_sampling_periods(backends: list[NvmlBackend]) -> None:
    """nvmlDeviceGetProcessUtilization: records newer than the last seen, grouped by timestamp."""
    wall = 5000.0
    lib = fake_nvml.healthy(1)
    g = lib.gpus[0]
    us = 1_000_000
    g.proc_util = [
        (int(3000.0 * us), 201, 50, 5),  # older than the first look-back (1 s): never read
        (int(4999.5 * us), 201, 40, 5),
        (int(4999.5 * us), 202, 10, 5),
        (int(4999.7 * us), 202, 0, 3),  # memory only: a period in which nobody used the SMs
    ]
    b = make(backends, lib, wall_clock=lambda: wall)
    (s,) = b.sample()
    assert s.sm_periods == (SmPeriod(4999.5, (201, 202)), SmPeriod(4999.7, ()))
    # Only what is newer than the newest record read; nothing newer is NOT_FOUND: no period.
    (s,) = b.sample()
    assert s.sm_periods == ()
    g.proc_util.append((int(5000.1 * us), 202, 30, 1))
    (s,) = b.sample()
    assert s.sm_periods == (SmPeriod(5000.1, (202,)),)
    assert s.error is None


def test_process_utilisation_quirks_and_unsupported(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(2)
    # pynvml raises a bare NVMLError(0) when the size query succeeds: no samples either.
    lib.fail[("nvmlDeviceGetProcessUtilization", 0)] = 0
    lib.fail[("nvmlDeviceGetProcessUtilization", 1)] = fake_nvml.NOT_SUPPORTED  # e.g. MIG
    b = make(backends, lib)
    for _ in range(3):
        s0, s1 = b.sample()
        assert (s0.sm_periods, s0.error) == ((), None)
        assert (s1.sm_periods, s1.error) == (None, None)
    # Unsupported is asked once (it never will be), the other GPU every tick.
    assert lib.count("nvmlDeviceGetProcessUtilization") == 3 + 1


def test_sample_carries_the_compute_mode(backends: list[NvmlBackend]) -> None:
    lib = fake_nvml.healthy(1)
    b = make(backends, lib)
    assert b.sample()[0].compute_mode == "default"
    lib.gpus[0].compute_mode = 3
    assert b.sample()[0].compute_mode == "exclusive_process"
    lib.fail[("nvmlDeviceGetComputeMode", 0)] = fake_nvml.NOT_SUPPORTED
    assert b.sample()[0].compute_mode is None
