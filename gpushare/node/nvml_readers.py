"""Per-GPU readings that take more than one NVML call: processes, per-process SM periods, GPM.

Each runs on the GPU's worker thread inside :meth:`gpushare.node.nvml.NvmlBackend.sample`, through
:class:`~gpushare.node.nvml_calls.NvmlCalls` (so under its error policy), and keeps what it must
remember between ticks in the GPU's :class:`~gpushare.node.nvml_calls.NvmlGpu`.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gpushare.model import ProcessMemory, SmPeriod
from gpushare.node.nvml_calls import NvmlCalls, NvmlGpu
from gpushare.node.nvml_errors import NO_SAMPLES_CODES, NvmlError

# The backend's logger: operators filter NVML's lines by it, whichever file writes them.
log = structlog.get_logger("gpushare.node.nvml")

NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRICS_GET_VERSION = 1

GPM_MIN_INTERVAL_S = 0.1

PROCESS_UTIL_LOOKBACK_S = 1.0


def processes(calls: NvmlCalls, gpu: NvmlGpu) -> tuple[ProcessMemory, ...]:
    """Every process on the GPU with its memory, by pid (NVML's two lists merged)."""
    # Compute list: the MPS server and non-MPS processes; MPS list: the MPS clients.
    found: dict[int, ProcessMemory] = {}
    for key in ("compute_processes", "mps_processes"):
        procs = calls.read_versioned(gpu, key, gpu.handle) or ()
        for p in procs:
            pid = int(p.pid)
            used = p.usedGpuMemory
            mem = ProcessMemory(pid=pid, used_bytes=int(used) if used is not None else None)
            if pid not in found or found[pid].used_bytes is None:
                found[pid] = mem
    return tuple(found[pid] for pid in sorted(found))


def sm_periods(
    calls: NvmlCalls, gpu: NvmlGpu, wall_clock: Callable[[], float]
) -> tuple[SmPeriod, ...] | None:
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
        since = int((wall_clock() - PROCESS_UTIL_LOOKBACK_S) * 1e6)
    try:
        records = calls.call(gpu, "nvmlDeviceGetProcessUtilization", gpu.handle, since)
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


def gpm_sm_active(calls: NvmlCalls, gpu: NvmlGpu, clock: Callable[[], float]) -> float | None:
    """Device SM activity from GPM (Hopper+); ``None`` where GPM does not exist."""
    nv = calls.nv
    if gpu.gpm_supported is None:
        support = calls.read(gpu, "nvmlGpmQueryDeviceSupport", gpu.handle)
        gpu.gpm_supported = bool(support is not None and support.isSupportedDevice)
        if not gpu.gpm_supported:
            log.info("nvml_gpm_unsupported", gpu=gpu.uuid)
    if not gpu.gpm_supported:
        return None
    now = clock()
    if gpu.gpm_prev is not None and now - gpu.gpm_prev[1] < GPM_MIN_INTERVAL_S:
        return gpu.sm_active_pct
    new = calls.read(gpu, "nvmlGpmSampleAlloc")
    if new is None:
        return None
    if calls.read(gpu, "nvmlGpmSampleGet", gpu.handle, new) is None:
        calls.read(gpu, "nvmlGpmSampleFree", new)
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
        got = calls.read(gpu, "nvmlGpmMetricsGet", req)
        metric = got.metrics[0] if got is not None else None
        if metric is not None and int(metric.nvmlReturn) == 0:
            gpu.sm_active_pct = float(metric.value)
        else:
            gpu.sm_active_pct = None
    finally:
        calls.read(gpu, "nvmlGpmSampleFree", prev[0])
    return gpu.sm_active_pct
