"""``gpushare daemon``: run the node daemon in the foreground (what gpushare.service starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpushare import paths


def daemon(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Config file (default: $GPUSHARE_CONFIG or /etc/gpushare/gpushare.toml).",
        ),
    ] = None,
    log_level: Annotated[
        str | None,
        typer.Option("--log-level", help="debug, info, warning or error (overrides the config)."),
    ] = None,
    simulate: Annotated[
        int | None,
        typer.Option(
            "--simulate",
            help="Run on N simulated GPUs in real time (no GPU needed; docs/simulator.md).",
        ),
    ] = None,
) -> None:
    """Run the gpushare daemon in the foreground (systemd Type=notify)."""
    # Imported here: the daemon's modules are not needed by the client commands.
    from gpushare.roots.daemon import main

    if log_level is not None and log_level not in ("debug", "info", "warning", "error"):
        typer.echo("gpushare: --log-level must be debug, info, warning or error", err=True)
        raise typer.Exit(code=2)
    if simulate is not None and not 1 <= simulate <= 64:
        typer.echo("gpushare: --simulate takes a number of GPUs from 1 to 64", err=True)
        raise typer.Exit(code=2)
    raise typer.Exit(code=main(config or paths.default_config_file(), log_level, simulate))


def register(app: typer.Typer) -> None:
    """Add the command to the root application."""
    app.command("daemon")(daemon)
