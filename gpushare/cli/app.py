"""The Typer application and the entry point of the ``gpushare`` console script.

Each command group lives in its own module under :mod:`gpushare.cli` and is registered here.
Exit codes: 0 success, 1 the operation failed, 2 bad usage or bad input, 3 the daemon is not
reachable.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpushare import __version__
from gpushare.cli import (
    clients_cmd,
    completion,
    config_cmd,
    daemon_cmd,
    doctor_cmd,
    drain_cmd,
    env_cmd,
    install_cmd,
    sim_cmd,
)

app = typer.Typer(
    name="gpushare",
    help="Share NVIDIA GPUs between latency-critical online services and offline jobs.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
app.add_typer(config_cmd.app, name="config")
clients_cmd.register(app)
daemon_cmd.register(app)
drain_cmd.register(app)
doctor_cmd.register(app)
env_cmd.register(app)
install_cmd.register(app)
app.command("sim")(sim_cmd.sim)
completion.register(app)


@app.command("slurm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def _slurm(ctx: typer.Context) -> None:
    """Slurm's Prolog, TaskProlog and Epilog: gpushare slurm prolog|task-prolog|epilog."""
    from gpushare.slurm import main as slurm_main

    raise typer.Exit(slurm_main(ctx.args))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpushare {__version__}")
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Share NVIDIA GPUs between latency-critical online services and offline jobs."""


def main() -> None:
    """Console-script entry point."""
    completion.init_if_completing()
    app()
