"""NVML telemetry: the only module that imports pynvml (package ``nvidia-ml-py``).

:class:`NvmlBackend` implements :class:`gpushare.node.base.GpuBackend`: one frozen
:class:`~gpushare.model.GpuSample` per GPU per tick, XID events from a thread of their own, and
the compute-mode switch the MPS supervisor needs. Its neighbours hold what needs no pynvml: the
return codes and our errors (:mod:`~gpushare.node.nvml_errors`), the call thread
(:mod:`~gpushare.node.nvml_worker`) and the checks for people, ``gpushare doctor``'s line and
``python -m gpushare.node.nvml_diag`` (:mod:`~gpushare.node.nvml_diag`).

Error policy (every NVML function goes through :meth:`NvmlBackend._call`):

* ``NotSupported`` and ``FunctionNotFound`` (and pynvml's ``NVMLLibraryMismatchError``, raised by
  unversioned aliases on an old driver) mean "this reading does not exist here": the reading is
  ``None`` and the function is logged once (``nvml_not_supported``), in a bounded set.
* ``GpuIsLost`` and ``Unknown`` mark that GPU lost: its sample has ``lost=True`` and ``error`` set,
  the other GPUs are sampled normally.
* Every other NVML error becomes our own :class:`NvmlError`; inside a tick it empties that one
  reading and is named in the sample's ``error``.

Time-boxing: NVML can hang in the kernel (a D-state thread cannot be killed or joined), so every
per-GPU call runs on that GPU's own daemon worker thread (:class:`~gpushare.node.nvml_worker.Worker`)
and the tick waits for all GPUs together at most ``call_timeout_s``. A GPU whose worker has not
answered by then is reported lost with ``error="nvml call timed out: <function>"``; nothing more is
queued to it until the stuck call returns, so threads never pile up on a stuck GPU. Init, discovery
and compute-mode calls are time-boxed the same way on a separate worker.

Versioned functions (``_v3``/``_v2``, ``…TemperatureV``, ``…ClocksEventReasons``) are probed once,
newest first, and the variant that exists is remembered for the life of the backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from gpushare.model import GpuEvent, GpuSample, ProcessMemory, SmPeriod
from gpushare.node.nvml_errors import (
    FATAL_XIDS,
    INIT_HINTS,
    LOST_CODES,
    NO_SAMPLES_CODES,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_TIMEOUT,
    UNSUPPORTED_CODES,
    GpuLostError,
    MissingFunctionError,
    NvmlError,
    NvmlInitError,
    error_code,
)
from gpushare.node.nvml_worker import Worker

if TYPE_CHECKING:
    from gpushare.node.base import ComputeModeControl, DaemonGpuBackend

log = structlog.get_logger(__name__)

COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
# "prohibited" is settable so that a supervisor can restore a GPU an operator had prohibited.
SETTABLE_COMPUTE_MODES = {"default": 0, "prohibited": 2, "exclusive_process": 3}

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRICS_GET_VERSION = 1
XID_CRITICAL_ERROR_EVENT = 0x8
# GPM samples closer than this give no metrics (nvml.md §7).
GPM_MIN_INTERVAL_S = 0.1
# The first per-process utilisation read looks back this far (nvitop reads the last second).
PROCESS_UTIL_LOOKBACK_S = 1.0
# Bounded memory for "logged once" bookkeeping, as nvitop does (UNKNOWN_FUNCTIONS_CACHE_SIZE).
_LOGGED_ONCE_MAX = 1024

# Newest variant first; the first that exists is remembered (nvitop/gpustat fallback tables).
VERSIONED: dict[str, tuple[str, ...]] = {
    "compute_processes": (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    ),
    "mps_processes": (
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    ),
    "temperature": ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
    "clock_reasons": (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ),
}


def _load_pynvml() -> Any:
    # Importing pynvml never touches the driver (it loads libnvidia-ml lazily in nvmlInit).
    import pynvml

    return pynvml


@dataclass
class _Gpu:
    """Mutable per-GPU state; the snapshot fields are only touched from the GPU's worker."""

    index: int
    uuid: str
    handle: Any
    worker: Worker
    name: str | None = None
    sm_count: int | None = None
    pending: Future[Any] | None = None
    pending_since_s: float = 0.0
    in_call: str | None = None
    gpm_supported: bool | None = None
    gpm_prev: tuple[Any, float] | None = None
    sm_active_pct: float | None = None
    #: False once per-process utilisation answered NotSupported (it never will on this GPU).
    process_util: bool = True
    #: NVML timestamp (us since the epoch) of the newest per-process sample read.
    process_util_seen_us: int | None = None
    discovery_error: str | None = None
    errors: list[str] = field(default_factory=list)


class NvmlBackend:
    """NVML readings for every GPU on the host, one frozen sample per GPU per tick.

    Args:
        call_timeout_s: the most one tick waits for all GPUs' readings together.
        init_timeout_s: the most ``nvmlInit`` plus device discovery may take.
        event_wait_ms: timeout of one ``nvmlEventSetWait`` in the event thread (finite, so the
            thread notices ``close``).
        events: read XID events on a thread of their own.
        nvml: the pynvml module, or an object with the same functions (tests); default pynvml.
        clock: monotonic clock, for GPM intervals and hang durations.
        wall_clock: time stamps of :class:`GpuEvent` (records shown to operators).
        fatal_xids: XIDs reported with ``fatal=True``.
        init_retry_s: after a failed init, how long ``sample`` waits before trying again.
    """

    #: Real GPUs (``daemon.simulated`` in ``gpushare status --json``).
    simulated = False

    def __init__(
        self,
        *,
        call_timeout_s: float = 0.5,
        init_timeout_s: float = 30.0,
        event_wait_ms: int = 500,
        events: bool = True,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        fatal_xids: frozenset[int] = FATAL_XIDS,
        init_retry_s: float = 30.0,
    ) -> None:
        if call_timeout_s <= 0 or init_timeout_s <= 0 or event_wait_ms <= 0:
            raise ValueError("call_timeout_s, init_timeout_s and event_wait_ms must be positive")
        self._nv = nvml
        self.call_timeout_s = call_timeout_s
        self.init_timeout_s = init_timeout_s
        self.event_wait_ms = event_wait_ms
        self._events_enabled = events
        self._clock = clock
        self._wall_clock = wall_clock
        self._fatal_xids = fatal_xids
        self._init_retry_s = init_retry_s
        self._lock = threading.Lock()
        self._initialized = False
        self._closed = False
        self._init_error: NvmlInitError | None = None
        self._init_failed_at_s = 0.0
        self._system: Worker | None = None
        self._init_future: Future[list[_Gpu]] | None = None
        self._gpus: list[_Gpu] = []
        self._chosen: dict[str, str] = {}
        self._chosen_lock = threading.Lock()
        self._logged_once: set[tuple[str, int]] = set()
        self._events: list[GpuEvent] = []
        self._events_lock = threading.Lock()
        self._event_stop = threading.Event()
        self._event_thread: threading.Thread | None = None
        self._event_set: Any = None

    # ----------------------------------------------------------------------------- life cycle

    def open(self) -> None:
        """Initialise NVML and discover the GPUs now (the daemon calls this before READY=1).

        Raises:
            NvmlInitError: NVML cannot be initialised; the message carries a HINT with the fix.
        """
        with self._lock:
            self._ensure_init_locked(retry_now=True)

    def _ensure_init_locked(self, *, retry_now: bool = False) -> None:
        if self._closed:
            raise NvmlInitError("nvmlInit", None, "the backend is closed")
        if self._initialized:
            return
        now = self._clock()
        if (
            self._init_error is not None
            and not retry_now
            and now - self._init_failed_at_s < self._init_retry_s
        ):
            raise self._init_error
        try:
            self._init_locked()
        except NvmlInitError as exc:
            self._init_error = exc
            self._init_failed_at_s = now
            log.error("nvml_init_failed", error=str(exc))  # noqa: TRY400 - no traceback: the HINT says it
            raise
        self._init_error = None

    def _init_locked(self) -> None:
        if self._nv is None:
            self._nv = _load_pynvml()
        if self._system is None:
            self._system = Worker("nvml-system")
        fut = self._init_future
        if fut is None:
            fut = self._system.submit(self._init_and_discover)
        elif not fut.done():
            # The last attempt is still stuck in the driver: queueing another would only pile up.
            raise self._init_timeout_error()
        self._init_future = None
        try:
            gpus: list[_Gpu] = fut.result(timeout=self.init_timeout_s)
        except FutureTimeoutError:
            # Kept, not abandoned: if the driver wakes up, the next attempt takes its result.
            self._init_future = fut
            raise self._init_timeout_error() from None
        self._gpus = gpus
        self._initialized = True
        log.info("nvml_ready", gpus=len(gpus), uuids=[g.uuid for g in gpus])
        if self._events_enabled and gpus:
            self._event_stop.clear()
            self._event_thread = threading.Thread(
                target=self._event_loop, name="nvml-events", daemon=True
            )
            self._event_thread.start()

    def _init_timeout_error(self) -> NvmlInitError:
        return NvmlInitError(
            "nvmlInit",
            None,
            f"NVML did not initialise within {self.init_timeout_s:g}s.\n"
            "HINT: enable persistence mode (`nvidia-smi -pm 1`) so the driver keeps the GPUs "
            "initialised, and check `dmesg` for NVRM errors.",
        )

    def _init_and_discover(self) -> list[_Gpu]:
        nv = self._nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            code = error_code(exc)
            hint = INIT_HINTS.get(code if code is not None else -1, "")
            msg = f"{exc}" + (f"\n{hint}" if hint else "")
            raise NvmlInitError("nvmlInit", code, msg) from exc
        try:
            count = self._call(None, "nvmlDeviceGetCount")
        except NvmlError as exc:
            raise NvmlInitError("nvmlDeviceGetCount", exc.code, str(exc)) from exc
        gpus = []
        for index in range(count or 0):
            gpus.append(self._discover(index))
        return gpus

    def _discover(self, index: int) -> _Gpu:
        worker = Worker(f"nvml-gpu{index}")
        gpu = _Gpu(index=index, uuid=f"unknown-gpu{index}", handle=None, worker=worker)
        try:
            gpu.handle = self._call(gpu, "nvmlDeviceGetHandleByIndex", index)
            uuid = self._call(gpu, "nvmlDeviceGetUUID", gpu.handle)
            if uuid:
                gpu.uuid = _text(uuid)
            name = self._call(gpu, "nvmlDeviceGetName", gpu.handle)
            gpu.name = _text(name) if name is not None else None
            gpu.sm_count = self._sm_count(gpu)
        except GpuLostError as exc:
            gpu.discovery_error = f"gpu lost at discovery: {exc}"
        except NvmlError as exc:
            gpu.discovery_error = f"discovery failed: {exc}"
        if gpu.discovery_error:
            log.error("nvml_gpu_discovery_failed", gpu=index, error=gpu.discovery_error)
        return gpu

    def _sm_count(self, gpu: _Gpu) -> int | None:
        attrs = self._call(gpu, "nvmlDeviceGetAttributes_v2", gpu.handle)
        if attrs is None:
            return None
        count = getattr(attrs, "multiprocessorCount", None)
        return int(count) if count else None

    def close(self) -> None:
        """Stop the event thread, free the event set and shut NVML down (bounded waits)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            initialized = self._initialized
            self._initialized = False
        self._event_stop.set()
        thread = self._event_thread
        event_thread_done = True
        if thread is not None:
            thread.join(timeout=self.event_wait_ms / 1000 + 1.0)
            event_thread_done = not thread.is_alive()
        system = self._system
        if initialized and system is not None:

            def shutdown() -> None:
                # Freeing the set under a thread still waiting on it is undefined: skip it then.
                if self._event_set is not None and event_thread_done:
                    with contextlib.suppress(NvmlError, GpuLostError):
                        self._call(None, "nvmlEventSetFree", self._event_set)
                with contextlib.suppress(NvmlError, GpuLostError):
                    self._call(None, "nvmlShutdown")

            with contextlib.suppress(FutureTimeoutError):
                system.submit(shutdown).result(timeout=self.call_timeout_s)
        for gpu in self._gpus:
            gpu.worker.stop()
        if system is not None:
            system.stop()

    # ----------------------------------------------------------------------------- policy

    def _call(self, gpu: _Gpu | None, fname: str, *args: Any, probe: bool = False) -> Any:
        """Run one NVML function under the error policy (see the module docstring).

        Returns ``None`` for NotSupported/FunctionNotFound. With ``probe=True`` a missing function
        raises :class:`MissingFunctionError` instead, so versioned lookups try the next variant.

        Raises:
            GpuLostError: GpuIsLost or Unknown.
            NvmlError: any other NVML error.
        """
        nv = self._nv
        fn = getattr(nv, fname, None)
        if fn is None:
            if probe:
                raise MissingFunctionError(fname)
            self._log_once(fname, NVML_ERROR_FUNCTION_NOT_FOUND, "not in this pynvml")
            return None
        if gpu is not None:
            gpu.in_call = fname
        try:
            return fn(*args)
        except nv.NVMLLibraryMismatchError as exc:
            if probe:
                raise MissingFunctionError(fname) from exc
            self._log_once(fname, NVML_ERROR_FUNCTION_NOT_FOUND, str(exc))
            return None
        except nv.NVMLError as exc:
            code = error_code(exc)
            if code in UNSUPPORTED_CODES:
                if probe and code == NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise MissingFunctionError(fname) from exc
                self._log_once(fname, code, str(exc))
                return None
            if code in LOST_CODES:
                raise GpuLostError(f"{fname}: {exc}") from exc
            raise NvmlError(fname, code, str(exc)) from exc
        finally:
            if gpu is not None:
                gpu.in_call = None

    def _call_versioned(self, gpu: _Gpu | None, key: str, *args: Any) -> Any:
        """Call the newest variant of ``key`` this driver has; remember it after the first try."""
        with self._chosen_lock:
            chosen = self._chosen.get(key)
        if chosen is not None:
            return self._call(gpu, chosen, *args)
        variants = VERSIONED[key]
        for fname in variants:
            try:
                result = self._call(gpu, fname, *args, probe=True)
            except MissingFunctionError:
                continue
            with self._chosen_lock:
                self._chosen[key] = fname
            log.debug("nvml_variant_chosen", function=key, variant=fname)
            return result
        self._log_once(variants[-1], NVML_ERROR_FUNCTION_NOT_FOUND, "no variant exists")
        return None

    def chosen_variant(self, key: str) -> str | None:
        """The variant of a versioned function probed and remembered so far (``None``: not yet)."""
        with self._chosen_lock:
            return self._chosen.get(key)

    def _log_once(self, fname: str, code: int, message: str) -> None:
        key = (fname, code)
        if key in self._logged_once or len(self._logged_once) >= _LOGGED_ONCE_MAX:
            return
        self._logged_once.add(key)
        log.info("nvml_not_supported", function=fname, code=code, message=message)

    # ----------------------------------------------------------------------------- sampling

    def sample(self) -> tuple[GpuSample, ...]:
        """Read every GPU once, all GPUs in parallel, within ``call_timeout_s``; never raises.

        Returns ``()`` while NVML cannot be initialised (the error is logged and retried).
        """
        with self._lock:
            try:
                self._ensure_init_locked()
            except NvmlInitError:
                return ()
            gpus = list(self._gpus)
        start = self._clock()
        waiting: dict[int, Future[Any]] = {}
        results: dict[int, GpuSample] = {}
        for gpu in gpus:
            if gpu.discovery_error is not None:
                results[gpu.index] = GpuSample(
                    index=gpu.index, uuid=gpu.uuid, error=gpu.discovery_error, lost=True
                )
                continue
            if gpu.pending is not None and not gpu.pending.done():
                results[gpu.index] = self._hung_sample(gpu, start)
                continue
            gpu.pending = gpu.worker.submit(functools.partial(self._snapshot, gpu))
            gpu.pending_since_s = start
            waiting[gpu.index] = gpu.pending
        if waiting:
            wait_futures(list(waiting.values()), timeout=self.call_timeout_s)
        for gpu in gpus:
            fut = waiting.get(gpu.index)
            if fut is None:
                continue
            if not fut.done():
                results[gpu.index] = self._hung_sample(gpu, self._clock())
                log.error("nvml_call_timed_out", gpu=gpu.uuid, function=gpu.in_call)
                continue
            gpu.pending = None
            try:
                results[gpu.index] = fut.result()
            except Exception as exc:  # noqa: BLE001 - _snapshot never raises; a last guard
                results[gpu.index] = GpuSample(
                    index=gpu.index, uuid=gpu.uuid, name=gpu.name, error=f"nvml: {exc}"
                )
        return tuple(results[i] for i in sorted(results))

    def _hung_sample(self, gpu: _Gpu, now: float) -> GpuSample:
        stuck_s = max(0.0, now - gpu.pending_since_s)
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            sm_count=gpu.sm_count,
            error=f"nvml call timed out: {gpu.in_call or 'unknown'} (stuck {stuck_s:.1f}s)",
            lost=True,
        )

    def _snapshot(self, gpu: _Gpu) -> GpuSample:
        """All readings of one GPU; runs on the GPU's worker thread."""
        gpu.errors = []
        h = gpu.handle
        readings: dict[str, Any] = {}
        try:
            mem = self._read(gpu, "nvmlDeviceGetMemoryInfo", h)
            if mem is not None:
                readings.update(
                    mem_total_bytes=int(mem.total),
                    mem_used_bytes=int(mem.used),
                    mem_free_bytes=int(mem.free),
                )
            util = self._read(gpu, "nvmlDeviceGetUtilizationRates", h)
            if util is not None:
                readings.update(gpu_util_pct=float(util.gpu), mem_util_pct=float(util.memory))
            readings["sm_active_pct"] = self._gpm_sm_active(gpu)
            temp = self._read_versioned(gpu, "temperature", h, NVML_TEMPERATURE_GPU)
            readings["temperature_c"] = _int_or_none(temp)
            readings["power_mw"] = _int_or_none(self._read(gpu, "nvmlDeviceGetPowerUsage", h))
            readings["sm_clock_mhz"] = _int_or_none(
                self._read(gpu, "nvmlDeviceGetClockInfo", h, NVML_CLOCK_SM)
            )
            readings["throttle_reasons"] = _int_or_none(
                self._read_versioned(gpu, "clock_reasons", h)
            )
            readings["processes"] = self._processes(gpu)
            readings["sm_periods"] = self._sm_periods(gpu)
            mode = self._read(gpu, "nvmlDeviceGetComputeMode", h)
            readings["compute_mode"] = COMPUTE_MODES.get(int(mode)) if mode is not None else None
        except GpuLostError as exc:
            log.warning("gpu_lost", gpu=gpu.uuid, error=str(exc))
            return GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                name=gpu.name,
                sm_count=gpu.sm_count,
                error=f"gpu lost: {exc}",
                lost=True,
            )
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            sm_count=gpu.sm_count,
            error="; ".join(gpu.errors) or None,
            **readings,
        )

    def _read(self, gpu: _Gpu, fname: str, *args: Any) -> Any:
        try:
            return self._call(gpu, fname, *args)
        except NvmlError as exc:
            gpu.errors.append(str(exc))
            return None

    def _read_versioned(self, gpu: _Gpu, key: str, *args: Any) -> Any:
        try:
            return self._call_versioned(gpu, key, *args)
        except NvmlError as exc:
            gpu.errors.append(str(exc))
            return None

    def _processes(self, gpu: _Gpu) -> tuple[ProcessMemory, ...]:
        # Compute list: the MPS server and non-MPS processes; MPS list: the MPS clients.
        found: dict[int, ProcessMemory] = {}
        for key in ("compute_processes", "mps_processes"):
            procs = self._read_versioned(gpu, key, gpu.handle) or ()
            for p in procs:
                pid = int(p.pid)
                used = p.usedGpuMemory
                mem = ProcessMemory(pid=pid, used_bytes=int(used) if used is not None else None)
                if pid not in found or found[pid].used_bytes is None:
                    found[pid] = mem
        return tuple(found[pid] for pid in sorted(found))

    def _sm_periods(self, gpu: _Gpu) -> tuple[SmPeriod, ...] | None:
        """The driver's per-process SM sampling periods newer than the last one read.

        ``nvmlDeviceGetProcessUtilization(handle, lastSeenTimeStamp)`` returns one record per
        process with non-zero utilisation per sampling period since ``lastSeenTimeStamp`` (CPU
        time in us), stamped with the period's end; records with one stamp are one period.
        ``None`` where the driver has no per-process utilisation (NotSupported, e.g. MIG).
        """
        if not gpu.process_util:
            return None
        since = gpu.process_util_seen_us
        if since is None:
            since = int((self._wall_clock() - PROCESS_UTIL_LOOKBACK_S) * 1e6)
        try:
            records = self._call(gpu, "nvmlDeviceGetProcessUtilization", gpu.handle, since)
        except NvmlError as exc:
            if exc.code in NO_SAMPLES_CODES:
                gpu.process_util_seen_us = since
                return ()
            gpu.errors.append(str(exc))
            return None
        if records is None:
            gpu.process_util = False
            return None
        periods: dict[int, set[int]] = {}
        for r in records:
            busy = periods.setdefault(int(r.timeStamp), set())
            if int(r.smUtil) > 0:
                busy.add(int(r.pid))
        if periods:
            gpu.process_util_seen_us = max(since, *periods)
        else:
            gpu.process_util_seen_us = since
        return tuple(
            SmPeriod(at_wall_s=stamp / 1e6, pids=tuple(sorted(periods[stamp])))
            for stamp in sorted(periods)
            if stamp > since
        )

    def _gpm_sm_active(self, gpu: _Gpu) -> float | None:
        """Device SM activity from GPM (Hopper+); ``None`` where GPM does not exist."""
        nv = self._nv
        if gpu.gpm_supported is None:
            support = self._read(gpu, "nvmlGpmQueryDeviceSupport", gpu.handle)
            gpu.gpm_supported = bool(support is not None and support.isSupportedDevice)
            if not gpu.gpm_supported:
                log.info("nvml_gpm_unsupported", gpu=gpu.uuid)
        if not gpu.gpm_supported:
            return None
        now = self._clock()
        if gpu.gpm_prev is not None and now - gpu.gpm_prev[1] < GPM_MIN_INTERVAL_S:
            return gpu.sm_active_pct
        new = self._read(gpu, "nvmlGpmSampleAlloc")
        if new is None:
            return None
        if self._read(gpu, "nvmlGpmSampleGet", gpu.handle, new) is None:
            self._read(gpu, "nvmlGpmSampleFree", new)
            return None
        prev, gpu.gpm_prev = gpu.gpm_prev, (new, now)
        if prev is None:
            return None
        try:
            req = nv.c_nvmlGpmMetricsGet_t()
            req.version = NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = 1
            req.sample1 = prev[0]
            req.sample2 = new
            req.metrics[0].metricId = NVML_GPM_METRIC_SM_UTIL
            got = self._read(gpu, "nvmlGpmMetricsGet", req)
            metric = got.metrics[0] if got is not None else None
            if metric is not None and int(metric.nvmlReturn) == 0:
                gpu.sm_active_pct = float(metric.value)
            else:
                gpu.sm_active_pct = None
        finally:
            self._read(gpu, "nvmlGpmSampleFree", prev[0])
        return gpu.sm_active_pct

    # ----------------------------------------------------------------------------- events

    def drain_events(self) -> tuple[GpuEvent, ...]:
        """XID events the event thread has seen since the last call."""
        with self._events_lock:
            events, self._events = tuple(self._events), []
        return events

    def _event_loop(self) -> None:
        by_handle: dict[Any, str] = {}
        try:
            self._event_set = self._call(None, "nvmlEventSetCreate")
            if self._event_set is None:
                return
            for gpu in self._gpus:
                if gpu.discovery_error is not None:
                    continue
                by_handle[_handle_key(gpu.handle)] = gpu.uuid
                try:
                    self._call(
                        None,
                        "nvmlDeviceRegisterEvents",
                        gpu.handle,
                        XID_CRITICAL_ERROR_EVENT,
                        self._event_set,
                    )
                except (NvmlError, GpuLostError) as exc:
                    log.warning("nvml_event_register_failed", gpu=gpu.uuid, error=str(exc))
        except (NvmlError, GpuLostError) as exc:
            log.warning("nvml_event_set_failed", error=str(exc))
            return
        log.info("nvml_events_started", gpus=len(by_handle))
        while not self._event_stop.is_set():
            try:
                data = self._call(None, "nvmlEventSetWait_v2", self._event_set, self.event_wait_ms)
            except NvmlError as exc:
                if exc.code == NVML_ERROR_TIMEOUT:
                    continue
                log.warning("nvml_event_wait_failed", error=str(exc))
                self._event_stop.wait(1.0)
                continue
            except GpuLostError as exc:
                log.warning("nvml_event_wait_gpu_lost", error=str(exc))
                self._event_stop.wait(1.0)
                continue
            if data is None:
                # NotSupported: the set is unusable on this host; stop instead of spinning.
                return
            self._on_event(data, by_handle)

    def _on_event(self, data: Any, by_handle: dict[Any, str]) -> None:
        if int(data.eventType) & XID_CRITICAL_ERROR_EVENT == 0:
            return
        uuid = by_handle.get(_handle_key(data.device), "unknown")
        xid = int(data.eventData)
        event = GpuEvent(
            gpu_uuid=uuid, xid=xid, at_s=self._wall_clock(), fatal=xid in self._fatal_xids
        )
        log.warning("gpu_xid", gpu=uuid, xid=xid, fatal=event.fatal)
        with self._events_lock:
            self._events.append(event)

    # ----------------------------------------------------------------------------- compute mode

    def get_compute_mode(self, uuid: str) -> str | None:
        """The GPU's compute mode (``"default"``, ``"exclusive_process"``, ``"prohibited"``).

        ``None`` when it cannot be read (not supported, GPU lost or hung). Never raises for an
        NVML error; an unknown UUID raises.

        Raises:
            NvmlError: no GPU with this UUID, or NVML cannot be initialised.
        """
        gpu = self._gpu(uuid)
        try:
            mode = self._on_gpu(
                gpu, lambda: self._call(gpu, "nvmlDeviceGetComputeMode", gpu.handle)
            )
        except (NvmlError, GpuLostError) as exc:
            log.warning("nvml_compute_mode_unreadable", gpu=uuid, error=str(exc))
            return None
        return COMPUTE_MODES.get(int(mode)) if mode is not None else None

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """Set the GPU's compute mode (root only): ``"exclusive_process"``, ``"default"`` or ``"prohibited"``.

        Raises:
            ValueError: ``mode`` is not one of the two.
            NvmlError: unknown GPU, no permission (run as root), not supported, lost or hung.
        """
        if mode not in SETTABLE_COMPUTE_MODES:
            valid = ", ".join(repr(m) for m in SETTABLE_COMPUTE_MODES)
            raise ValueError(f"unknown compute mode {mode!r}; use one of {valid}")
        gpu = self._gpu(uuid)
        value = SETTABLE_COMPUTE_MODES[mode]
        try:
            self._on_gpu(gpu, lambda: self._call_strict(gpu, "nvmlDeviceSetComputeMode", value))
        except GpuLostError as exc:
            raise NvmlError("nvmlDeviceSetComputeMode", NVML_ERROR_GPU_IS_LOST, str(exc)) from exc
        except NvmlError as exc:
            if exc.code == NVML_ERROR_NO_PERMISSION:
                raise NvmlError(
                    exc.function, exc.code, f"{exc} (HINT: setting the compute mode needs root)"
                ) from exc
            raise
        log.info("nvml_compute_mode_set", gpu=uuid, mode=mode)

    def _call_strict(self, gpu: _Gpu, fname: str, value: int) -> None:
        """A setter call where NotSupported is an error, not a missing reading."""
        nv = self._nv
        gpu.in_call = fname
        try:
            getattr(nv, fname)(gpu.handle, value)
        except nv.NVMLError as exc:
            code = error_code(exc)
            if code in LOST_CODES:
                raise GpuLostError(f"{fname}: {exc}") from exc
            raise NvmlError(fname, code, str(exc)) from exc
        finally:
            gpu.in_call = None

    def _gpu(self, uuid: str) -> _Gpu:
        with self._lock:
            self._ensure_init_locked(retry_now=True)
            gpus = list(self._gpus)
        for gpu in gpus:
            if gpu.uuid == uuid:
                return gpu
        known = ", ".join(g.uuid for g in gpus) or "none"
        raise NvmlError("lookup", None, f"no GPU with UUID {uuid}; this host has: {known}")

    def _on_gpu(self, gpu: _Gpu, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the GPU's worker within ``call_timeout_s``."""
        if gpu.discovery_error is not None:
            raise NvmlError("lookup", None, gpu.discovery_error)
        if gpu.pending is not None and not gpu.pending.done():
            raise NvmlError(gpu.in_call or "nvml", None, "nvml call timed out (GPU is stuck)")
        fut = gpu.worker.submit(fn)
        try:
            return fut.result(timeout=self.call_timeout_s)
        except FutureTimeoutError:
            # The GPU's worker is stuck: sample() now reports it lost and queues nothing more.
            gpu.pending, gpu.pending_since_s = fut, self._clock()
            raise NvmlError(gpu.in_call or "nvml", None, "nvml call timed out") from None

    def gpu_uuids(self) -> Sequence[str]:
        """The UUIDs of the GPUs found at init (initialising NVML if needed).

        Raises:
            NvmlInitError: NVML cannot be initialised.
        """
        with self._lock:
            self._ensure_init_locked(retry_now=True)
            return [g.uuid for g in self._gpus]

    def driver_version(self) -> str:
        """The driver's version string (initialising NVML if needed), for ``gpushare doctor``.

        Called on the caller's thread, not time-boxed: the doctor, not the daemon, asks it.

        Raises:
            NvmlInitError: NVML cannot be initialised.
            Exception: whatever pynvml raises for the call.
        """
        with self._lock:
            self._ensure_init_locked(retry_now=True)
        return _text(self._nv.nvmlSystemGetDriverVersion())


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


def _handle_key(handle: Any) -> Any:
    """A hashable key equal for two handles of the same device (ctypes pointers compare by id)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


if TYPE_CHECKING:  # the adapter implements the Protocols the daemon holds it by

    def _conforms(b: NvmlBackend) -> tuple[DaemonGpuBackend, ComputeModeControl]:
        return b, b


if __name__ == "__main__":
    # The diagnostic command moved to nvml_diag: say so instead of exiting 0 having printed nothing.
    sys.exit("the NVML diagnostic command is `python -m gpushare.node.nvml_diag`")
