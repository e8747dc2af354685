"""``gpushare doctor``, over the real :class:`~gpushare.cli.doctor.Host`.

Each fact comes from the node module that owns the resource (NVML from ``node/nvml_diag.py``, the
MPS binary from ``node/mps/``, ...); the checks themselves live in :mod:`gpushare.cli.doctor`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpushare import paths
from gpushare.cli.doctor import DirFacts, Probe, directory_facts, python_version

if TYPE_CHECKING:
    from gpushare import config
    from gpushare.node import probe_host

DOCTOR_SCHEMA_VERSION = 1
"""``doctor --json``: ``{"schema_version": 1, "ok": bool, "checks": [...]}`` (docs/status-schema.md)."""


def _probe(check: probe_host.HostCheck) -> Probe:  # each adapter is imported where it is used
    return Probe(check.ok, check.detail, check.hint, check.checked)


class RealHost:
    """Reads this host: NVML, the CUDA driver, the MPS binary, cgroups, directories, systemd."""

    def __init__(self, cfg: config.Config) -> None:
        self._cfg = cfg
        self._driver_facts: probe_host.DriverFacts | None = None

    def python_version(self) -> tuple[int, int, int]:
        """The running interpreter's version."""
        return python_version()

    def nvml(self) -> Probe:
        """NVML init, driver version and GPU count."""
        # Each adapter is imported where it is used: `gpushare doctor -h` needs none of them.
        from gpushare.node import nvml_diag

        return Probe(*nvml_diag.host_status())

    def cuda_driver(self) -> Probe:
        """The driver's version and CUDA version, read from libcuda without the bindings."""
        from gpushare.node import probe_host

        return _probe(probe_host.driver_check(self._driver()))

    def cuda_bindings(self) -> Probe:
        """The cuda-bindings installed, against the CUDA version the driver supports."""
        from gpushare.node import probe_host

        return _probe(probe_host.bindings_check(self._driver()))

    def nvrtc(self) -> Probe:
        """NVRTC compiling the probe kernel."""
        from gpushare.node import probe_host

        return _probe(probe_host.nvrtc_check())

    def _driver(self) -> probe_host.DriverFacts:
        from gpushare.node import probe_host

        if self._driver_facts is None:
            self._driver_facts = probe_host.driver_facts()
        return self._driver_facts

    def mps_binary(self, name: str) -> Probe:
        """Whether the MPS control binary is found and runs."""
        from gpushare.node import mps

        return Probe(*mps.binary_status(name))

    def mps_multiuser(self, name: str) -> bool | None:
        """Whether the binary supports ``-multiuser-server``."""
        from gpushare.node import mps

        path = shutil.which(name)
        return mps.supports_multiuser(path) if path else None

    def inflight_bound(self) -> Probe:
        """Whether every user's job can preload the in-flight bound (built, readable, trusted)."""
        from gpushare import native

        lib = native.library_path(self._cfg.paths.inflight_library)
        why = native.unreadable_reason(lib)
        if why is not None:
            return Probe(False, why)
        untrusted = native.untrusted_reason(lib)
        return Probe(untrusted is None, untrusted or str(lib), untrusted=untrusted is not None)

    def package(self) -> Probe:
        """The package directory of gpushare and everything in it (gpushare.trust)."""
        from gpushare import native, trust

        where = Path(native.__file__).resolve().parent.parent
        why = trust.tree_refusal(where, what="the gpushare package")
        return Probe(why is None, why or f"{where} (root's, not writable by others)")

    def cgroup_freezer(self) -> Probe:
        """Whether the freezer works under the configured client cgroup base."""
        from gpushare.node.cgroups.choice import freezer_check

        ok, detail = freezer_check(self._cfg.paths.cgroup_base)
        return Probe(ok, detail)

    def directory(self, path: Path) -> DirFacts:
        """Facts about a runtime or state directory."""
        return directory_facts(path)

    def untrusted(self, path: Path, what: str) -> str | None:
        """:func:`gpushare.trust.refusal`: the rule the daemon applies to the file."""
        from gpushare import trust

        return trust.refusal(path, what=what)

    def systemd(self) -> bool:
        """Booted with systemd: sd_booted(3) checks for this directory."""
        return Path("/run/systemd/system").is_dir()


def doctor(
    config_path: Annotated[
        Path | None, typer.Option("--config", help="Config file to check the host against.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Check that this host has what gpushare needs: driver, MPS, cgroups, directories, systemd.

    Exits 0 only when nothing a production host needs is missing.
    """
    import logging

    import structlog

    from gpushare.cli.doctor import (
        Status,
        daemon_threads_check,
        load_config_for_doctor,
        render,
        run_checks,
    )

    # The adapters log their failures; the table already says them, with the fix.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    path = config_path or paths.default_config_file()
    cfg, config_line = load_config_for_doctor(path)
    results = run_checks(RealHost(cfg), cfg, config_line, path)
    threads = daemon_threads_check(_daemon_status(cfg))
    if threads is not None:
        results.append(threads)
    failed = any(r.status is Status.FAIL for r in results)
    if as_json:
        checks = [{**asdict(r), "status": r.status.value} for r in results]
        doc = {"schema_version": DOCTOR_SCHEMA_VERSION, "ok": not failed, "checks": checks}
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(render(results))
    raise typer.Exit(code=1 if failed else 0)


def _daemon_status(cfg: config.Config) -> dict[str, Any] | None:
    """The running daemon's ``status.daemon``; ``None`` when none answers within a second."""
    from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

    try:
        with ApiClient.connect(cfg.paths.resolved("socket"), timeout_s=1.0, name="doctor") as api:
            found = api.call("status", {}).get("daemon")
    except (OSError, DaemonUnreachableError, ApiError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def register(app: typer.Typer) -> None:
    """Add the command to the root application."""
    app.command("doctor")(doctor)
