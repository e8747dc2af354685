"""``gpushare env``: the environment to start a workload with so that MPS applies its limits.

For workloads gpushare does not launch itself (a systemd service, a container, a Slurm task): MPS
fixes a client's limits when it connects, so they must be in its environment from the start. The
values are the daemon's (:mod:`gpushare.mpsenv`), with defaults from the config file.

The GPU: a UUID is used as given; an index (or no ``--gpu`` on a one-GPU host) is looked up in the
running daemon's status, else through NVML.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import structlog
import typer

from gpushare import config, mpsenv, paths, protocol
from gpushare.model import ClientClass
from gpushare.units import parse_duration, parse_size

UNSET = ["CUDA_VISIBLE_DEVICES"]
"""What a workload must not inherit: the MPS server already maps its GPU to device 0."""

Gpu = tuple[int | None, str]
"""(index when known, UUID)."""


class GpuLookupError(Exception):
    """The GPU cannot be named; ``exit_code`` 2 for a bad ``--gpu``, 1 when the host cannot tell."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"gpushare env: {message}", err=True)
    return typer.Exit(code=code)


def load_config(path: Path | None) -> config.Config:
    """The config named, else the default file, else the built-in defaults when there is none.

    Raises:
        config.ConfigError: the file is unreadable or invalid (or named but missing).
    """
    target = path or paths.default_config_file()
    if path is None and not target.exists():
        return config.Config()
    return config.load(target)


def offline_priority(cfg: config.Config) -> int:
    """The ``CUDA_MPS_CLIENT_PRIORITY`` the configured policy gives offline clients."""
    from gpushare.control.registry import make_policy

    policy = make_policy(cfg.control.policy, cfg.control)
    return int(getattr(policy, "offline_mps_priority", ClientClass.OFFLINE.mps_priority))


def _daemon_gpus(socket: str | Path) -> list[Gpu] | str:
    from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

    try:
        with ApiClient.connect(socket, timeout_s=5.0, name="env") as api:
            status = api.call(protocol.STATUS)
    except (DaemonUnreachableError, ApiError, OSError) as exc:
        return f"the daemon at {socket} did not answer ({exc})"
    return [(int(g["index"]), str(g["uuid"])) for g in status.get("gpus", [])]


def _nvml_gpus() -> list[Gpu] | str:
    from gpushare.node import nvml

    backend = nvml.NvmlBackend(events=False, init_timeout_s=10.0, call_timeout_s=5.0)
    try:
        return list(enumerate(backend.gpu_uuids()))
    except nvml.NvmlError as exc:
        return f"NVML cannot list the GPUs ({str(exc).partition('HINT:')[0].strip()})"
    finally:
        backend.close()


def resolve_gpu(key: str | None, sources: Sequence[Callable[[], list[Gpu] | str]]) -> Gpu:
    """The GPU ``key`` names (an index or a UUID), or the only GPU when ``key`` is ``None``.

    Args:
        key: ``--gpu`` as given.
        sources: callables returning ``[(index, uuid), ...]`` or a reason they cannot; tried in
            order until one answers.

    Raises:
        GpuLookupError: no such GPU, several GPUs and no ``--gpu``, or nothing could list them.
    """
    if key is not None and (key.startswith(("GPU-", "MIG-"))):
        if not config.GPU_KEY_RE.match(key):
            raise GpuLookupError(f"--gpu {key!r} is not a GPU UUID (GPU-xxxxxxxx-...)", 2)
        return None, key
    if key is not None and not key.isdigit():
        raise GpuLookupError(f"--gpu takes an index (0, 1, ...) or a UUID, got {key!r}", 2)
    reasons: list[str] = []
    for source in sources:
        found = source()
        if isinstance(found, str):
            reasons.append(found)
            continue
        if key is None:
            if len(found) == 1:
                return found[0]
            listed = ", ".join(f"{i} ({u})" for i, u in found) or "none"
            raise GpuLookupError(f"{len(found)} GPUs here, give --gpu: {listed}", 2)
        match = [g for g in found if g[0] == int(key)]
        if not match:
            known = ", ".join(str(i) for i, _u in found) or "none"
            raise GpuLookupError(f"no GPU with index {key} (GPUs here: {known})", 2)
        return match[0]
    raise GpuLookupError(
        "cannot tell which GPU is meant: " + "; ".join(reasons)
        + ". Give --gpu with the GPU's UUID (nvidia-smi -L)",
        1,
    )  # fmt: skip


def workload_env(
    cfg: config.Config,
    cls: ClientClass,
    gpu_uuid: str,
    *,
    sm_pct: float | None,
    mem_bytes: int | None,
    slo_p99_s: float | None,
) -> dict[str, str]:
    """The variables (MPS limits and markers) for one workload class on one GPU."""
    sm = sm_pct if sm_pct is not None else mpsenv.default_sm_pct(
        cls, cfg.control.offline_sm_pct_default
    )  # fmt: skip
    limits = mpsenv.MpsLimits(
        gpu_uuid=gpu_uuid,
        sm_pct=sm,
        mem_bytes=mem_bytes,
        priority=mpsenv.priority(cls, offline_priority(cfg)),
    )
    env = mpsenv.mps_env(
        limits=limits,
        pipe_dir=mpsenv.pipe_dir(cfg.paths.resolved("mps_pipe_dir"), gpu_uuid),
        latency_socket=cfg.paths.resolved("latency_socket"),
    )
    return {**mpsenv.marker_env(cls, slo_p99_s), **env}


def env(
    online: Annotated[bool, typer.Option("--online", help="Latency-critical service.")] = False,
    offline: Annotated[bool, typer.Option("--offline", help="Best-effort job.")] = False,
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="GPU index or UUID (default: the only GPU of the host)."),
    ] = None,
    sm: Annotated[
        float | None,
        typer.Option(
            "--sm",
            help="SM percentage (default: online 100, offline control.offline_sm_pct_default).",
        ),
    ] = None,
    mem: Annotated[
        str | None, typer.Option("--mem", help="Pinned GPU memory limit, e.g. 8G.")
    ] = None,
    slo_p99: Annotated[
        str | None, typer.Option("--slo-p99", help="Online p99 latency SLO, e.g. 40ms.")
    ] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="shell (export lines), systemd (a drop-in), docker (an --env-file), "
            "slurm (TaskProlog output).",
        ),
    ] = "shell",
    as_json: Annotated[bool, typer.Option("--json", help="Print the variables as JSON.")] = False,
    config_path: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Config file (default: $GPUSHARE_CONFIG or /etc/gpushare/gpushare.toml).",
        ),
    ] = None,
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="API socket, to look up a GPU index (default: the config's)."
        ),
    ] = None,
) -> None:
    """Print the environment to start a workload with so that MPS applies gpushare's limits.

    Shell: eval "$(gpushare env --offline --sm 30 --mem 8G)"; a systemd service: --format systemd
    into /etc/systemd/system/UNIT.service.d/gpushare.conf; a container: --format docker into an
    --env-file; a Slurm TaskProlog: --format slurm.
    """
    # stdout is the product (eval "$(gpushare env ...)"); each failure is this command's message.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    if online == offline:
        raise _fail("give exactly one of --online or --offline")
    if fmt not in mpsenv.FORMATS:
        raise _fail(f"--format must be one of {', '.join(mpsenv.FORMATS)}, got {fmt!r}")
    cls = ClientClass.ONLINE if online else ClientClass.OFFLINE
    try:
        mem_bytes = parse_size(mem) if mem is not None else None
    except ValueError as exc:
        raise _fail(f"--mem: {exc}") from None
    try:
        slo_s = parse_duration(slo_p99) if slo_p99 is not None else None
    except ValueError as exc:
        raise _fail(f"--slo-p99: {exc}") from None
    try:
        mpsenv.check_limits(cls, sm, mem_bytes, slo_s)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    try:
        cfg = load_config(config_path)
    except config.ConfigError as exc:
        raise _fail(f"{exc}; fix the file or pass --config") from None
    sock = socket or os.environ.get(paths.ENV_SOCKET) or cfg.paths.resolved("socket")
    try:
        index, uuid = resolve_gpu(gpu, [lambda: _daemon_gpus(sock), _nvml_gpus])
    except GpuLookupError as exc:
        raise _fail(str(exc), exc.exit_code) from None
    if not cfg.gpu_override(index if index is not None else -1, uuid).shared:
        raise _fail(f'GPU {gpu or uuid} is not shared by gpushare (gpus."…".shared = false)')
    variables = workload_env(cfg, cls, uuid, sm_pct=sm, mem_bytes=mem_bytes, slo_p99_s=slo_s)
    if as_json:
        out = {"gpu": {"index": index, "uuid": uuid}, "env": variables, "unset": UNSET}
        typer.echo(json.dumps(out, indent=2))
        return
    try:
        typer.echo(mpsenv.render(variables, typing.cast(mpsenv.Format, fmt), UNSET), nl=False)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    """Add the command to the root application."""
    app.command("env")(env)
