"""What NVML's answers mean to gpushare: return codes, their classes, our errors and the init hints.

:class:`gpushare.node.nvml.NvmlBackend` applies this to every call (its ``_call``); nothing here
imports pynvml, so the codes and messages can be read and tested without the library.

The policy they serve (which code empties a reading, marks a GPU lost or fails a call) is
described in :mod:`gpushare.node.nvml`.
"""

from __future__ import annotations

# NVML return codes the policy depends on (nvml.md §3).
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999

UNSUPPORTED_CODES = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})
LOST_CODES = frozenset({NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN})
# "No samples since lastSeenTimeStamp": NOT_FOUND, or pynvml's bare NVMLError(0) when the size
# query itself succeeds (nvmlDeviceGetProcessUtilization's documented return codes; pynvml).
NO_SAMPLES_CODES = frozenset({NVML_ERROR_NOT_FOUND, 0})

# XIDs after which the GPU needs a reset or the node operator (NVIDIA's XID catalogue, "Xid Errors"
# in the driver documentation): double-bit ECC (48), internal micro-controller halt (62), row
# remapping failure (64), NVLink error (74), GPU fallen off the bus (79), uncontained ECC (95),
# GSP/RPC timeouts (119, 120). Application faults (13, 31, 43, 45) do not take the GPU down.
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120})

INIT_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "HINT: libnvidia-ml.so.1 was not found. NVML ships with the NVIDIA "
    "display driver: install the driver (nvidia-smi must work) on this host.",
    NVML_ERROR_DRIVER_NOT_LOADED: "HINT: the NVIDIA kernel module is not loaded: `modprobe nvidia` "
    "or check `dmesg | grep -i nvrm`.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "HINT: the driver was upgraded without reloading the "
    "kernel module: reboot, or unload and reload the nvidia modules.",
    NVML_ERROR_NO_PERMISSION: "HINT: no permission to open /dev/nvidia*: run gpushare as root "
    "(the systemd unit does).",
}


class NvmlError(Exception):
    """An NVML call failed in a way the error policy does not absorb.

    Attributes:
        function: the NVML function that failed.
        code: the NVML return code, or ``None`` for failures of our own (timeout, unknown GPU).
    """

    def __init__(self, function: str, code: int | None, message: str) -> None:
        self.function = function
        self.code = code
        super().__init__(f"{function}: {message}")


class NvmlInitError(NvmlError):
    """NVML could not be initialised; the message ends with a HINT line naming the fix."""


class GpuLostError(Exception):
    """Internal to the backend: the GPU answered GpuIsLost/Unknown; ends this GPU's snapshot."""


class MissingFunctionError(Exception):
    """Internal to the backend: a versioned variant does not exist in this driver/pynvml (try the next)."""


def error_code(exc: BaseException) -> int | None:
    """The NVML return code a pynvml error carries (its ``value``), or ``None``."""
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else None
