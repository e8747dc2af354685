"""Fakes for the latency probe.

* :class:`FakeProbe`: a :class:`gpushare.node.base.LatencyProbe` whose latency follows a script.
* :class:`FakeDriver` / :class:`FakeNvrtc`: module-shaped stand-ins for ``cuda.bindings.driver`` and
  ``cuda.bindings.nvrtc`` following cuda-python.md's conventions (every call returns
  ``(status, *outputs)``, NVRTC fills a pre-sized buffer in place), so the real
  :class:`gpushare.node.probe.ProbeWorker` launch path runs without a GPU.
* ``python -m tests.fakes.fake_probe ARGS``: the real :func:`gpushare.node.probe.worker_main` with the
  fake driver, scripted through ``$FAKE_PROBE_SCRIPT`` (JSON), for ProbeManager tests with real
  subprocesses and pipes.
"""

from __future__ import annotations

import ctypes
import enum
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from gpushare.model import ProbeReading
from gpushare.node.probe import Bindings, worker_main


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_MPS_SERVER_NOT_READY = 807
    CUDA_ERROR_MPS_CLIENT_TERMINATED = 810
    CUDA_ERROR_MPS_CONNECTION_FAILED = 805


OK = CUresult.CUDA_SUCCESS


class FakeDevPtr:
    """Like CUdeviceptr: a CUDA object the kernel-parameter packer passes with type ``None``."""

    def __init__(self, addr: int) -> None:
        self.addr = addr

    def getPtr(self) -> int:
        return self.addr


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_at: int | None = None


class FakeDriver:
    """``cuda.bindings.driver`` for one device, with scripted latencies and failures.

    Args:
        latencies_ms: event elapsed times returned for successive launches (cycled).
        run_ms: the run time the kernel "measures" (%globaltimer difference).
        fail_at: launch number (1-based) -> CUresult code returned by cuEventSynchronize.
        mps_enabled: value of CU_DEVICE_ATTRIBUTE_MPS_ENABLED.
        init_error: an exception cuInit raises (as cuda-pathfinder does without a driver).
    """

    CUresult = CUresult
    CUdeviceptr = FakeDevPtr
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT=16,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
        CU_DEVICE_ATTRIBUTE_MPS_ENABLED=133,
    )
    CUstream_flags = SimpleNamespace(CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_BLOCKING_SYNC=1)

    def __init__(
        self,
        *,
        latencies_ms: Sequence[float] = (0.05,),
        run_ms: float = 0.012,
        fail_at: dict[int, int] | None = None,
        mps_enabled: int = 1,
        init_error: BaseException | None = None,
        uuid_bytes: bytes = bytes(range(16)),
        cc: tuple[int, int] = (9, 0),
    ) -> None:
        self.latencies_ms = list(latencies_ms)
        self.run_ms = run_ms
        self.fail_at = dict(fail_at or {})
        self.mps_enabled = mps_enabled
        self.init_error = init_error
        self.uuid_bytes = uuid_bytes
        self.cc = cc
        self.launches: list[dict[str, Any]] = []
        self.loaded_images: list[bytes] = []
        self.stream_priority: int | None = None
        self.memory: dict[int, tuple[int, int]] = {}
        self.destroyed: list[str] = []
        self._initialized = False

    def cuInit(self, flags: int) -> tuple[CUresult]:
        if self.init_error is not None:
            raise self.init_error
        self._initialized = True
        return (OK,)

    def cuDeviceGetCount(self) -> tuple[CUresult, int]:
        return OK, 1

    def cuDeviceGet(self, ordinal: int) -> tuple[CUresult, int]:
        return OK, ordinal

    def cuDeviceGetUuid(self, dev: int) -> tuple[CUresult, SimpleNamespace]:
        return OK, SimpleNamespace(bytes=self.uuid_bytes)

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[CUresult, int]:
        values = {75: self.cc[0], 76: self.cc[1], 16: 132, 133: self.mps_enabled}
        return OK, values[attr]

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[CUresult, str]:
        return OK, "ctx"

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[CUresult]:
        self.destroyed.append("ctx")
        return (OK,)

    def cuCtxSetCurrent(self, ctx: str) -> tuple[CUresult]:
        return (OK,)

    def cuModuleLoadData(self, image: bytes) -> tuple[CUresult, str] | tuple[CUresult, None]:
        self.loaded_images.append(bytes(image))
        if not bytes(image).startswith(b"\x7fELF"):
            return CUresult.CUDA_ERROR_INVALID_IMAGE, None
        return OK, "module"

    def cuModuleUnload(self, module: str) -> tuple[CUresult]:
        self.destroyed.append("module")
        return (OK,)

    def cuModuleGetFunction(self, module: str, name: bytes) -> tuple[CUresult, str | None]:
        if name != b"gpushare_probe":
            return CUresult.CUDA_ERROR_NOT_FOUND, None
        return OK, "fn"

    def cuCtxGetStreamPriorityRange(self) -> tuple[CUresult, int, int]:
        return OK, 0, -5

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[CUresult, str]:
        self.stream_priority = priority
        return OK, "stream"

    def cuStreamDestroy(self, stream: str) -> tuple[CUresult]:
        self.destroyed.append("stream")
        return (OK,)

    def cuMemAlloc(self, size: int) -> tuple[CUresult, FakeDevPtr]:
        ptr = FakeDevPtr(0x7000_0000 + 0x100 * len(self.memory))
        self.memory[ptr.addr] = (0, 0)
        return OK, ptr

    def cuMemFree(self, ptr: FakeDevPtr) -> tuple[CUresult]:
        self.destroyed.append("mem")
        return (OK,)

    def cuEventCreate(self, flags: int) -> tuple[CUresult, FakeEvent]:
        return OK, FakeEvent()

    def cuEventDestroy(self, ev: FakeEvent) -> tuple[CUresult]:
        self.destroyed.append("event")
        return (OK,)

    def cuEventRecord(self, ev: FakeEvent, stream: str) -> tuple[CUresult]:
        ev.recorded_at = len(self.launches)
        return (OK,)

    def cuLaunchKernel(
        self,
        fn: str,
        gx: int,
        gy: int,
        gz: int,
        bx: int,
        by: int,
        bz: int,
        shared: int,
        stream: str,
        params: Any,
        extra: int,
    ) -> tuple[CUresult]:
        # The parameter shape the real packer accepts: ((values...), (types...)).
        (ptr, cycles), (ptr_type, cycles_type) = params
        if ptr_type is not None or cycles_type is not ctypes.c_uint or not callable(ptr.getPtr):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.launches.append(
            {"fn": fn, "grid": (gx, gy, gz), "block": (bx, by, bz), "cycles": cycles}
        )
        if ptr.getPtr() not in self.memory:
            # A write through a bad pointer: the context is lost (sticky), as on a GPU.
            self.fail_at[len(self.launches)] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
            return (OK,)
        self.memory[ptr.getPtr()] = (int(cycles), int(self.run_ms * 1e6))
        return (OK,)

    def cuEventSynchronize(self, ev: FakeEvent) -> tuple[CUresult]:
        code = self.fail_at.get(len(self.launches))
        return (CUresult(code),) if code is not None else (OK,)

    def cuEventElapsedTime(self, ev0: FakeEvent, ev1: FakeEvent) -> tuple[CUresult, float]:
        n = len(self.launches)
        return OK, self.latencies_ms[(n - 1) % len(self.latencies_ms)]

    def cuMemcpyDtoH(self, host: Any, ptr: FakeDevPtr, size: int) -> tuple[CUresult]:
        cycles, run_ns = self.memory[ptr.getPtr()]
        host[0], host[1] = cycles, run_ns
        return (OK,)


class FakeNvrtc:
    """``cuda.bindings.nvrtc``: "compiles" to an ELF-headed image, written into the caller's buffer."""

    IMAGE = b"\x7fELF-fake-cubin-for-gpushare_probe"

    def __init__(self) -> None:
        self.options: list[list[bytes]] = []
        self.sources: list[bytes] = []

    def nvrtcCreateProgram(
        self, src: bytes, name: bytes, n: int, headers: list[Any], names: list[Any]
    ) -> tuple[int, str]:
        self.sources.append(src)
        return 0, "prog"

    def nvrtcCompileProgram(self, prog: str, n: int, opts: list[bytes]) -> tuple[int]:
        self.options.append(list(opts))
        return (0,)

    def nvrtcGetCUBINSize(self, prog: str) -> tuple[int, int]:
        return 0, len(self.IMAGE)

    def nvrtcGetCUBIN(self, prog: str, buf: bytes) -> tuple[int]:
        # The real binding fills the pre-sized bytes object in place; so does this fake.
        assert len(buf) == len(self.IMAGE)
        ctypes.memmove(ctypes.c_char_p(buf), self.IMAGE, len(self.IMAGE))
        return (0,)

    def nvrtcDestroyProgram(self, prog: str) -> tuple[int]:
        return (0,)


def fake_bindings(**driver_kw: Any) -> Bindings:
    return Bindings(FakeDriver(**driver_kw), FakeNvrtc(), "fake.driver", "0.0")


class FakeProbe:
    """A SlotHoldingProbe whose latency follows a script of ``(from_s, latency_ms)`` steps or a function.

    ``reading`` reports the scripted latency at ``clock()`` as the window p99, against a fixed
    baseline. ``unavailable`` makes every reading say why, as the real probe does without a driver;
    ``raises`` makes every reading raise it (a broken adapter); ``fixed`` is returned as every
    reading. ``slots`` is what :meth:`mps_client_slots` reports for every GPU, and
    :attr:`offline` records what ``set_offline_running`` was told, by GPU.
    """

    def __init__(
        self,
        script: Sequence[tuple[float, float]] | Callable[[float], float],
        *,
        baseline_ms: float | None = 0.05,
        clock: Callable[[], float] | None = None,
        unavailable: str | None = None,
        raises: Exception | None = None,
        fixed: ProbeReading | None = None,
        slots: int = 0,
    ) -> None:
        self.script = script
        self.baseline_ms = baseline_ms
        self.now = 0.0
        self.clock = clock or (lambda: self.now)
        self.unavailable = unavailable
        self.raises = raises
        self.fixed = fixed
        self.slots = slots
        self.offline: dict[str, list[bool]] = {}
        self.closed = False

    def latency_at(self, t: float) -> float:
        if callable(self.script):
            return float(self.script(t))
        value = self.script[0][1]
        for start, latency in self.script:
            if t >= start:
                value = latency
        return value

    def reading(self, gpu_uuid: str) -> ProbeReading:
        if self.raises is not None:
            raise self.raises
        if self.fixed is not None:
            return self.fixed
        if self.unavailable is not None:
            return ProbeReading(reason=f"unavailable: {self.unavailable}")
        latency = self.latency_at(self.clock())
        ratio = latency / self.baseline_ms if self.baseline_ms else None
        return ProbeReading(
            latency_ms=latency,
            run_ms=self.baseline_ms,
            baseline_ms=self.baseline_ms,
            ratio=ratio,
            samples=200,
            reason=None if ratio is not None else "no baseline yet: needs quiet samples",
        )

    def mps_client_slots(self, gpu_uuid: str) -> int:
        return self.slots

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        self.offline.setdefault(gpu_uuid, []).append(running)

    def close(self) -> None:
        self.closed = True


def _main() -> int:
    script = json.loads(os.environ.get("FAKE_PROBE_SCRIPT", "{}"))
    fail_at = {int(k): int(v) for k, v in script.get("fail_at", {}).items()}
    bindings = fake_bindings(
        latencies_ms=script.get("latencies_ms", [0.05]),
        fail_at=fail_at,
        mps_enabled=script.get("mps_enabled", 1),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def watch() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        stop.set()

    if "--watch-stdin" in sys.argv[1:]:
        threading.Thread(target=watch, daemon=True).start()
    return worker_main(sys.argv[1:], bindings=bindings, stop=stop)


if __name__ == "__main__":
    sys.exit(_main())
