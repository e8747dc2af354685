"""``gpushare sim SCENARIO.toml``: compare sharing policies on a simulated GPU node in virtual time.

The command's options only; the simulator is imported when a simulation runs
(:mod:`gpushare.cli.sim_run`), so that ``gpushare sim -h`` and every other command start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpushare.cli import completion


def shipped_scenarios() -> list[tuple[str, str]]:
    """(name, description) of every shipped scenario; reads only their ``[scenario]`` tables.

    Without the simulator's modules: ``gpushare sim --list`` is a listing, not a simulation.
    """
    import tomllib

    root = Path(__file__).resolve().parent.parent / "scenarios"
    out = []
    for path in sorted(root.rglob("*.toml")):
        try:
            head = tomllib.loads(path.read_text(encoding="utf-8"))["scenario"]
            about = str(head.get("description", ""))
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as exc:
            about = f"(unreadable: {exc})"
        out.append((str(path.relative_to(root).with_suffix("")), about))
    return out


def sim(
    scenarios: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Scenario files, or names of shipped scenarios (`--list`), e.g. `demo`.",
            show_default=False,
            autocompletion=completion.scenarios,
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            help="A policy to run (repeat; default: every policy).",
            autocompletion=completion.policies,
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for the JSON results and PNG plots.")
    ] = Path("gpushare-sim"),
    duration: Annotated[
        float | None,
        typer.Option("--duration", help="Override each scenario's virtual duration (seconds)."),
    ] = None,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No progress bar on stderr.")
    ] = False,
    list_shipped: Annotated[
        bool, typer.Option("--list", help="List the shipped scenarios and exit.")
    ] = False,
) -> None:
    """Run sharing policies on simulated GPUs in virtual time and compare what they do."""
    if list_shipped:
        for name, about in shipped_scenarios():
            typer.echo(f"{name:<48} {about}")
        return
    if not scenarios:
        typer.echo(
            "error: name a scenario file or a shipped scenario (`gpushare sim --list`), "
            "e.g. `gpushare sim demo`",
            err=True,
        )
        raise typer.Exit(code=2)
    if duration is not None and duration <= 0:
        typer.echo("error: --duration must be a positive number of seconds", err=True)
        raise typer.Exit(code=2)
    from gpushare.cli.sim_run import report_runs

    report_runs(scenarios, policy, out, duration, no_progress)


def register(app: typer.Typer) -> None:
    """Add ``gpushare sim`` to the root application."""
    app.command("sim")(sim)
