"""``gpushare doctor``'s CUDA lines: the driver, the bindings it can run, and NVRTC.

The latency probe (:mod:`gpushare.node.probe`) needs three things that come from three places: the
NVIDIA driver (``libcuda.so.1``), the ``cuda-bindings`` wheel of a CUDA major the driver supports,
and NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel, or the CUDA toolkit) to compile its kernel. A host
can have any of them without the others, so each is its own check:

- :func:`driver_check` reads libcuda directly through ctypes (``cuDriverGetVersion``, ``cuInit``,
  ``cuDeviceGetCount``) and the kernel module's version from ``/proc/driver/nvidia/version``: it
  needs no bindings, so it tells the truth even when the installed bindings are of the wrong major.
- :func:`bindings_check` compares the installed bindings' major with the CUDA version the driver
  supports (13.x needs driver 580 or newer, 12.x needs 525; :data:`MIN_DRIVER`) and names the
  ``pip install`` that fixes a mismatch.
- :func:`nvrtc_check` compiles the probe kernel for ``sm_75`` (no GPU needed).

A fact that cannot be read on this host (no driver, so nothing to compare the bindings with) is
reported as not checked (:attr:`HostCheck.checked` false), never as a failure of what was not
seen. Every message is one line: library loaders' multi-line errors are folded.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushare.node.probe import (
    Bindings,
    ProbeError,
    ProbeUnavailableError,
    compile_cubin,
    driver_missing_errors,
    load_bindings,
)

#: Per cuda-bindings major: the oldest Linux driver it runs on, and the packages that install it
#: with its NVRTC (pyproject.toml ships the CUDA 12 pair; README.md "CUDA and the driver").
MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
INSTALL = {
    12: "pip install 'cuda-bindings>=12.8,<13' 'nvidia-cuda-nvrtc-cu12>=12.8,<13'",
    13: "pip install 'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc>=13,<14'",
}
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
_MODULE_VERSION = re.compile(r"\s(\d{3,}\.\d+(?:\.\d+)?)\s")


@dataclass(frozen=True, slots=True)
class HostCheck:
    """One doctor line's raw fact: whether it is fine, what was seen, and the fix.

    ``checked`` is false when this host could not show the fact at all (no driver to compare the
    bindings with): the doctor then says what it could not check instead of failing.
    """

    ok: bool
    detail: str
    hint: str = ""
    checked: bool = True


@dataclass(frozen=True, slots=True)
class DriverFacts:
    """What libcuda says: the CUDA version it supports (``12020``: 12.2), devices, or why not."""

    cuda_version: int | None
    module_version: str | None
    devices: int | None = None
    error: str = ""
    #: False when libcuda.so.1 itself could not be loaded (no driver installed).
    library: bool = True


def one_line(exc: BaseException | str) -> str:
    """A message on one line: loaders' errors carry newlines that would break the doctor's table."""
    return " ".join(str(exc).split())


def cuda_text(version: int) -> str:
    """``12020`` as ``12.2``."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _load_libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _module_version(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    found = _MODULE_VERSION.search(text)
    return found.group(1) if found else None


def driver_facts(
    load: Callable[[], Any] = _load_libcuda, version_file: Path = DRIVER_VERSION_FILE
) -> DriverFacts:
    """Read the driver through libcuda itself, without any bindings (see the module doc)."""
    module = _module_version(version_file)
    try:
        lib = load()
    except OSError as exc:
        return DriverFacts(None, module, error=one_line(exc), library=False)
    version = ctypes.c_int(0)
    if (code := int(lib.cuDriverGetVersion(ctypes.byref(version)))) != 0:
        return DriverFacts(None, module, error=f"cuDriverGetVersion failed ({code})")
    if (code := int(lib.cuInit(0))) != 0:
        return DriverFacts(version.value, module, error=f"cuInit failed ({code})")
    count = ctypes.c_int(0)
    if (code := int(lib.cuDeviceGetCount(ctypes.byref(count)))) != 0:
        return DriverFacts(version.value, module, error=f"cuDeviceGetCount failed ({code})")
    return DriverFacts(version.value, module, count.value)


def _driver_name(facts: DriverFacts) -> str:
    return f"driver {facts.module_version}" if facts.module_version else "the driver"


def driver_check(facts: DriverFacts | None = None) -> HostCheck:
    """The CUDA driver line: driver version, the CUDA version it supports, devices."""
    facts = facts or driver_facts()
    if facts.cuda_version is None:
        if not facts.library:
            return HostCheck(
                False,
                f"not checked: no libcuda.so.1 ({facts.error}), so no driver or CUDA version",
                "install the NVIDIA driver (525 or newer); it ships libcuda.so.1",
                checked=False,
            )
        return HostCheck(False, facts.error, "check `nvidia-smi`")
    seen = f"{_driver_name(facts)} supports CUDA {cuda_text(facts.cuda_version)}"
    if facts.error:
        hint = "check `nvidia-smi`; a driver/library version mismatch needs a reboot"
        if "(100)" in facts.error:
            hint = "no GPU is visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        return HostCheck(False, f"{seen}; {facts.error}", hint)
    return HostCheck(True, f"{seen}, {facts.devices} device(s)")


def bindings_check(facts: DriverFacts | None = None) -> HostCheck:
    """The CUDA bindings line: which are installed, and whether this driver runs them."""
    try:
        b = load_bindings()
    except ProbeUnavailableError as exc:
        return HostCheck(False, one_line(exc), _install_hint(facts or driver_facts()))
    major = _major(b.version)
    name = f"cuda-bindings {b.version} ({b.name})"
    if major not in MIN_DRIVER:
        return HostCheck(
            False, f"{name}: CUDA major {major} is not supported", _install_hint(facts)
        )
    needs = f"needs driver >= {MIN_DRIVER[major]} (CUDA {major}.0)"
    facts = facts or driver_facts()
    if facts.cuda_version is None:
        return HostCheck(
            False,
            f"{name}, {needs}: not checked, no driver to check against",
            "once the driver is installed, `gpushare doctor` checks the two match",
            checked=False,
        )
    supported = facts.cuda_version // 1000
    if supported >= major:
        return HostCheck(True, f"{name}, {needs}: {_driver_name(facts)} runs it")
    return HostCheck(
        False,
        f"{name} {needs}, but {_driver_name(facts)} supports CUDA {cuda_text(facts.cuda_version)}",
        f"{_install_hint(facts)} into gpushare's environment, or upgrade the driver to "
        f"{MIN_DRIVER[major]} or newer",
    )


def mismatch(b: Bindings, facts: DriverFacts | None = None) -> str | None:
    """Why the driver cannot run these bindings, with the fix; ``None`` when it can or is unknown.

    The probe worker asks before its first CUDA call: bindings of a CUDA major newer than the
    driver's fail there with an error that names neither the driver nor the fix.
    """
    major = _major(b.version)
    if major not in MIN_DRIVER:
        return None
    facts = facts or driver_facts()
    if facts.cuda_version is None or facts.cuda_version // 1000 >= major:
        return None
    return (
        f"cuda-bindings {b.version} need driver >= {MIN_DRIVER[major]}, but "
        f"{_driver_name(facts)} supports CUDA {cuda_text(facts.cuda_version)}: "
        f"{_install_hint(facts)}"
    )


def _major(version: str) -> int | None:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _install_hint(facts: DriverFacts | None) -> str:
    """The pip command for the newest bindings major this driver runs (12 when unknown)."""
    supported = (facts.cuda_version or 0) // 1000 if facts else 0
    major = 13 if supported >= 13 else 12
    return INSTALL[major]


def nvrtc_check() -> HostCheck:
    """Whether NVRTC compiles the probe kernel (a real compile for ``sm_75``; no GPU needed).

    The driver does not ship NVRTC: the ``nvidia-cuda-nvrtc-cu12`` wheel (a dependency of
    gpushare) or the CUDA toolkit does, of the same major as the bindings. The bindings find the
    library through cuda-pathfinder, which looks in the environment's site-packages
    (``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``, where the wheel puts it) before the system's
    search path; no ``LD_LIBRARY_PATH`` is needed.
    """
    try:
        b = load_bindings()
    except ProbeUnavailableError as exc:
        return HostCheck(False, one_line(exc), INSTALL[12])
    wheel = "nvidia-cuda-nvrtc" if _major(b.version) == 13 else "nvidia-cuda-nvrtc-cu12"
    try:
        cubin = compile_cubin(b.nvrtc, 7, 5)
        version = _nvrtc_version(b.nvrtc)
    except driver_missing_errors() as exc:
        return HostCheck(
            False,
            f"libnvrtc not found ({one_line(exc)})",
            f"pip install {wheel} (the major of the cuda-bindings, {b.version}), "
            "or install the CUDA toolkit",
        )
    except ProbeError as exc:
        return HostCheck(
            False, one_line(exc), f"NVRTC must be of the bindings' major: pip install {wheel}"
        )
    return HostCheck(
        True, f"NVRTC {version} compiled the probe kernel ({len(cubin)}-byte CUBIN for sm_75)"
    )


def _nvrtc_version(nvrtc: Any) -> str:
    try:
        status, major, minor = nvrtc.nvrtcVersion()
    except (AttributeError, TypeError, ValueError):
        return "(version unknown)"
    return f"{major}.{minor}" if int(status) == 0 else "(version unknown)"
