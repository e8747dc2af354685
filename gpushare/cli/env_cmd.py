"""``gpushare env``: the environment to start a workload with so that MPS applies its limits.

For workloads gpushare does not launch itself (a systemd service, a container, a Slurm task): MPS
fixes a client's limits when it connects, so they must be in its environment from the start. The
values are the daemon's (:mod:`gpushare.mpsenv`), with defaults from the config file.

The GPU: a UUID is used as given; an index (or no ``--gpu`` on a one-GPU host) is looked up in the
running daemon's status, else through NVML.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Annotated

import typer

from gpushare import config, mpsenv
from gpushare.cli.options import (
    MemOpt,
    OfflineOpt,
    OnlineOpt,
    SloP99Opt,
    SloTpotP99Opt,
    SloTtftP99Opt,
)
from gpushare.model import ClientClass
from gpushare.roots.envresolve import (
    UNSET,
    GpuLookupError,
    ask_daemon,
    daemon_paths,
    daemon_socket,
    gpu_sources,
    load_config,
    resolve_gpu,
    workload_env,
)
from gpushare.units import parse_duration, parse_size


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"gpushare env: {message}", err=True)
    return typer.Exit(code=code)


# env's options, one alias each (the signature stays readable).
_GpuOpt = Annotated[
    str | None,
    typer.Option("--gpu", help="GPU index or UUID (default: the only GPU of the host)."),
]
_SmOpt = Annotated[
    float | None,
    typer.Option(
        "--sm",
        help="SM percentage (default: online 100, offline control.offline_sm_pct_default).",
    ),
]
_FmtOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="shell (export lines), systemd (a drop-in), docker (an --env-file), "
        "slurm (TaskProlog output).",
    ),
]
_AsJsonOpt = Annotated[bool, typer.Option("--json", help="Print the variables as JSON.")]
_ConfigPathOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="Config file (default: $GPUSHARE_CONFIG or /etc/gpushare/gpushare.toml).",
    ),
]
_SocketOpt = Annotated[
    str | None,
    typer.Option("--socket", help="API socket, to look up a GPU index (default: the config's)."),
]


def env(
    online: OnlineOpt = False,
    offline: OfflineOpt = False,
    gpu: _GpuOpt = None,
    sm: _SmOpt = None,
    mem: MemOpt = None,
    slo_p99: SloP99Opt = None,
    slo_ttft_p99: SloTtftP99Opt = None,
    slo_tpot_p99: SloTpotP99Opt = None,
    fmt: _FmtOpt = "shell",
    as_json: _AsJsonOpt = False,
    config_path: _ConfigPathOpt = None,
    socket: _SocketOpt = None,
) -> None:
    """Print the environment to start a workload with so that MPS applies gpushare's limits.

    Shell: eval "$(gpushare env --offline --sm 30 --mem 8G)"; a systemd service: --format systemd
    into /etc/systemd/system/UNIT.service.d/gpushare.conf; a container: --format docker into an
    --env-file; a Slurm TaskProlog: --format slurm.
    """
    if online == offline:
        raise _fail("give exactly one of --online or --offline")
    if fmt not in mpsenv.FORMATS:
        raise _fail(f"--format must be one of {', '.join(mpsenv.FORMATS)}, got {fmt!r}")
    cls = ClientClass.ONLINE if online else ClientClass.OFFLINE
    mem_bytes, slo_s = _limits(cls, sm, mem, slo_p99)
    tokens = (
        _token_slo("--slo-ttft-p99", cls, slo_ttft_p99),
        _token_slo("--slo-tpot-p99", cls, slo_tpot_p99),
    )
    try:
        cfg = load_config(config_path)
    except config.ConfigError as exc:
        raise _fail(f"{exc}; fix the file or pass --config") from None
    # The daemon asked gives the paths (it may run with another config than this host's file);
    # when none answers, the config's are all there is.
    answer = ask_daemon(daemon_socket(cfg, socket))
    try:
        index, uuid = resolve_gpu(gpu, gpu_sources(cfg, socket, answer))
    except GpuLookupError as exc:
        raise _fail(str(exc), exc.exit_code) from None
    if not cfg.for_gpu(index if index is not None else -1, uuid).shared:
        raise _fail(f'GPU {gpu or uuid} is not shared by gpushare (gpus."…".shared = false)')
    variables = workload_env(
        cfg, cls, uuid, sm_pct=sm, mem_bytes=mem_bytes, slo_p99_s=slo_s,
        daemon=daemon_paths(answer), token_slos_s=tokens,
    )  # fmt: skip
    if as_json:
        out = {"gpu": {"index": index, "uuid": uuid}, "env": variables, "unset": UNSET}
        typer.echo(json.dumps(out, indent=2))
        return
    try:
        typer.echo(mpsenv.render(variables, typing.cast(mpsenv.Format, fmt), UNSET), nl=False)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _token_slo(flag: str, cls: ClientClass, text: str | None) -> float | None:
    """An LLM server's token SLO in seconds; a bad one exits with one line."""
    if text is None:
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise _fail(f"{flag}: {exc}") from None
    if (problem := mpsenv.slo_problem(flag, cls, seconds)) is not None:
        raise _fail(problem)
    return seconds


def _limits(
    cls: ClientClass, sm: float | None, mem: str | None, slo_p99: str | None
) -> tuple[int | None, float | None]:
    """``--mem`` in bytes and ``--slo-p99`` in seconds, checked with ``--sm`` for the class."""
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
    return mem_bytes, slo_s


def register(app: typer.Typer) -> None:
    """Add the command to the root application."""
    app.command("env")(env)
