"""The per-GPU latency probe's worker: the only module that imports cuda-python.

One worker process per GPU (``python -m gpushare.node.probe``, :func:`worker_main` driving a
:class:`ProbeWorker`), started as an MPS client of that GPU (the caller passes
``CUDA_MPS_PIPE_DIRECTORY``). It compiles a tiny fixed spin kernel once with NVRTC to a CUBIN for
the device's compute capability, then every probe period launches it (1 block x 32 threads) on a
highest-priority stream and writes one JSON line to stdout with the wait-plus-run time from CUDA
events and the run time the kernel measured itself (``%globaltimer`` around a ``clock64()`` spin).
It supports the cuda-bindings 13.x layout (``cuda.bindings.driver``) and the 12.x one
(``cuda.cuda``) and says which it uses (:func:`load_bindings`). On a sticky CUDA error (700, 719,
807, 810) the context is unusable, so it exits with :data:`EXIT_STICKY` and the parent restarts it
with backoff. ``gpushare doctor``'s CUDA lines (driver, bindings, NVRTC) are
:mod:`gpushare.node.probe_host`.

The parent side needs no cuda-python and lives beside this module:
:class:`gpushare.node.probe_manager.ProbeManager` (the :class:`gpushare.node.base.LatencyProbe` the
daemon holds) supervises the workers and reads their lines into a
:class:`gpushare.node.probe_window.ProbeWindow`. Each worker occupies one MPS client slot on its GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import structlog

from gpushare.logs import configure_logging

if TYPE_CHECKING:
    pass

log = structlog.get_logger(__name__)

KERNEL_NAME = "gpushare_probe"
# Every thread spins for `cycles` SM clock cycles; %globaltimer (ns) brackets the spin so the run
# time needs no clock-rate conversion. Block 0's thread 0 writes out[0] = cycles spun and
# out[1] = run time in ns. The probe launches 1 block of 32 threads (one warp); the same kernel
# with many blocks is the busy load of docs/gpu-validation.md.
KERNEL_SOURCE = r"""
extern "C" __global__ void gpushare_probe(unsigned long long *out, unsigned int cycles) {
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    long long start = clock64();
    long long spun = 0;
    while (spun < (long long)cycles) {
        spun = clock64() - start;
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = (unsigned long long)spun;
        out[1] = t1 - t0;
    }
}
"""

# Sticky errors leave the context unusable: the process must exit (cuda-python.md §3, mps.md).
STICKY_ERRORS = frozenset({700, 719, 807, 810})
# No usable driver or device: retrying soon will not help.
UNAVAILABLE_ERRORS = frozenset({34, 35, 100, 803, 804})

EXIT_OK = 0
EXIT_STICKY = 3
EXIT_UNAVAILABLE = 4
EXIT_ERROR = 5


class ProbeError(Exception):
    """A CUDA driver or NVRTC call failed; ``code`` is the numeric result (700, 719, …)."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        super().__init__(f"{call} failed: {name} ({code}){': ' + detail if detail else ''}")

    @property
    def sticky(self) -> bool:
        """The CUDA context is unusable after this error; the worker must restart."""
        return self.code in STICKY_ERRORS


class ProbeUnavailableError(Exception):
    """No CUDA driver, device or bindings: the probe cannot run on this host as it is."""


# --------------------------------------------------------------------------------- bindings


@dataclass(frozen=True)
class Bindings:
    """The CUDA driver and NVRTC modules in use and which layout they came from."""

    driver: Any
    nvrtc: Any
    name: str
    version: str


def load_bindings() -> Bindings:
    """Import the driver and NVRTC bindings, cuda-bindings 13.x layout first, then 12.x.

    Raises:
        ProbeUnavailableError: neither layout is installed.
    """
    version = _dist_version()
    try:
        from cuda.bindings import driver, nvrtc

        return Bindings(driver, nvrtc, "cuda.bindings.driver", version)
    except ImportError:
        pass
    try:
        # cuda-python 12.x before cuda.bindings existed; removed in 13.
        from cuda import cuda as driver12
        from cuda import nvrtc as nvrtc12

        return Bindings(driver12, nvrtc12, "cuda.cuda", version)
    except ImportError as exc:
        raise ProbeUnavailableError(
            "cuda-bindings is not installed: `pip install 'cuda-bindings>=12.8,<13' "
            "'nvidia-cuda-nvrtc-cu12>=12.8,<13'` (driver >= 525), or the 13.x pair "
            "(driver >= 580; README.md, CUDA and the driver)"
        ) from exc


def _dist_version() -> str:
    from importlib import metadata

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def driver_missing_errors() -> tuple[type[BaseException], ...]:
    """What a missing libcuda raises: cuda-pathfinder's error (13.x), a RuntimeError (12.x)."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:
        return (RuntimeError,)
    return (DynamicLibNotFoundError,)


def _check(call: str, ret: Any) -> Any:
    """Unpack a ``(status, *outputs)`` tuple; raise :class:`ProbeError` on a non-zero status."""
    if isinstance(ret, tuple):
        status, *out = ret
    else:
        status, out = ret, []
    code = int(status)
    if code != 0:
        raise ProbeError(call, code, getattr(status, "name", str(status)))
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


def compile_cubin(nvrtc: Any, major: int, minor: int, source: str = KERNEL_SOURCE) -> bytes:
    """Compile the probe kernel with NVRTC to a CUBIN for ``sm_<major><minor>``.

    Raises:
        ProbeError: NVRTC failed; the message carries the compiler log.
    """
    prog = _check(
        "nvrtcCreateProgram",
        nvrtc.nvrtcCreateProgram(source.encode(), b"gpushare_probe.cu", 0, [], []),
    )
    try:
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status) != 0:
            size = _check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
            buf = b" " * int(size)
            _check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, buf))
            name = getattr(status, "name", str(status))
            text = buf.decode(errors="replace").strip("\x00 \n")
            raise ProbeError("nvrtcCompileProgram", int(status), name, text)
        size = _check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        image = b" " * int(size)
        _check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _format_uuid(raw: Any) -> str:
    data = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
    h = data.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# --------------------------------------------------------------------------------- worker


class ProbeWorker:
    """The CUDA side of one probe process: set up once, then :meth:`measure` per period.

    Args:
        bindings: the driver/NVRTC modules (a fake module in tests).
        gpu_uuid: the GPU to probe; ``None`` takes the first visible device.
        cycles: spin length of the kernel in SM clock cycles.
        blocks: grid size (1 for the probe; many for a busy load when validating on a GPU).
        inject_fault: write through an invalid pointer, to validate the sticky-error restart and
            XID delivery on a real GPU (docs/gpu-validation.md); never used by the daemon.
    """

    def __init__(
        self,
        bindings: Bindings,
        gpu_uuid: str | None,
        cycles: int,
        *,
        blocks: int = 1,
        inject_fault: bool = False,
    ) -> None:
        self.b = bindings
        self.gpu_uuid = gpu_uuid
        self.cycles = cycles
        self.blocks = blocks
        self.inject_fault = inject_fault
        self._ctx: Any = None
        self._dev: Any = None
        self._module: Any = None
        self._fn: Any = None
        self._stream: Any = None
        self._out: Any = None
        self._events: tuple[Any, Any] | None = None
        self._host = (ctypes.c_uint64 * 2)()

    def setup(self) -> dict[str, Any]:
        """Initialise CUDA, build and load the kernel; returns what the ``hello`` line reports.

        Raises:
            ProbeError: a CUDA or NVRTC call failed.
        """
        cu = self.b.driver
        attr = cu.CUdevice_attribute
        _check("cuInit", cu.cuInit(0))
        self._dev, uuid = self._find_device()
        major = int(
            _check(
                "cuDeviceGetAttribute",
                cu.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev
                ),
            )
        )
        minor = int(
            _check(
                "cuDeviceGetAttribute",
                cu.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev
                ),
            )
        )
        sms = int(
            _check(
                "cuDeviceGetAttribute",
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._dev),
            )
        )
        mps = self._attribute_or_none("CU_DEVICE_ATTRIBUTE_MPS_ENABLED")
        cubin = compile_cubin(self.b.nvrtc, major, minor)
        self._ctx = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._dev))
        _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        self._module = _check("cuModuleLoadData", cu.cuModuleLoadData(cubin))
        self._fn = _check(
            "cuModuleGetFunction", cu.cuModuleGetFunction(self._module, KERNEL_NAME.encode())
        )
        _least, greatest = _check("cuCtxGetStreamPriorityRange", cu.cuCtxGetStreamPriorityRange())
        # Numerically lowest is the highest priority: the probe should see what an urgent
        # online kernel sees, not queue behind its own process's work.
        self._stream = _check(
            "cuStreamCreateWithPriority",
            cu.cuStreamCreateWithPriority(cu.CUstream_flags.CU_STREAM_NON_BLOCKING, int(greatest)),
        )
        self._out = _check("cuMemAlloc", cu.cuMemAlloc(16))
        flags = cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC  # sleep in sync instead of spinning a core
        self._events = (
            _check("cuEventCreate", cu.cuEventCreate(flags)),
            _check("cuEventCreate", cu.cuEventCreate(flags)),
        )
        return {
            "gpu_uuid": uuid,
            "compute_capability": f"{major}.{minor}",
            "sm_count": sms,
            "mps_enabled": None if mps is None else bool(mps),
            "cubin_bytes": len(cubin),
            "cycles": self.cycles,
            "blocks": self.blocks,
        }

    def _attribute_or_none(self, name: str) -> int | None:
        cu = self.b.driver
        attr = getattr(cu.CUdevice_attribute, name, None)
        if attr is None:
            return None
        try:
            return int(_check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr, self._dev)))
        except ProbeError:
            return None

    def _find_device(self) -> tuple[Any, str | None]:
        cu = self.b.driver
        count = int(_check("cuDeviceGetCount", cu.cuDeviceGetCount()))
        if count == 0:
            raise ProbeError("cuDeviceGetCount", 100, "CUDA_ERROR_NO_DEVICE")
        get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        seen = []
        for ordinal in range(count):
            dev = _check("cuDeviceGet", cu.cuDeviceGet(ordinal))
            uuid = _format_uuid(_check("cuDeviceGetUuid", get_uuid(dev)).bytes)
            seen.append(uuid)
            if self.gpu_uuid is None or uuid.lower() == self.gpu_uuid.lower():
                return dev, uuid
        raise ProbeError(
            "cuDeviceGet",
            101,
            "CUDA_ERROR_INVALID_DEVICE",
            f"{self.gpu_uuid} is not visible to this process (visible: {', '.join(seen)})",
        )

    def measure(self) -> dict[str, float]:
        """Launch the kernel once and time it.

        Returns:
            ``latency_ms`` (CUDA events: wait for SMs plus run), ``run_ms`` (the kernel's own
            %globaltimer), ``host_ms`` (host round trip) and ``cycles``.

        Raises:
            ProbeError: a CUDA call failed (``sticky`` says whether the context is dead).
        """
        cu = self.b.driver
        assert self._events is not None, "setup() first"
        ev0, ev1 = self._events
        t0 = time.perf_counter_ns()
        _check("cuEventRecord", cu.cuEventRecord(ev0, self._stream))
        out = cu.CUdeviceptr(16) if self.inject_fault else self._out
        params = ((out, self.cycles), (None, ctypes.c_uint))
        _check(
            "cuLaunchKernel",
            cu.cuLaunchKernel(self._fn, self.blocks, 1, 1, 32, 1, 1, 0, self._stream, params, 0),
        )
        _check("cuEventRecord", cu.cuEventRecord(ev1, self._stream))
        _check("cuEventSynchronize", cu.cuEventSynchronize(ev1))
        t1 = time.perf_counter_ns()
        elapsed_ms = float(_check("cuEventElapsedTime", cu.cuEventElapsedTime(ev0, ev1)))
        _check("cuMemcpyDtoH", cu.cuMemcpyDtoH(self._host, self._out, 16))
        return {
            "latency_ms": elapsed_ms,
            "run_ms": self._host[1] / 1e6,
            "host_ms": (t1 - t0) / 1e6,
            "cycles": float(self._host[0]),
        }

    def teardown(self) -> None:
        """Release what :meth:`setup` created; errors are ignored (the process is ending)."""
        cu = self.b.driver
        for ev in self._events or ():
            cu.cuEventDestroy(ev)
        if self._out is not None:
            cu.cuMemFree(self._out)
        if self._stream is not None:
            cu.cuStreamDestroy(self._stream)
        if self._module is not None:
            cu.cuModuleUnload(self._module)
        if self._ctx is not None:
            cu.cuDevicePrimaryCtxRelease(self._dev)


def _emit(out: IO[str], kind: str, **fields: Any) -> None:
    out.write(json.dumps({"type": kind, **fields}) + "\n")
    out.flush()


def worker_main(
    argv: Sequence[str] | None = None,
    *,
    bindings: Bindings | None = None,
    out: IO[str] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run one probe worker until stopped; JSON lines on ``out``; returns the exit status.

    Lines: ``hello`` (bindings, device, compute capability, SM count, MPS enabled),
    ``sample`` (latency_ms, run_ms, host_ms, cycles), ``error`` (code, name, sticky, message) or
    ``unavailable`` (reason). Exit status :data:`EXIT_STICKY` asks the parent for a restart with
    backoff, :data:`EXIT_UNAVAILABLE` says retrying soon will not help.
    """
    parser = argparse.ArgumentParser(prog="python -m gpushare.node.probe")
    parser.add_argument("--gpu", default=None, help="UUID of the GPU to probe")
    parser.add_argument("--period-s", type=float, default=0.05, help="time between launches")
    parser.add_argument("--cycles", type=int, default=20_000, help="kernel spin length")
    parser.add_argument("--count", type=int, default=0, help="stop after N samples (0: never)")
    parser.add_argument("--blocks", type=int, default=1, help="grid size (>1: a busy load)")
    parser.add_argument(
        "--watch-stdin",
        action="store_true",
        help="stop when stdin reaches EOF (the parent's pipe closed)",
    )
    parser.add_argument(
        "--inject-fault",
        action="store_true",
        help="GPU validation only: fault on purpose (sticky 700, an XID)",
    )
    args = parser.parse_args(argv)
    out = out or sys.stdout
    stop = stop or threading.Event()
    try:
        b = bindings or load_bindings()
    except ProbeUnavailableError as exc:
        _emit(out, "unavailable", reason=str(exc))
        return EXIT_UNAVAILABLE
    _emit(out, "hello", bindings=b.name, bindings_version=b.version, pid=os.getpid())
    # Imported here: probe_host (the doctor's checks) imports this module.
    from gpushare.node import probe_host

    if (why := probe_host.mismatch(b)) is not None:
        _emit(out, "unavailable", reason=why)
        return EXIT_UNAVAILABLE
    worker = ProbeWorker(
        b, args.gpu, args.cycles, blocks=args.blocks, inject_fault=args.inject_fault
    )
    try:
        info = worker.setup()
        _emit(out, "ready", **info)
        done = 0
        next_at = time.monotonic()
        while not stop.is_set():
            sample = worker.measure()
            _emit(out, "sample", **sample)
            done += 1
            if args.count and done >= args.count:
                break
            next_at += args.period_s
            # Monotonic deadline; after a long stall start afresh rather than burst to catch up.
            next_at = max(next_at, time.monotonic())
            stop.wait(max(0.0, next_at - time.monotonic()))
    except ProbeError as exc:
        if exc.code in UNAVAILABLE_ERRORS:
            _emit(out, "unavailable", reason=str(exc), code=exc.code)
            return EXIT_UNAVAILABLE
        _emit(out, "error", code=exc.code, name=exc.name, sticky=exc.sticky, message=str(exc))
        return EXIT_STICKY if exc.sticky else EXIT_ERROR
    except driver_missing_errors() as exc:
        _emit(out, "unavailable", reason=f"no CUDA driver: {exc}")
        return EXIT_UNAVAILABLE
    finally:
        teardown_errors: tuple[type[BaseException], ...] = (ProbeError, *driver_missing_errors())
        with contextlib.suppress(*teardown_errors):
            worker.teardown()
    return EXIT_OK


def _watch_parent(stop: threading.Event) -> None:
    # The parent holds our stdin open; EOF means it is gone (or asked us to stop).
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    stop.set()


def _main() -> int:
    # stdout is the JSON channel to the parent: any log line must go to stderr.
    configure_logging("info")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Only on request: a worker started by hand in the background must not read the terminal.
    if "--watch-stdin" in sys.argv[1:]:
        threading.Thread(target=_watch_parent, args=(stop,), daemon=True).start()
    return worker_main(sys.argv[1:], stop=stop)


if __name__ == "__main__":
    sys.exit(_main())
