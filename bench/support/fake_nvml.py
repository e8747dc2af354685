"""A fake of the pynvml library for the real adapter (an outside library's fake: benches use it too).

``FakeNvmlLib`` follows nvml.md §4/§10: functions named and shaped like pynvml's, errors carrying
NVML's codes, a missing symbol raising FUNCTION_NOT_FOUND as pynvml does. ``NvmlBackend(nvml=lib)``
runs the real adapter against it. The scenario builders are named after real failures.

:func:`uniform_samples` builds the samples such a node reads; the fake of the
:class:`gpushare.node.base.GpuBackend` Protocol itself is ``tests/fakes/fake_gpu.py``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from gpushare.model import GpuSample, ProcessMemory

NOT_SUPPORTED = 3
NOT_FOUND = 6
NO_PERMISSION = 4
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
TIMEOUT = 10
UNKNOWN = 999
INSUFFICIENT_POWER = 8

GIB = 1 << 30
MIB = 1 << 20


class NVMLError(Exception):
    """Like pynvml.NVMLError: ``.value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(f"NVML error {value}")


class NVMLLibraryMismatchError(Exception):
    """Like pynvml's: raised by unversioned aliases on an old driver; not an NVMLError."""


HANG = "hang"


@dataclass
class FakeGpu:
    """One fake device's readings (units as NVML returns them)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    mem_total: int = 80 * GIB
    mem_used: int = 10 * GIB
    gpu_util: int = 40
    mem_util: int = 20
    temperature: int = 45
    power_mw: int = 250_000
    sm_clock_mhz: int = 1980
    clock_reasons: int = 0
    sm_count: int | None = 132
    gpm: bool = True
    sm_active_pct: float = 33.0
    compute_mode: int = 0
    compute_procs: list[tuple[int, int | None]] = field(default_factory=lambda: [(100, 30 * MIB)])
    mps_procs: list[tuple[int, int | None]] = field(
        default_factory=lambda: [(201, 2 * GIB), (202, 3 * GIB)]
    )
    #: The driver's per-process utilisation buffer: ``(timeStamp_us, pid, smUtil, memUtil)``.
    proc_util: list[tuple[int, int, int, int]] = field(default_factory=list)


class FakeHandle:
    """An opaque device handle."""

    def __init__(self, index: int) -> None:
        self.index = index

    # Two handles of one device compare equal, like the pointer values of real handles.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeHandle) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("FakeHandle", self.index))


class FakeNvmlLib:
    """A pynvml-shaped module. Failures are injected per function and GPU index.

    ``fail[(fname, index)]`` (or ``(fname, None)`` for every GPU) is an NVML code to raise, an
    exception instance, or :data:`HANG` (block until :meth:`release` is called).
    ``missing`` lists functions this "driver" lacks (they raise FUNCTION_NOT_FOUND).
    """

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError

    def __init__(self, gpus: Sequence[FakeGpu]) -> None:
        self.gpus = list(gpus)
        self.fail: dict[tuple[str, int | None], Any] = {}
        self.missing: set[str] = set()
        self.calls: list[str] = []
        self.init_error: int | None = None
        self.init_delay_s = 0.0
        self.events: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.registered: list[int] = []
        self.shutdown_calls = 0
        self.compute_mode_sets: list[tuple[int, int]] = []
        self._release = threading.Event()
        self.hung = threading.Event()
        self._lock = threading.Lock()

    # --- test controls
    def release(self) -> None:
        """Let every hung call return (with GPU_IS_LOST, as a wedged driver eventually does)."""
        self._release.set()

    def count(self, fname: str) -> int:
        with self._lock:
            return sum(1 for c in self.calls if c == fname)

    def _enter(self, fname: str, index: int | None = None) -> None:
        with self._lock:
            self.calls.append(fname)
        if fname in self.missing:
            raise NVMLError(FUNCTION_NOT_FOUND)
        spec = self.fail.get((fname, index), self.fail.get((fname, None)))
        if spec is None:
            return
        if spec == HANG:
            self.hung.set()
            self._release.wait(timeout=60)
            raise NVMLError(GPU_IS_LOST)
        if isinstance(spec, BaseException):
            raise spec
        raise NVMLError(int(spec))

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
        return self.gpus[handle.index]

    # --- init
    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return "550.54.15"

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_delay_s:
            time.sleep(self.init_delay_s)
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        self._enter("nvmlDeviceGetUUID", h.index)
        return self._gpu(h).uuid

    def nvmlDeviceGetName(self, h: FakeHandle) -> str:
        self._enter("nvmlDeviceGetName", h.index)
        return self._gpu(h).name

    def nvmlDeviceGetAttributes_v2(self, h: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetAttributes_v2", h.index)
        count = self._gpu(h).sm_count
        if count is None:
            raise NVMLError(NOT_SUPPORTED)
        return SimpleNamespace(multiprocessorCount=count)

    # --- readings
    def nvmlDeviceGetMemoryInfo(self, h: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", h.index)
        g = self._gpu(h)
        return SimpleNamespace(total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", h.index)
        g = self._gpu(h)
        return SimpleNamespace(gpu=g.gpu_util, memory=g.mem_util)

    def nvmlDeviceGetTemperatureV(self, h: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperatureV", h.index)
        return self._gpu(h).temperature

    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", h.index)
        return self._gpu(h).temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerUsage", h.index)
        return self._gpu(h).power_mw

    def nvmlDeviceGetClockInfo(self, h: FakeHandle, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", h.index)
        return self._gpu(h).sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", h.index)
        return self._gpu(h).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeHandle) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", h.index)
        return self._gpu(h).clock_reasons

    def _procs(self, entries: list[tuple[int, int | None]]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in entries
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses_v3", h.index)
        return self._procs(self._gpu(h).compute_procs)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses_v2", h.index)
        return self._procs(self._gpu(h).compute_procs)

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, h: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses_v3", h.index)
        return self._procs(self._gpu(h).mps_procs)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, h: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses_v2", h.index)
        return self._procs(self._gpu(h).mps_procs)

    # --- GPM
    def nvmlGpmQueryDeviceSupport(self, h: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlGpmQueryDeviceSupport", h.index)
        return SimpleNamespace(version=1, isSupportedDevice=int(self._gpu(h).gpm))

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:
        self._enter("nvmlGpmSampleAlloc")
        return SimpleNamespace(gpu=None, freed=False)

    def nvmlGpmSampleGet(self, h: FakeHandle, sample: SimpleNamespace) -> SimpleNamespace:
        self._enter("nvmlGpmSampleGet", h.index)
        sample.gpu = h.index
        return sample

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:
        self._enter("nvmlGpmSampleFree")
        sample.freed = True

    @staticmethod
    def c_nvmlGpmMetricsGet_t() -> SimpleNamespace:
        metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(4)]
        return SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None, metrics=metrics)

    def nvmlGpmMetricsGet(self, req: SimpleNamespace) -> SimpleNamespace:
        self._enter("nvmlGpmMetricsGet")
        assert req.sample1 is not req.sample2
        assert not req.sample1.freed
        assert not req.sample2.freed
        g = self.gpus[req.sample2.gpu]
        for m in req.metrics[: req.numMetrics]:
            m.value = g.sm_active_pct if m.metricId == 2 else 0.0
        return req

    def nvmlDeviceGetProcessUtilization(
        self, h: FakeHandle, last_seen_us: int
    ) -> list[SimpleNamespace]:
        """Records newer than ``last_seen_us`` of processes with non-zero utilisation.

        As documented: NOT_FOUND when there is none (pynvml raises NVMLError_NotFound).
        """
        self._enter("nvmlDeviceGetProcessUtilization", h.index)
        out = [
            SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=mem, encUtil=0, decUtil=0)
            for ts, pid, sm, mem in self._gpu(h).proc_util
            if ts > last_seen_us and (sm > 0 or mem > 0)
        ]
        if not out:
            raise NVMLError(NOT_FOUND)
        return out

    # --- compute mode
    def nvmlDeviceGetComputeMode(self, h: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeMode", h.index)
        return self._gpu(h).compute_mode

    def nvmlDeviceSetComputeMode(self, h: FakeHandle, mode: int) -> None:
        self._enter("nvmlDeviceSetComputeMode", h.index)
        self.compute_mode_sets.append((h.index, mode))
        self._gpu(h).compute_mode = mode

    # --- events
    def nvmlEventSetCreate(self) -> object:
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, h: FakeHandle, types: int, evset: object) -> None:
        self._enter("nvmlDeviceRegisterEvents", h.index)
        self.registered.append(h.index)

    def nvmlEventSetWait_v2(self, evset: object, timeout_ms: int) -> SimpleNamespace:
        self._enter("nvmlEventSetWait_v2")
        try:
            index, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(TIMEOUT) from None
        return SimpleNamespace(
            device=FakeHandle(index), eventType=0x8, eventData=xid, gpuInstanceId=0xFFFFFFFF
        )

    def nvmlEventSetFree(self, evset: object) -> None:
        self._enter("nvmlEventSetFree")


def uuid_of(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-{i:012x}"


def healthy(n: int = 2) -> FakeNvmlLib:
    """``n`` healthy Hopper GPUs with an MPS server and two MPS clients each."""
    return FakeNvmlLib([FakeGpu(uuid=uuid_of(i)) for i in range(n)])


def gpu_lost(n: int = 2, lost: int = 1) -> FakeNvmlLib:
    """GPU ``lost`` fell off the bus: every per-device reading raises GPU_IS_LOST."""
    lib = healthy(n)
    for fname in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"):
        lib.fail[(fname, lost)] = GPU_IS_LOST
    return lib


def not_supported_everywhere(n: int = 1) -> FakeNvmlLib:
    """A consumer or virtualised GPU: every optional reading raises NOT_SUPPORTED."""
    lib = healthy(n)
    for fname in (
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlGpmQueryDeviceSupport",
        "nvmlDeviceGetComputeMode",
        "nvmlDeviceGetProcessUtilization",
    ):
        lib.fail[(fname, None)] = NOT_SUPPORTED
    return lib


def pid_vanished(n: int = 1) -> FakeNvmlLib:
    """A client exited between NVML's list and the read: pid listed with memory N/A."""
    lib = healthy(n)
    lib.gpus[0].mps_procs = [(201, 2 * GIB), (999_999, None)]
    return lib


def old_driver(n: int = 1) -> FakeNvmlLib:
    """An R470-era driver: no ``_v3`` process queries, no TemperatureV, no ClocksEventReasons, no GPM."""
    lib = healthy(n)
    lib.missing |= {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlGpmQueryDeviceSupport",
        "nvmlDeviceGetAttributes_v2",
    }
    return lib


def hanging_call(n: int = 2, index: int = 0, fname: str = "nvmlDeviceGetPowerUsage") -> FakeNvmlLib:
    """One GPU's driver wedged: a call on it blocks (NVIDIA/open-gpu-kernel-modules#1333)."""
    lib = healthy(n)
    lib.fail[(fname, index)] = HANG
    return lib


def uniform_samples(gpus: int, clients_per_gpu: int, *, first_pid: int = 10_000) -> list[GpuSample]:
    """``gpus`` healthy GPUs, each with an MPS client process per client (1 GiB each)."""
    samples = []
    for i in range(gpus):
        procs = tuple(
            ProcessMemory(pid=first_pid + i * clients_per_gpu + j, used_bytes=GIB)
            for j in range(clients_per_gpu)
        )
        samples.append(
            GpuSample(
                index=i,
                uuid=uuid_of(i),
                name="NVIDIA H100 80GB HBM3",
                sm_count=132,
                mem_total_bytes=80 * GIB,
                mem_used_bytes=clients_per_gpu * GIB,
                mem_free_bytes=(80 - clients_per_gpu) * GIB,
                gpu_util_pct=50.0,
                mem_util_pct=20.0,
                sm_active_pct=40.0,
                temperature_c=50,
                power_mw=300_000,
                sm_clock_mhz=1980,
                throttle_reasons=0,
                processes=procs,
            )
        )
    return samples
