"""Thin adapter test: the real pynvml module, its exception classes and ctypes structs.

pynvml functions are monkeypatched (there is no driver here); everything else is pynvml's own:
``NVMLError(code)`` building its subclasses, ``NVMLLibraryMismatchError``, the GPM and event structs.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpushare.node import nvml as adapter
from gpushare.node import nvml_calls, nvml_diag, nvml_errors, nvml_events, nvml_readers
from gpushare.node.nvml import NvmlBackend
from gpushare.node.nvml_errors import NvmlInitError

UUIDS = ["GPU-aaaaaaaa-0000-4000-8000-000000000000", "GPU-bbbbbbbb-0000-4000-8000-000000000001"]


def handle(i: int) -> Any:
    # Real handle type with distinct pointer values, as the driver hands out.
    return ctypes.cast(ctypes.c_void_p(0x1000 + 0x100 * i), pynvml.c_nvmlDevice_t)


def index_of(h: Any) -> int:
    return (ctypes.cast(h, ctypes.c_void_p).value - 0x1000) // 0x100  # type: ignore[operator]


def err(code: int) -> Exception:
    return pynvml.NVMLError(code)  # type: ignore[no-any-return]


# What fake_driver hands each _patch_* helper: sets one pynvml function, which must exist.
Patch = Callable[[str, Any], None]


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """pynvml's functions answering like a driver with two GPUs; the dict it yields steers them.

    ``state["lost"]``: indexes whose memory read fails with GPU_IS_LOST; ``state["events"]``:
    ``(index, xid)`` pairs the event wait hands out, in order.
    """
    state: dict[str, Any] = {"lost": set(), "events": []}

    def patch(name: str, fn: Any) -> None:
        assert hasattr(pynvml, name), name  # only patch functions pynvml really has
        monkeypatch.setattr(pynvml, name, fn)

    _patch_devices(patch, state)
    _patch_processes(patch)
    _patch_gpm(patch)
    _patch_events(patch, state)
    return state


def _patch_devices(patch: Patch, state: dict[str, Any]) -> None:
    """Init, the two devices and their readings; a lost index fails its memory read."""
    patch("nvmlInit", lambda: None)
    patch("nvmlShutdown", lambda: None)
    patch("nvmlDeviceGetCount", lambda: 2)
    patch("nvmlDeviceGetHandleByIndex", handle)
    patch("nvmlDeviceGetUUID", lambda h: UUIDS[index_of(h)])
    patch("nvmlDeviceGetName", lambda h: b"NVIDIA H100")

    def attrs(h: Any) -> Any:
        a = pynvml.c_nvmlDeviceAttributes()
        a.multiprocessorCount = 132
        return a

    patch("nvmlDeviceGetAttributes_v2", attrs)

    def memory(h: Any) -> Any:
        if index_of(h) in state["lost"]:
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        m = pynvml.c_nvmlMemory_t()
        m.total, m.used, m.free = 100, 40, 60
        return m

    patch("nvmlDeviceGetMemoryInfo", memory)
    patch("nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=7, memory=3))
    patch("nvmlDeviceGetTemperatureV", lambda h, s: 50)
    patch("nvmlDeviceGetPowerUsage", lambda h: (_ for _ in ()).throw(err(3)))
    patch("nvmlDeviceGetClockInfo", lambda h, t: 1755)
    patch("nvmlDeviceGetCurrentClocksEventReasons", lambda h: 0x4)
    patch("nvmlDeviceGetComputeMode", lambda h: pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)


def _patch_processes(patch: Patch) -> None:
    """The running processes (only the _v2 call exists) and per-process utilization samples."""

    def v3(h: Any) -> Any:
        raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def procs(h: Any) -> Any:
        return [SimpleNamespace(pid=300 + index_of(h), usedGpuMemory=None)]

    patch("nvmlDeviceGetComputeRunningProcesses_v3", v3)
    patch("nvmlDeviceGetComputeRunningProcesses_v2", procs)
    patch("nvmlDeviceGetMPSComputeRunningProcesses_v3", lambda h: [])
    patch("nvmlDeviceGetMPSComputeRunningProcesses_v2", lambda h: [])

    def process_util(h: Any, since_us: int) -> Any:
        # pynvml's own return: a slice of a ctypes array, one record per busy process and period
        stamp = int(time.time() * 1e6) + 1_000
        samples = (pynvml.c_nvmlProcessUtilizationSample_t * 2)()
        samples[0].pid, samples[0].timeStamp, samples[0].smUtil = 300 + index_of(h), stamp, 40
        samples[1].pid, samples[1].timeStamp, samples[1].smUtil = 900, stamp, 0
        return samples[0:2]

    patch("nvmlDeviceGetProcessUtilization", process_util)


def _patch_gpm(patch: Patch) -> None:
    """GPM supported on every device; the SM-utilization metric reads 61.5."""

    def gpm_support(h: Any) -> Any:
        s = pynvml.c_nvmlGpmSupport_t()
        s.isSupportedDevice = 1
        return s

    patch("nvmlGpmQueryDeviceSupport", gpm_support)
    patch("nvmlGpmSampleAlloc", lambda: pynvml.c_nvmlGpmSample_t())
    patch("nvmlGpmSampleGet", lambda h, s: s)
    patch("nvmlGpmSampleFree", lambda s: None)

    def metrics_get(req: Any) -> Any:
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        assert req.metrics[0].metricId == pynvml.NVML_GPM_METRIC_SM_UTIL
        req.metrics[0].value = 61.5
        req.metrics[0].nvmlReturn = 0
        return req

    patch("nvmlGpmMetricsGet", metrics_get)


def _patch_events(patch: Patch, state: dict[str, Any]) -> None:
    """The event set: each wait hands out the next queued Xid, else times out after its wait."""
    patch("nvmlEventSetCreate", lambda: object())
    patch("nvmlDeviceRegisterEvents", lambda h, t, s: None)

    def wait(evset: Any, timeout_ms: int) -> Any:
        if state["events"]:
            i, xid = state["events"].pop(0)
            data = pynvml.c_nvmlEventData_t()
            data.device = handle(i)
            data.eventType = pynvml.nvmlEventTypeXidCriticalError
            data.eventData = xid
            return data
        time.sleep(timeout_ms / 1000)
        raise err(pynvml.NVML_ERROR_TIMEOUT)

    patch("nvmlEventSetWait_v2", wait)
    patch("nvmlEventSetFree", lambda s: None)


def test_constants_match_pynvml() -> None:
    assert nvml_errors.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml_errors.NVML_ERROR_FUNCTION_NOT_FOUND == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert nvml_errors.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    assert nvml_errors.NVML_ERROR_UNKNOWN == pynvml.NVML_ERROR_UNKNOWN
    assert nvml_errors.NVML_ERROR_TIMEOUT == pynvml.NVML_ERROR_TIMEOUT
    assert nvml_errors.NVML_ERROR_NO_PERMISSION == pynvml.NVML_ERROR_NO_PERMISSION
    assert nvml_errors.NVML_ERROR_LIBRARY_NOT_FOUND == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert nvml_readers.NVML_GPM_METRIC_SM_UTIL == pynvml.NVML_GPM_METRIC_SM_UTIL
    assert pynvml.nvmlEventTypeXidCriticalError == nvml_events.XID_CRITICAL_ERROR_EVENT
    assert adapter.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert adapter.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert adapter.SETTABLE_COMPUTE_MODES == {
        "default": pynvml.NVML_COMPUTEMODE_DEFAULT,
        "prohibited": pynvml.NVML_COMPUTEMODE_PROHIBITED,
        "exclusive_process": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    }
    assert nvml_readers.NVML_GPM_METRICS_GET_VERSION == pynvml.NVML_GPM_METRICS_GET_VERSION
    for variants in nvml_calls.VERSIONED.values():
        for name in variants:
            assert hasattr(pynvml, name), name


def test_real_init_without_a_driver_gives_a_hint() -> None:
    # No monkeypatching: this host has no libnvidia-ml.so.1.
    b = NvmlBackend(events=False)
    try:
        with pytest.raises(NvmlInitError, match="HINT") as info:
            b.open()
        assert info.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
        assert b.sample() == ()
    finally:
        b.close()


def test_error_mapping_with_pynvml_exceptions(fake_driver: dict[str, Any]) -> None:
    fake_driver["lost"].add(1)
    clock = [0.0]
    b = NvmlBackend(events=False, clock=lambda: clock[0])
    try:
        s0, s1 = b.sample()
        clock[0] += 0.2
        s0, s1 = b.sample()
    finally:
        b.close()
    assert s0.uuid == UUIDS[0]
    assert s0.name == "NVIDIA H100"
    assert s0.sm_count == 132
    assert (s0.mem_total_bytes, s0.mem_used_bytes, s0.mem_free_bytes) == (100, 40, 60)
    assert s0.power_mw is None  # NVMLError_NotSupported
    assert s0.throttle_reasons == 0x4
    assert s0.sm_clock_mhz == 1755
    assert s0.temperature_c == 50
    assert [(p.pid, p.used_bytes) for p in s0.processes] == [(300, None)]  # _v3 missing -> _v2
    assert s0.sm_active_pct == 61.5  # real c_nvmlGpmMetricsGet_t round trip
    assert s0.compute_mode == "exclusive_process"
    assert s0.sm_periods is not None and [p.pids for p in s0.sm_periods] == [(300,)]
    assert s0.error is None
    assert not s0.lost
    assert s1.lost
    assert "GPU is lost" in (s1.error or "")


def test_library_mismatch_error_counts_as_missing(
    fake_driver: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def mismatch(h: Any) -> Any:
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses_v3", mismatch)
    b = NvmlBackend(events=False)
    try:
        (s0, _s1) = b.sample()
        assert b.chosen_variant("mps_processes") == "nvmlDeviceGetMPSComputeRunningProcesses_v2"
    finally:
        b.close()
    assert [p.pid for p in s0.processes] == [300]


def test_xid_event_maps_ctypes_handle_to_uuid(fake_driver: dict[str, Any]) -> None:
    fake_driver["events"].append((1, 48))
    b = NvmlBackend(events=True, event_wait_ms=20)
    try:
        b.open()
        deadline = time.monotonic() + 5
        events: tuple[Any, ...] = ()
        while not events and time.monotonic() < deadline:
            events = tuple(b.drain_events())
            time.sleep(0.01)
    finally:
        b.close()
    assert [(e.gpu_uuid, e.xid, e.fatal) for e in events] == [(UUIDS[1], 48, True)]


def test_diagnostic_command_prints_json_samples(
    fake_driver: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert nvml_diag._main(["--count", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["type"], line["uuid"]) for line in lines] == [("sample", u) for u in UUIDS]
    assert lines[0]["processes"] == [{"pid": 300, "used_bytes": None}]


def test_diagnostic_command_without_a_driver_says_how_to_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert nvml_diag._main([]) == 1
    assert "HINT" in capsys.readouterr().err


def test_diagnostic_command_runs_as_a_module_and_the_adapter_names_it() -> None:
    # No monkeypatching: the real entry point on this host (a driver answers with samples).
    run = subprocess.run(
        [sys.executable, "-m", "gpushare.node.nvml_diag", "--count", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if run.returncode == 0:
        assert json.loads(run.stdout.splitlines()[0])["type"] == "sample"
    else:
        assert run.returncode == 1
        assert "HINT" in run.stderr
    # The command's old home prints nothing, so it must say where the command went.
    old = subprocess.run(
        [sys.executable, "-m", "gpushare.node.nvml"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert old.returncode == 1
    assert "python -m gpushare.node.nvml_diag" in old.stderr
