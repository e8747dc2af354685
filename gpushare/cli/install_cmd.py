"""``gpushare install`` and ``gpushare uninstall`` (root): the daemon as a systemd service."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from gpushare import install as installer

RootOpt = Annotated[
    Path,
    typer.Option("--root", help="Act on this directory as if it were / (image builds, tests)."),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print what would be done; change nothing.")
]
NoSystemdOpt = Annotated[
    bool,
    typer.Option("--no-systemd", help="Files only: no systemctl (hosts without systemd)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the steps as JSON.")]


def _finish(
    command: str,
    run: Callable[[installer.Options], installer.Report],
    opts: installer.Options,
    as_json: bool,
) -> None:
    try:
        report = run(opts)
    except installer.InstallError as exc:
        if as_json:
            out = {"command": command, "root": str(opts.root), "ok": False, "error": str(exc)}
            typer.echo(json.dumps(out, indent=2))
        else:
            typer.echo(f"gpushare {command}: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        typer.echo(report.render(), nl=False)
    if not report.ok:
        if not as_json:
            typer.echo(
                f"gpushare {command}: a step failed (see above); fix it and run again", err=True
            )
        raise typer.Exit(code=1)


def install(
    root: RootOpt = Path("/"),
    dry_run: DryRunOpt = False,
    no_systemd: NoSystemdOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Install gpushare as a systemd service: config, unit, /usr/bin link, admin group; start it.

    Idempotent: run it again after an upgrade. An edited /etc/gpushare/gpushare.toml is never
    overwritten.
    """
    opts = installer.Options(root=root, dry_run=dry_run, systemd=not no_systemd)
    _finish("install", installer.install, opts, as_json)


def uninstall(
    root: RootOpt = Path("/"),
    dry_run: DryRunOpt = False,
    no_systemd: NoSystemdOpt = False,
    purge: Annotated[
        bool,
        typer.Option(
            "--purge", help="Also remove /var/lib/gpushare, an edited config and unit drop-ins."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Stop and remove the gpushare service; running workloads are left alone.

    /var/lib/gpushare (the client registry) and an edited config stay unless --purge.
    """
    opts = installer.Options(root=root, dry_run=dry_run, systemd=not no_systemd, purge=purge)
    _finish("uninstall", installer.uninstall, opts, as_json)


def register(app: typer.Typer) -> None:
    """Add the commands to the root application."""
    app.command("install")(install)
    app.command("uninstall")(uninstall)
