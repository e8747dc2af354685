"""``gpushare config check``: validate a config file without applying it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gpushare import config, paths

app = typer.Typer(
    help="Inspect and validate the configuration.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.command("check")
def check(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Config file (default: $GPUSHARE_CONFIG or /etc/gpushare/gpushare.toml)."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the effective config as JSON.")
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="Print nothing when it is valid (the unit's ExecReload)."
        ),
    ] = False,
) -> None:
    """Validate a config file and print the effective configuration; exit 2 if it is invalid."""
    target = path or paths.default_config_file()
    try:
        cfg = config.load(target)
    except config.ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    if quiet:
        return
    if as_json:
        typer.echo(json.dumps(config.to_dict(cfg), indent=2))
    else:
        typer.echo(f"# {target}: OK\n" + config.to_toml(cfg), nl=False)


def register(root: typer.Typer) -> None:
    """Add ``gpushare config`` to the root application."""
    root.add_typer(app, name="config")
