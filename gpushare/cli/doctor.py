"""``gpushare doctor``: tell an operator what their host lacks, with the fix for each line.

Each check reads raw facts from a :class:`Host` (the real one delegates to the ``node`` modules that
own each resource; tests pass a fake) and turns them into an OK/WARN/FAIL line with a hint. The
command exits 0 only when nothing a production host needs is missing (no FAIL).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from gpushare import config


class Status(str, Enum):
    """Outcome of one check."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One line of the doctor's table."""

    name: str
    status: Status
    detail: str
    hint: str = ""


@dataclass(frozen=True, slots=True)
class Probe:
    """A raw fact a :class:`Host` reports: whether something works, and what was seen."""

    ok: bool
    detail: str
    hint: str = ""


@dataclass(frozen=True, slots=True)
class DirFacts:
    """Whether a directory exists and is writable, or can be created."""

    exists: bool
    writable: bool
    creatable: bool


class Host(Protocol):
    """The facts the doctor needs, one method per outside resource."""

    def python_version(self) -> tuple[int, int, int]:
        """The running interpreter's version."""
        ...

    def nvml(self) -> Probe:
        """NVML import and init, with the driver version and GPU count when it works."""
        ...

    def cuda_driver(self) -> Probe:
        """The CUDA driver through cuda-python (what the latency probe needs)."""
        ...

    def nvrtc(self) -> Probe:
        """NVRTC compiling the probe kernel (the latency probe needs it at start)."""
        ...

    def mps_binary(self, name: str) -> Probe:
        """Whether the MPS control binary is found and runs."""
        ...

    def mps_multiuser(self, name: str) -> bool | None:
        """Whether the binary supports ``-multiuser-server`` (None: unknown)."""
        ...

    def inflight_bound(self) -> Probe:
        """Whether gpushare's in-flight bound library (``gpushare.native``) is built."""
        ...

    def cgroup_freezer(self) -> Probe:
        """Whether a cgroup v2 hierarchy with a writable freezer exists."""
        ...

    def directory(self, path: Path) -> DirFacts:
        """Facts about a runtime or state directory."""
        ...

    def systemd(self) -> bool:
        """Whether the host was booted with systemd."""
        ...


def run_checks(
    host: Host, cfg: config.Config, config_problem: CheckResult | None
) -> list[CheckResult]:
    """Run every check against ``host`` for the effective config, in table order."""
    results = [_python(host)]
    if config_problem is not None:
        results.append(config_problem)
    nvml = host.nvml()
    results.append(
        CheckResult(
            "NVML",
            Status.OK if nvml.ok else Status.FAIL,
            nvml.detail,
            nvml.hint or ("" if nvml.ok else "install the NVIDIA driver; NVML ships with it"),
        )
    )
    cuda = host.cuda_driver()
    cuda_status = Status.OK if cuda.ok else (Status.FAIL if cfg.probe.enabled else Status.WARN)
    results.append(
        CheckResult(
            "CUDA driver",
            cuda_status,
            cuda.detail,
            ""
            if cuda.ok
            else cuda.hint or "the latency probe needs libcuda from the NVIDIA driver",
        )
    )
    nvrtc = host.nvrtc()
    results.append(
        CheckResult(
            "NVRTC",
            Status.OK if nvrtc.ok else (Status.FAIL if cfg.probe.enabled else Status.WARN),
            nvrtc.detail,
            "" if nvrtc.ok else nvrtc.hint or "the latency probe compiles its kernel with NVRTC",
        )
    )
    results.extend(_mps(host, cfg))
    freezer = host.cgroup_freezer()
    results.append(
        CheckResult(
            "cgroup v2 freezer",
            Status.OK if freezer.ok else Status.WARN,
            freezer.detail,
            ""
            if freezer.ok
            else freezer.hint
            or "offline clients will be paused with SIGSTOP/SIGCONT instead; run under systemd "
            "with Delegate=yes on a cgroup v2 host for the freezer",
        )
    )
    results.append(_inflight(host, cfg))
    results.append(_directory(host, "runtime directory", cfg.paths.runtime_dir))
    results.append(_directory(host, "state directory", cfg.paths.state_dir))
    has_systemd = host.systemd()
    results.append(
        CheckResult(
            "systemd",
            Status.OK if has_systemd else Status.WARN,
            "booted with systemd" if has_systemd else "not booted with systemd",
            ""
            if has_systemd
            else "run `gpushare daemon` under another supervisor; readiness and watchdog are off",
        )
    )
    return results


def _python(host: Host) -> CheckResult:
    version = host.python_version()
    text = ".".join(map(str, version))
    if version >= (3, 10, 0):
        return CheckResult("Python", Status.OK, text)
    return CheckResult("Python", Status.FAIL, text, "gpushare needs Python 3.10 or newer")


def _mps(host: Host, cfg: config.Config) -> list[CheckResult]:
    binary = host.mps_binary(cfg.mps.control_binary)
    out = [
        CheckResult(
            "MPS control binary",
            Status.OK if binary.ok else Status.FAIL,
            binary.detail,
            ""
            if binary.ok
            else binary.hint
            or "install nvidia-cuda-mps (it ships with the NVIDIA driver) or set mps.control_binary",
        )
    ]
    if not binary.ok:
        return out
    multiuser = host.mps_multiuser(cfg.mps.control_binary)
    if multiuser:
        detail = "supported: users share each GPU (a fatal fault then reaches every user's clients)"
        status = Status.OK
        hint = ""
    elif cfg.mps.multiuser == "on":
        detail, status = (
            'required by mps.multiuser = "on" but not supported by this binary',
            Status.FAIL,
        )
        hint = (
            'set mps.multiuser = "auto" or install a driver whose MPS has -multiuser-server (R555+)'
        )
    else:
        detail = "not supported: MPS serialises users per GPU; jobs of a second user wait"
        status, hint = Status.WARN, "a driver of R555 or newer adds -multiuser-server"
    out.append(CheckResult("MPS multi-user", status, detail, hint))
    return out


def _inflight(host: Host, cfg: config.Config) -> CheckResult:
    if cfg.gate.shallow_queue != "bounded":
        return CheckResult(
            "in-flight bound", Status.OK, "not used ([gate] shallow_queue = blocking)"
        )
    lib = host.inflight_bound()
    if lib.ok:
        return CheckResult("in-flight bound", Status.OK, lib.detail)
    return CheckResult(
        "in-flight bound",
        Status.WARN,
        lib.detail,
        lib.hint
        or "shallow offline queues fall back to CUDA_LAUNCH_BLOCKING=1 (less offline throughput); "
        "build it with `sudo gpushare install` (needs a C compiler: apt-get install gcc)",
    )


def _directory(host: Host, name: str, path: Path) -> CheckResult:
    facts = host.directory(path)
    if facts.exists and facts.writable:
        return CheckResult(name, Status.OK, f"{path} (writable)")
    if not facts.exists and facts.creatable:
        return CheckResult(name, Status.OK, f"{path} (will be created)")
    return CheckResult(
        name,
        Status.FAIL,
        f"{path} ({'not writable' if facts.exists else 'cannot be created'})",
        "run the daemon as root (systemd creates it from RuntimeDirectory=/StateDirectory=) "
        "or point paths.* at a writable directory",
    )


def load_config_for_doctor(path: Path) -> tuple[config.Config, CheckResult]:
    """The config to check the host against, and a line saying how loading it went."""
    if not path.exists():
        return config.Config(), CheckResult(
            "config",
            Status.WARN,
            f"{path} not found; using defaults",
            "run gpushare install (it writes the documented default there)",
        )
    try:
        return config.load(path), CheckResult("config", Status.OK, str(path))
    except config.ConfigError as exc:
        return config.Config(), CheckResult(
            "config",
            Status.FAIL,
            str(exc),
            f"fix the file; `gpushare config check {path}` re-checks it",
        )


def render(results: Sequence[CheckResult]) -> str:
    """A fixed-width table: check, status, detail, and the hint under failing lines."""
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status.value:<4}  {r.detail}")
        if r.hint and r.status is not Status.OK:
            lines.append(f"{'':<{width}}        hint: {r.hint}")
    return "\n".join(lines)


def directory_facts(path: Path) -> DirFacts:
    """Facts about ``path`` from the filesystem (shared by the real host)."""
    if path.is_dir():
        return DirFacts(True, os.access(path, os.W_OK | os.X_OK), False)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return DirFacts(False, False, os.access(parent, os.W_OK | os.X_OK))


def python_version() -> tuple[int, int, int]:
    """The running interpreter's version (shared by the real host)."""
    return sys.version_info[0], sys.version_info[1], sys.version_info[2]
