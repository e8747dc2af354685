"""``gpushare drain`` and ``gpushare undrain``: a GPU admits nothing new while what runs finishes.

The daemon side is :mod:`gpushare.daemon.cordon` (not :mod:`gpushare.daemon.drain`, the control
loop's wait for a frozen client's queued kernels). Imports beyond Typer are made inside the
commands, so registering them costs the CLI's start-up nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu", help="GPU index or UUID (default: every shared GPU).", show_default=False
    ),
]
SocketOpt = Annotated[
    str | None,
    typer.Option(
        "--socket", help="API socket (default: $GPUSHARE_SOCKET, the config's, /run/gpushare)."
    ),
]


def _call(socket: str | None, method: str, params: dict[str, Any]) -> Any:
    # Imported here: registering the commands costs the CLI's start-up nothing.
    from gpushare.cli.clients_cmd import call_once

    return call_once(socket, method, params)


def _gpus(indices: list[Any]) -> str:
    return ", ".join(f"GPU {i}" for i in indices)


def drain(
    gpu: GpuOpt = None,
    reason: Annotated[
        str, typer.Option("--reason", help="Why, for `gpushare status` and the event log.")
    ] = "",
    socket: SocketOpt = None,
) -> None:
    """Admit nothing new on a GPU; running clients finish or checkpoint (root or the admin group).

    Submits to it are refused and queued jobs wait; the drain survives a daemon restart.
    `gpushare undrain` ends it.
    """
    from gpushare import protocol

    params: dict[str, Any] = {"reason": reason}
    if gpu is not None:
        params["gpu"] = gpu
    result = _call(socket, protocol.DRAIN, params)
    already = [i for i in result["drained"] if i not in result["newly"]]
    if result["newly"]:
        typer.echo(f"draining {_gpus(result['newly'])}: nothing new starts there")
    if already:
        typer.echo(f"already draining: {_gpus(already)}")
    if not result["drained"]:
        typer.echo("no shared GPU to drain")


def undrain(gpu: GpuOpt = None, socket: SocketOpt = None) -> None:
    """End a drain: the GPU admits work again (root or the admin group)."""
    from gpushare import protocol

    params: dict[str, Any] = {} if gpu is None else {"gpu": gpu}
    result = _call(socket, protocol.UNDRAIN, params)
    if result["undrained"]:
        verb = "admits" if len(result["undrained"]) == 1 else "admit"
        typer.echo(f"{_gpus(result['undrained'])} {verb} work again")
    else:
        typer.echo("no GPU was draining")


def register(app: typer.Typer) -> None:
    """Add the commands to the root application."""
    app.command("drain")(drain)
    app.command("undrain")(undrain)
