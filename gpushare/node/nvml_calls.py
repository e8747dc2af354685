"""How one NVML function is called: the error policy, versioned variants, and one GPU's state.

:class:`NvmlCalls` is the policy of :mod:`gpushare.node.nvml`'s docstring ("Error policy"): every
NVML function the backend calls goes through :meth:`NvmlCalls.call`. It holds the pynvml module
as an object (``nv``) and imports nothing of NVML itself, so it passes ruff's ban on ``pynvml``;
only :mod:`gpushare.node.nvml` loads the library and hands it over. :class:`NvmlGpu` is one GPU's
mutable state, shared by the backend, the per-GPU readers (:mod:`~gpushare.node.nvml_readers`)
and the XID watcher (:mod:`~gpushare.node.nvml_events`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from gpushare.node.nvml_errors import (
    LOST_CODES,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    UNSUPPORTED_CODES,
    GpuLostError,
    MissingFunctionError,
    NvmlError,
    error_code,
)
from gpushare.node.nvml_worker import Worker

# The backend's logger: operators filter NVML's lines by it, whichever file writes them.
log = structlog.get_logger("gpushare.node.nvml")

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


@dataclass
class NvmlGpu:
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


class NvmlCalls:
    """NVML's functions called under one error policy; ``nv`` is pynvml (or a fake of it).

    Args:
        nv: the pynvml module or an object with the same functions; ``None`` until the backend
            loads it (importing pynvml is deferred to the first init).
    """

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self._chosen: dict[str, str] = {}
        self._chosen_lock = threading.Lock()
        self._logged_once: set[tuple[str, int]] = set()

    def call(self, gpu: NvmlGpu | None, fname: str, *args: Any, probe: bool = False) -> Any:
        """Run one NVML function under the error policy (:mod:`gpushare.node.nvml`'s docstring).

        Returns ``None`` for NotSupported/FunctionNotFound. With ``probe=True`` a missing function
        raises :class:`MissingFunctionError` instead, so versioned lookups try the next variant.

        Raises:
            GpuLostError: GpuIsLost or Unknown.
            NvmlError: any other NVML error.
        """
        nv = self.nv
        fn = getattr(nv, fname, None)  # the function by its NVML name: pynvml's own API
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

    def call_versioned(self, gpu: NvmlGpu | None, key: str, *args: Any) -> Any:
        """Call the newest variant of ``key`` this driver has; remember it after the first try."""
        with self._chosen_lock:
            chosen = self._chosen.get(key)
        if chosen is not None:
            return self.call(gpu, chosen, *args)
        variants = VERSIONED[key]
        for fname in variants:
            try:
                result = self.call(gpu, fname, *args, probe=True)
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

    def read(self, gpu: NvmlGpu, fname: str, *args: Any) -> Any:
        """:meth:`call` inside a tick: an NVML error empties this reading and is named in the sample."""
        try:
            return self.call(gpu, fname, *args)
        except NvmlError as exc:
            gpu.errors.append(str(exc))
            return None

    def read_versioned(self, gpu: NvmlGpu, key: str, *args: Any) -> Any:
        """:meth:`call_versioned` inside a tick, as :meth:`read`."""
        try:
            return self.call_versioned(gpu, key, *args)
        except NvmlError as exc:
            gpu.errors.append(str(exc))
            return None

    def call_strict(self, gpu: NvmlGpu, fname: str, value: int) -> None:
        """A setter call where NotSupported is an error, not a missing reading."""
        nv = self.nv
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

    def _log_once(self, fname: str, code: int, message: str) -> None:
        key = (fname, code)
        if key in self._logged_once or len(self._logged_once) >= _LOGGED_ONCE_MAX:
            return
        self._logged_once.add(key)
        log.info("nvml_not_supported", function=fname, code=code, message=message)
