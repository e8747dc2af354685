"""The per-GPU latency probe: the only module that imports cuda-python.

Two halves live here because the worker must be the same module (``python -m gpushare.node.probe``):

* **The worker** (:func:`worker_main`, :class:`ProbeWorker`), one process per GPU, started as an MPS
  client of that GPU (the caller passes ``CUDA_MPS_PIPE_DIRECTORY``). It compiles a tiny fixed spin
  kernel once with NVRTC to a CUBIN for the device's compute capability, then every probe period
  launches it (1 block x 32 threads) on a highest-priority stream and writes one JSON line to stdout
  with the wait-plus-run time from CUDA events and the run time the kernel measured itself
  (``%globaltimer`` around a ``clock64()`` spin). It supports the cuda-bindings 13.x layout
  (``cuda.bindings.driver``) and the 12.x one (``cuda.cuda``) and says which it uses. On a sticky
  CUDA error (700, 719, 807, 810) the context is unusable, so it exits with
  :data:`EXIT_STICKY` and the parent restarts it with backoff.
* **The parent** (:class:`ProbeManager`, implementing :class:`gpushare.node.base.LatencyProbe`):
  supervises the workers, keeps a window of readings per GPU, reports the window's p99 and its ratio
  to a baseline learned while no offline client runs. Without a driver every reading says
  ``"unavailable: <why>"`` and nothing else breaks.

**Each probe worker occupies one MPS client slot on its GPU** (mps.md: contexts count against the
client limit), reported by :meth:`ProbeManager.mps_client_slots` and :meth:`ProbeManager.status`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import structlog

from gpushare.config import ProbeConfig
from gpushare.logs import configure_logging
from gpushare.model import ProbeReading

if TYPE_CHECKING:
    from gpushare.node.base import LatencyProbe

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

# Baseline: at least this many probe samples taken without offline work.
BASELINE_MIN_SAMPLES = 20
# A worker that ran at least this long before failing restarts at the minimum backoff again.
HEALTHY_RUN_S = 60.0


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
            "cuda-python is not installed: `pip install 'cuda-bindings==13.*'` (driver >= 580) "
            "or `pip install 'cuda-bindings==12.*'` (older drivers)"
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


# --------------------------------------------------------------------------------- parent


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class ProbeWindow:
    """Sliding window of one GPU's probe samples, with a baseline learned without offline work.

    Pure bookkeeping (time is passed in), so it is tested without processes.

    Args:
        window_s: the p99 is taken over the samples of this long.
        baseline_window_s: the baseline is the p99 of quiet samples over this long. When offline
            work runs throughout, the last learned baseline is kept (and its age reported).
        period_s: the probe period, to tell a stalled probe from a slow one.
    """

    def __init__(self, window_s: float, baseline_window_s: float, period_s: float) -> None:
        self.window_s = window_s
        self.baseline_window_s = baseline_window_s
        self.period_s = period_s
        self._samples: deque[tuple[float, float, float]] = deque()
        self._quiet: deque[tuple[float, float]] = deque()
        self.offline_running = True  # until told otherwise, assume the worst: no baseline
        self.baseline_ms: float | None = None
        self.baseline_at_s: float | None = None
        self.last_at_s: float | None = None

    def add(self, at_s: float, latency_ms: float, run_ms: float) -> None:
        """Record one probe sample taken at ``at_s``."""
        self._samples.append((at_s, latency_ms, run_ms))
        self.last_at_s = at_s
        if not self.offline_running:
            self._quiet.append((at_s, latency_ms))
        self._prune(at_s)
        if len(self._quiet) >= BASELINE_MIN_SAMPLES and not self.offline_running:
            self.baseline_ms = percentile([v for _, v in self._quiet], 99)
            self.baseline_at_s = at_s

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        while self._quiet and self._quiet[0][0] < now - self.baseline_window_s:
            self._quiet.popleft()

    def clear(self) -> None:
        """Forget the samples (not the baseline), e.g. after the worker restarted."""
        self._samples.clear()
        self.last_at_s = None

    def reading(self, now: float, reason_if_empty: str = "no samples yet") -> ProbeReading:
        """The window's p99 at ``now``; a stalled probe counts as at least its stall time."""
        self._prune(now)
        if not self._samples:
            return ProbeReading(baseline_ms=self.baseline_ms, reason=reason_if_empty)
        latency = percentile([s[1] for s in self._samples], 99)
        run = percentile([s[2] for s in self._samples], 99)
        if self.last_at_s is not None:
            # A probe launch that has not come back is waiting for SMs right now: its latency is
            # at least the time since the last sample, less one period.
            stalled_ms = (now - self.last_at_s - self.period_s) * 1000
            latency = max(latency, stalled_ms)
        ratio = latency / self.baseline_ms if self.baseline_ms else None
        reason = None if ratio is not None else "no baseline yet: needs quiet samples"
        return ProbeReading(
            latency_ms=latency,
            run_ms=run,
            baseline_ms=self.baseline_ms,
            ratio=ratio,
            samples=len(self._samples),
            reason=reason,
        )


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """What ``gpushare status`` shows about one GPU's probe."""

    gpu_uuid: str
    state: str
    mps_client_slots: int
    pid: int | None = None
    bindings: str | None = None
    compute_capability: str | None = None
    mps_enabled: bool | None = None
    restarts: int = 0
    last_error: str | None = None


class _GpuProbe:
    """Supervision state of one GPU's worker (guarded by the manager's lock)."""

    def __init__(self, uuid: str, env: Mapping[str, str], window: ProbeWindow) -> None:
        self.uuid = uuid
        self.env = dict(env)
        self.window = window
        self.state = "starting"
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        self.bindings: str | None = None
        self.compute_capability: str | None = None
        self.mps_enabled: bool | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.unavailable: str | None = None
        self.stop = threading.Event()


class ProbeManager:
    """Runs one probe worker per GPU and turns their samples into :class:`ProbeReading` values.

    Args:
        config: the ``[probe]`` section.
        worker_argv: the command of a worker for a GPU (default: this module under the daemon's
            Python); tests substitute a worker with a fake driver.
        clock: monotonic clock (sample times, window, stall detection).
    """

    def __init__(
        self,
        config: ProbeConfig,
        *,
        worker_argv: Callable[[str], Sequence[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._worker_argv = worker_argv or self._default_argv
        self._clock = clock
        self._lock = threading.Lock()
        self._gpus: dict[str, _GpuProbe] = {}
        self._closed = False

    def _default_argv(self, gpu_uuid: str) -> list[str]:
        c = self.config
        return [
            sys.executable,
            "-m",
            "gpushare.node.probe",
            "--gpu",
            gpu_uuid,
            "--period-s",
            repr(c.period_s),
            "--cycles",
            str(c.kernel_spin_cycles),
            "--watch-stdin",
        ]

    def start(self, gpu_uuid: str, env: Mapping[str, str]) -> None:
        """Start (and keep restarting) the probe worker of a GPU.

        Args:
            gpu_uuid: the GPU.
            env: the worker's whole environment, with ``CUDA_MPS_PIPE_DIRECTORY`` and
                ``CUDA_MPS_LOG_DIRECTORY`` of that GPU's MPS daemon, so it runs as an MPS client.
                ``CUDA_VISIBLE_DEVICES`` defaults to the UUID and ``CUDA_MPS_CLIENT_PRIORITY`` to 0
                (the probe measures what a normal-priority online client sees).
        """
        c = self.config
        full_env = dict(env)
        full_env.setdefault("CUDA_VISIBLE_DEVICES", gpu_uuid)
        full_env.setdefault("CUDA_MPS_CLIENT_PRIORITY", "0")
        with self._lock:
            if self._closed:
                raise RuntimeError("the probe manager is closed")
            if gpu_uuid in self._gpus:
                return
            probe = _GpuProbe(
                gpu_uuid, full_env, ProbeWindow(c.window_s, c.baseline_window_s, c.period_s)
            )
            self._gpus[gpu_uuid] = probe
            if not c.enabled:
                probe.state = "disabled"
                return
            probe.thread = threading.Thread(
                target=self._supervise, args=(probe,), name=f"probe-{gpu_uuid[:12]}", daemon=True
            )
            probe.thread.start()

    def _supervise(self, probe: _GpuProbe) -> None:
        c = self.config
        backoff = c.restart_backoff_min_s
        while not probe.stop.is_set():
            started = self._clock()
            code = self._run_once(probe)
            if probe.stop.is_set():
                break
            ran_s = self._clock() - started
            if ran_s >= HEALTHY_RUN_S:
                backoff = c.restart_backoff_min_s
            if code == EXIT_UNAVAILABLE:
                # A missing driver does not come back by itself soon; try rarely.
                wait_s = c.restart_backoff_max_s
            else:
                wait_s = backoff
                backoff = min(backoff * 2, c.restart_backoff_max_s)
            with self._lock:
                probe.state = "unavailable" if code == EXIT_UNAVAILABLE else "restarting"
                probe.restarts += 1
            log.warning(
                "probe_restart_scheduled",
                gpu=probe.uuid,
                exit_code=code,
                wait_s=wait_s,
                error=probe.last_error,
            )
            probe.stop.wait(wait_s)

    def _run_once(self, probe: _GpuProbe) -> int:
        argv = list(self._worker_argv(probe.uuid))
        try:
            # A long-lived child that streams JSON lines: exec.run (bounded one-shot commands)
            # does not fit, so this is the one Popen of the probe.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=probe.env,
            )
        except OSError as exc:
            with self._lock:
                probe.last_error = f"cannot start the probe worker: {exc}"
            return EXIT_ERROR
        with self._lock:
            probe.proc = proc
            probe.state = "starting"
        log.info("probe_started", gpu=probe.uuid, pid=proc.pid)
        assert proc.stdout is not None
        for raw in proc.stdout:
            self._on_line(probe, raw)
        code = proc.wait()
        proc.stdout.close()
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with self._lock:
            probe.proc = None
            probe.window.clear()
        return code

    def _on_line(self, probe: _GpuProbe, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError):
            log.debug(
                "probe_worker_output", gpu=probe.uuid, line=raw[:200].decode(errors="replace")
            )
            return
        now = self._clock()
        with self._lock:
            if kind == "sample":
                probe.state = "running"
                probe.window.add(now, float(msg["latency_ms"]), float(msg["run_ms"]))
            elif kind == "hello":
                probe.bindings = f"{msg.get('bindings')} {msg.get('bindings_version')}"
            elif kind == "ready":
                probe.compute_capability = msg.get("compute_capability")
                probe.mps_enabled = msg.get("mps_enabled")
                probe.unavailable = None
                probe.state = "running"
            elif kind == "unavailable":
                probe.unavailable = str(msg.get("reason"))
                probe.last_error = probe.unavailable
                probe.state = "unavailable"
            elif kind == "error":
                probe.last_error = str(msg.get("message"))
        if kind == "ready":
            log.info("probe_ready", gpu=probe.uuid, **{k: v for k, v in msg.items() if k != "type"})
            if msg.get("mps_enabled") is False:
                log.warning(
                    "probe_not_under_mps",
                    gpu=probe.uuid,
                    hint="check CUDA_MPS_PIPE_DIRECTORY: the probe bypassed MPS",
                )
        elif kind in ("unavailable", "error"):
            log.warning("probe_worker_failed", gpu=probe.uuid, kind=kind, error=probe.last_error)

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's p99 over its window on one GPU; never raises."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is None:
                return ProbeReading(reason="unavailable: no probe started on this GPU")
            if probe.state == "disabled":
                return ProbeReading(reason="unavailable: probe disabled in config")
            if probe.unavailable is not None:
                return ProbeReading(reason=f"unavailable: {probe.unavailable}")
            if probe.state == "restarting":
                why = f"probe restarting after: {probe.last_error}"
                return ProbeReading(baseline_ms=probe.window.baseline_ms, reason=why)
            return probe.window.reading(self._clock())

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        """Tell the probe whether offline work runs on a GPU (the baseline is learned without)."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is not None:
                probe.window.offline_running = running

    def mps_client_slots(self, gpu_uuid: str) -> int:
        """MPS client slots the probe occupies on a GPU: 1 while its worker runs, else 0."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            return _slots(probe) if probe is not None else 0

    def status(self, gpu_uuid: str) -> ProbeStatus:
        """The probe's state on a GPU, for ``gpushare status`` (says it holds an MPS slot)."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is None:
                return ProbeStatus(gpu_uuid=gpu_uuid, state="not_started", mps_client_slots=0)
            return ProbeStatus(
                gpu_uuid=gpu_uuid,
                state=probe.state,
                mps_client_slots=_slots(probe),
                pid=probe.proc.pid if probe.proc is not None else None,
                bindings=probe.bindings,
                compute_capability=probe.compute_capability,
                mps_enabled=probe.mps_enabled,
                restarts=probe.restarts,
                last_error=probe.last_error,
            )

    def stop(self, gpu_uuid: str, timeout_s: float = 5.0) -> None:
        """Stop one GPU's worker (SIGTERM, then SIGKILL after ``timeout_s``)."""
        with self._lock:
            probe = self._gpus.pop(gpu_uuid, None)
        if probe is not None:
            self._stop_probe(probe, timeout_s)

    def _stop_probe(self, probe: _GpuProbe, timeout_s: float) -> None:
        probe.stop.set()
        with self._lock:
            proc = probe.proc
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if probe.thread is not None:
            probe.thread.join(timeout=timeout_s)

    def close(self) -> None:
        """Stop every probe worker."""
        with self._lock:
            self._closed = True
            probes = list(self._gpus.values())
            self._gpus.clear()
        for probe in probes:
            self._stop_probe(probe, 5.0)


def _slots(probe: _GpuProbe) -> int:
    # A live worker holds (or is opening) one MPS client context; one without a driver does not.
    return 1 if probe.proc is not None and probe.unavailable is None else 0


if TYPE_CHECKING:  # ProbeManager is what the daemon holds as its LatencyProbe

    def _conforms(m: ProbeManager) -> LatencyProbe:
        return m


if __name__ == "__main__":
    sys.exit(_main())


def nvrtc_status() -> tuple[bool, str, str]:
    """Whether NVRTC compiles the probe kernel: ``(ok, what was seen, hint)``.

    The probe compiles its kernel at start; the driver does not ship NVRTC (the CUDA toolkit or
    the ``nvidia-cuda-nvrtc`` wheel does). Compiling needs no GPU, so this is a real compile for
    ``sm_75``, the oldest architecture current toolkits target. ``gpushare doctor`` shows it.
    """
    try:
        b = load_bindings()
        cubin = compile_cubin(b.nvrtc, 7, 5)
    except ProbeUnavailableError as exc:
        return False, str(exc), ""
    except driver_missing_errors() as exc:
        return (
            False,
            f"libnvrtc not found ({exc})",
            "install NVRTC: the CUDA toolkit, or `pip install nvidia-cuda-nvrtc` matching "
            "the cuda-bindings major version",
        )
    except ProbeError as exc:
        return False, str(exc), "the NVRTC and cuda-bindings versions must match"
    return True, f"probe kernel compiled ({len(cubin)}-byte CUBIN for sm_75)", ""


def driver_status() -> tuple[bool, str, str]:
    """Whether the CUDA driver answers through cuda-python: ``(ok, what was seen, hint)``.

    This is what the latency probe needs; ``gpushare doctor`` shows it.
    """
    try:
        b = load_bindings()
        cu = b.driver
        _check("cuInit", cu.cuInit(0))
        version = _check("cuDriverGetVersion", cu.cuDriverGetVersion())
        count = _check("cuDeviceGetCount", cu.cuDeviceGetCount())
    except ProbeUnavailableError as exc:
        return False, str(exc), ""
    except driver_missing_errors() as exc:
        return (
            False,
            f"libcuda not found ({exc})",
            "install the NVIDIA driver; it ships libcuda.so.1",
        )
    except ProbeError as exc:
        return (
            False,
            str(exc),
            "check `nvidia-smi`; a driver/library version mismatch needs a reboot",
        )
    major, minor = int(version) // 1000, (int(version) % 1000) // 10
    return (
        True,
        f"CUDA {major}.{minor} driver, {count} device(s), bindings {b.name} {b.version}",
        "",
    )
