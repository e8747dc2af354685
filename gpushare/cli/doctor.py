"""``gpushare doctor``: tell an operator what their host lacks, with the fix for each line.

Each check reads raw facts from a :class:`Host` (the real one delegates to the ``node`` modules that
own each resource; tests pass a fake) and turns them into an OK/WARN/FAIL line with a hint. The
command exits 0 only when nothing a production host needs is missing (no FAIL).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

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
    """A raw fact a :class:`Host` reports: whether something works, and what was seen.

    ``checked`` is false when the host could not show the fact at all (no driver to read): the
    line then says what was not checked, as a WARN, instead of failing on what was not seen.
    """

    ok: bool
    detail: str
    hint: str = ""
    checked: bool = True
    #: Not ok because another user could change the file (gpushare.trust): a FAIL, never a WARN.
    untrusted: bool = False


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
        """The driver's version and the CUDA version it supports (what the latency probe needs)."""
        ...

    def cuda_bindings(self) -> Probe:
        """The cuda-bindings installed, and whether the driver runs their CUDA major."""
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

    def package(self) -> Probe:
        """Whether gpushare's own files (what the daemon and Slurm's Prolog run) are root's only."""
        ...

    def untrusted(self, path: Path, what: str) -> str | None:
        """Why the daemon would not trust the file ``path`` (gpushare.trust); None: it would."""
        ...

    def directory(self, path: Path) -> DirFacts:
        """Facts about a runtime or state directory."""
        ...

    def systemd(self) -> bool:
        """Whether the host was booted with systemd."""
        ...


def run_checks(
    host: Host,
    cfg: config.Config,
    config_problem: CheckResult | None,
    config_path: Path | None = None,
) -> list[CheckResult]:
    """Run every check against ``host`` for the effective config, in table order.

    ``config_problem`` is :func:`load_config_for_doctor`'s line for ``config_path``; an OK line
    becomes a FAIL when the daemon would refuse the file as not trusted.
    """
    results = [_python(host)]
    if config_problem is not None:
        why = None
        if config_problem.status is Status.OK and config_path is not None:
            why = host.untrusted(config_path, config.CONFIG_ROLE)
        results.append(
            config_problem
            if why is None
            else CheckResult(
                "config", Status.FAIL, why, "the daemon refuses to start or reload with it"
            )
        )
    nvml = host.nvml()
    results.append(
        CheckResult(
            "NVML",
            Status.OK if nvml.ok else Status.FAIL,
            nvml.detail,
            nvml.hint or ("" if nvml.ok else "install the NVIDIA driver; NVML ships with it"),
        )
    )
    results.extend(_cuda(host, cfg))
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
    package = host.package()
    results.append(
        CheckResult(
            "gpushare package",
            Status.OK if package.ok else Status.FAIL,
            package.detail,
            ""
            if package.ok
            else package.hint or "install gpushare as root, where only root writes",
        )
    )
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


def _cuda(host: Host, cfg: config.Config) -> list[CheckResult]:
    """The latency probe's needs: the driver, bindings it can run, NVRTC; FAIL only if enabled."""
    lines = (
        (
            "CUDA driver",
            host.cuda_driver(),
            "the latency probe needs libcuda from the NVIDIA driver",
        ),
        ("CUDA bindings", host.cuda_bindings(), "the latency probe needs cuda-bindings"),
        ("NVRTC", host.nvrtc(), "the latency probe compiles its kernel with NVRTC"),
    )
    out = []
    for name, fact, default_hint in lines:
        if fact.ok:
            out.append(CheckResult(name, Status.OK, fact.detail))
            continue
        bad = Status.FAIL if cfg.probe.enabled and fact.checked else Status.WARN
        out.append(CheckResult(name, bad, fact.detail, fact.hint or default_hint))
    return out


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
        # What the queue mode cannot promise (docs/controller.md, "Shallow offline queues").
        limits = (
            "bounds kernel and graph launches only: async copies and memsets, host functions and "
            "NCCL collectives waiting on other processes still run ahead after a freeze"
        )
        return CheckResult("in-flight bound", Status.OK, f"{lib.detail}; {limits}")
    if lib.untrusted:
        # The daemon refuses it at each launch (blocking queues instead), but a file that other
        # users can change next to a root daemon is a hole to close, not a slower fallback.
        return CheckResult(
            "in-flight bound",
            Status.FAIL,
            lib.detail,
            lib.hint or "the daemon refuses to preload it; shallow queues block instead",
        )
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
        cfg = config.load(path)
    except config.ConfigError as exc:
        return config.Config(), CheckResult(
            "config",
            Status.FAIL,
            str(exc),
            f"fix the file; `gpushare config check {path}` re-checks it",
        )
    return cfg, CheckResult("config", Status.OK, str(path))


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


def daemon_threads_check(daemon: Mapping[str, Any] | None) -> CheckResult | None:
    """The running daemon's receiver and poller threads (``status``'s ``daemon.threads``).

    FAIL when one is not alive (request gating or app latency is off on the node), WARN when one
    has been restarted (a bug some input reaches: the daemon's log has the traceback). ``None``
    when no daemon answered, or it is too old to say.
    """
    if daemon is None or not isinstance(daemon.get("threads"), list):
        return None
    threads = [t for t in daemon["threads"] if isinstance(t, dict)]
    dead = [str(t.get("name")) for t in threads if not t.get("alive")]
    restarts = int(daemon.get("thread_restarts") or 0)
    if dead:
        return CheckResult(
            "daemon threads",
            Status.FAIL,
            f"not running: {', '.join(dead)}",
            "restart gpushare (systemctl restart gpushare) and report the traceback in its log",
        )
    if restarts:
        failed = sorted({str(t.get("last_error")) for t in threads if t.get("restarts")})
        return CheckResult(
            "daemon threads",
            Status.WARN,
            f"{len(threads)} running; {restarts} restart(s) after a failure"
            + (f" ({', '.join(failed)})" if failed else ""),
            "the daemon's log has each traceback (journalctl -u gpushare -g thread_died)",
        )
    return CheckResult("daemon threads", Status.OK, f"{len(threads)} running, none restarted")
