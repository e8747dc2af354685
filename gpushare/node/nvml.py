"""NVML telemetry: the only module that imports pynvml (package ``nvidia-ml-py``).

:class:`NvmlBackend` implements :class:`gpushare.node.base.GpuBackend`: one frozen
:class:`~gpushare.model.GpuSample` per GPU per tick, XID events from a thread of their own, and
the compute-mode switch the MPS supervisor needs. Its neighbours hold what needs no pynvml: the
return codes and our errors (:mod:`~gpushare.node.nvml_errors`), the call thread
(:mod:`~gpushare.node.nvml_worker`) and the checks for people, ``gpushare doctor``'s line and
``python -m gpushare.node.nvml_diag`` (:mod:`~gpushare.node.nvml_diag`). The backend's own parts
need no pynvml either: each call under the error policy below (:mod:`~gpushare.node.nvml_calls`),
the readings of several calls (:mod:`~gpushare.node.nvml_readers`) and the XID event thread
(:mod:`~gpushare.node.nvml_events`); this module loads pynvml and hands it to them.

Error policy (every NVML function goes through :meth:`~gpushare.node.nvml_calls.NvmlCalls.call`):

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
import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import structlog

from gpushare.model import GpuEvent, GpuSample
from gpushare.node.nvml_calls import NvmlCalls, NvmlGpu
from gpushare.node.nvml_errors import (
    FATAL_XIDS,
    INIT_HINTS,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    GpuLostError,
    NvmlError,
    NvmlInitError,
    error_code,
)
from gpushare.node.nvml_events import XidWatcher
from gpushare.node.nvml_readers import gpm_sm_active, processes, sm_periods
from gpushare.node.nvml_worker import Worker

if TYPE_CHECKING:
    from gpushare.node.base import ComputeModeControl, DaemonGpuBackend

log = structlog.get_logger(__name__)

COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
# "prohibited" is settable so that a supervisor can restore a GPU an operator had prohibited.
SETTABLE_COMPUTE_MODES = {"default": 0, "prohibited": 2, "exclusive_process": 3}

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1


def _load_pynvml() -> Any:
    # Importing pynvml never touches the driver (it loads libnvidia-ml lazily in nvmlInit).
    import pynvml

    return pynvml


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
        self.call_timeout_s = call_timeout_s
        self.init_timeout_s = init_timeout_s
        self.event_wait_ms = event_wait_ms
        self._events_enabled = events
        self._clock = clock
        self._wall_clock = wall_clock
        self._init_retry_s = init_retry_s
        self._lock = threading.Lock()
        self._initialized = False
        self._closed = False
        self._init_error: NvmlInitError | None = None
        self._init_failed_at_s = 0.0
        self._system: Worker | None = None
        self._init_future: Future[list[NvmlGpu]] | None = None
        self._gpus: list[NvmlGpu] = []
        self._calls = NvmlCalls(nvml)
        self._xids = XidWatcher(
            self._calls, wait_ms=event_wait_ms, wall_clock=wall_clock, fatal_xids=fatal_xids
        )

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
        if self._calls.nv is None:
            self._calls.nv = _load_pynvml()
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
            gpus: list[NvmlGpu] = fut.result(timeout=self.init_timeout_s)
        except FutureTimeoutError:
            # Kept, not abandoned: if the driver wakes up, the next attempt takes its result.
            self._init_future = fut
            raise self._init_timeout_error() from None
        self._gpus = gpus
        self._initialized = True
        log.info("nvml_ready", gpus=len(gpus), uuids=[g.uuid for g in gpus])
        if self._events_enabled and gpus:
            self._xids.start(gpus)

    def _init_timeout_error(self) -> NvmlInitError:
        return NvmlInitError(
            "nvmlInit",
            None,
            f"NVML did not initialise within {self.init_timeout_s:g}s.\n"
            "HINT: enable persistence mode (`nvidia-smi -pm 1`) so the driver keeps the GPUs "
            "initialised, and check `dmesg` for NVRM errors.",
        )

    def _init_and_discover(self) -> list[NvmlGpu]:
        nv = self._calls.nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            code = error_code(exc)
            hint = INIT_HINTS.get(code if code is not None else -1, "")
            msg = f"{exc}" + (f"\n{hint}" if hint else "")
            raise NvmlInitError("nvmlInit", code, msg) from exc
        try:
            count = self._calls.call(None, "nvmlDeviceGetCount")
        except NvmlError as exc:
            raise NvmlInitError("nvmlDeviceGetCount", exc.code, str(exc)) from exc
        gpus = []
        for index in range(count or 0):
            gpus.append(self._discover(index))
        return gpus

    def _discover(self, index: int) -> NvmlGpu:
        worker = Worker(f"nvml-gpu{index}")
        gpu = NvmlGpu(index=index, uuid=f"unknown-gpu{index}", handle=None, worker=worker)
        try:
            gpu.handle = self._calls.call(gpu, "nvmlDeviceGetHandleByIndex", index)
            uuid = self._calls.call(gpu, "nvmlDeviceGetUUID", gpu.handle)
            if uuid:
                gpu.uuid = _text(uuid)
            name = self._calls.call(gpu, "nvmlDeviceGetName", gpu.handle)
            gpu.name = _text(name) if name is not None else None
            gpu.sm_count = self._sm_count(gpu)
        except GpuLostError as exc:
            gpu.discovery_error = f"gpu lost at discovery: {exc}"
        except NvmlError as exc:
            gpu.discovery_error = f"discovery failed: {exc}"
        if gpu.discovery_error:
            log.error("nvml_gpu_discovery_failed", gpu=index, error=gpu.discovery_error)
        return gpu

    def _sm_count(self, gpu: NvmlGpu) -> int | None:
        attrs = self._calls.call(gpu, "nvmlDeviceGetAttributes_v2", gpu.handle)
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
        event_thread_done = self._xids.stop()
        system = self._system
        if initialized and system is not None:

            def shutdown() -> None:
                # Freeing the set under a thread still waiting on it is undefined: skip it then.
                if event_thread_done:
                    self._xids.free_set()
                with contextlib.suppress(NvmlError, GpuLostError):
                    self._calls.call(None, "nvmlShutdown")

            with contextlib.suppress(FutureTimeoutError):
                system.submit(shutdown).result(timeout=self.call_timeout_s)
        for gpu in self._gpus:
            gpu.worker.stop()
        if system is not None:
            system.stop()

    # ----------------------------------------------------------------------------- variants

    def chosen_variant(self, key: str) -> str | None:
        """The variant of a versioned function probed and remembered so far (``None``: not yet)."""
        return self._calls.chosen_variant(key)

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

    def _hung_sample(self, gpu: NvmlGpu, now: float) -> GpuSample:
        stuck_s = max(0.0, now - gpu.pending_since_s)
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            sm_count=gpu.sm_count,
            error=f"nvml call timed out: {gpu.in_call or 'unknown'} (stuck {stuck_s:.1f}s)",
            lost=True,
        )

    def _snapshot(self, gpu: NvmlGpu) -> GpuSample:
        """All readings of one GPU; runs on the GPU's worker thread."""
        gpu.errors = []
        calls = self._calls
        h = gpu.handle
        readings: dict[str, Any] = {}
        try:
            mem = calls.read(gpu, "nvmlDeviceGetMemoryInfo", h)
            if mem is not None:
                readings.update(
                    mem_total_bytes=int(mem.total),
                    mem_used_bytes=int(mem.used),
                    mem_free_bytes=int(mem.free),
                )
            util = calls.read(gpu, "nvmlDeviceGetUtilizationRates", h)
            if util is not None:
                readings.update(gpu_util_pct=float(util.gpu), mem_util_pct=float(util.memory))
            readings["sm_active_pct"] = gpm_sm_active(calls, gpu, self._clock)
            temp = calls.read_versioned(gpu, "temperature", h, NVML_TEMPERATURE_GPU)
            readings["temperature_c"] = _int_or_none(temp)
            readings["power_mw"] = _int_or_none(calls.read(gpu, "nvmlDeviceGetPowerUsage", h))
            readings["sm_clock_mhz"] = _int_or_none(
                calls.read(gpu, "nvmlDeviceGetClockInfo", h, NVML_CLOCK_SM)
            )
            readings["throttle_reasons"] = _int_or_none(
                calls.read_versioned(gpu, "clock_reasons", h)
            )
            readings["processes"] = processes(calls, gpu)
            readings["sm_periods"] = sm_periods(calls, gpu, self._wall_clock)
            mode = calls.read(gpu, "nvmlDeviceGetComputeMode", h)
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

    # ----------------------------------------------------------------------------- events

    def drain_events(self) -> tuple[GpuEvent, ...]:
        """XID events the event thread has seen since the last call."""
        return self._xids.drain()

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
                gpu, lambda: self._calls.call(gpu, "nvmlDeviceGetComputeMode", gpu.handle)
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
            self._on_gpu(
                gpu, lambda: self._calls.call_strict(gpu, "nvmlDeviceSetComputeMode", value)
            )
        except GpuLostError as exc:
            raise NvmlError("nvmlDeviceSetComputeMode", NVML_ERROR_GPU_IS_LOST, str(exc)) from exc
        except NvmlError as exc:
            if exc.code == NVML_ERROR_NO_PERMISSION:
                raise NvmlError(
                    exc.function, exc.code, f"{exc} (HINT: setting the compute mode needs root)"
                ) from exc
            raise
        log.info("nvml_compute_mode_set", gpu=uuid, mode=mode)

    def _gpu(self, uuid: str) -> NvmlGpu:
        with self._lock:
            self._ensure_init_locked(retry_now=True)
            gpus = list(self._gpus)
        for gpu in gpus:
            if gpu.uuid == uuid:
                return gpu
        known = ", ".join(g.uuid for g in gpus) or "none"
        raise NvmlError("lookup", None, f"no GPU with UUID {uuid}; this host has: {known}")

    def _on_gpu(self, gpu: NvmlGpu, fn: Callable[[], Any]) -> Any:
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
        return _text(self._calls.nv.nvmlSystemGetDriverVersion())


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


if TYPE_CHECKING:  # the adapter implements the Protocols the daemon holds it by

    def _conforms(b: NvmlBackend) -> tuple[DaemonGpuBackend, ComputeModeControl]:
        return b, b


if __name__ == "__main__":
    # The diagnostic command moved to nvml_diag: say so instead of exiting 0 having printed nothing.
    sys.exit("the NVML diagnostic command is `python -m gpushare.node.nvml_diag`")
