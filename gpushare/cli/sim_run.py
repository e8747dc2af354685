"""What ``gpushare sim`` runs: policies on simulated GPUs in virtual time, and their reports.

Runs the online services of each scenario alone (the reference), then every chosen policy, and
prints one table per scenario; writes the same as JSON plus PNG plots under ``--out``. The command
itself is :mod:`gpushare.cli.sim_cmd`, which imports this module (and the simulator) only when a
simulation runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from gpushare import logs
from gpushare.config import ControlConfig
from gpushare.control import registry
from gpushare.control.policy import Policy
from gpushare.sim import ENGINE, data, engine, llm_node, report, runner, scenario


class PolicyError(Exception):
    """A policy name is unknown."""


def policy_names() -> tuple[str, ...]:
    """Every policy the registry offers."""
    return registry.POLICY_NAMES


def make_policies(names: Sequence[str], control: ControlConfig) -> list[tuple[str, Policy[Any]]]:
    """Build the named policies from the registry.

    Raises:
        PolicyError: an unknown name (the message lists the valid ones).
    """
    out = []
    for name in names:
        try:
            out.append((name, registry.make_policy(name, control)))
        except ValueError as exc:
            raise PolicyError(str(exc)) from None
    return out


class _Progress:
    """A one-line progress bar on stderr (a line per finished run when stderr is not a TTY)."""

    def __init__(self, total_runs: int) -> None:
        self.total = total_runs
        self.done = 0
        self.tty = sys.stderr.isatty()
        self.label = ""

    def update(self, label: str, frac: float) -> None:
        if label != self.label:
            self.label = label
        if self.tty:
            overall = (self.done + frac) / self.total
            bar = "#" * int(overall * 30)
            sys.stderr.write(f"\r[{bar:<30}] {overall * 100:3.0f}%  {label:<48.48}")
            sys.stderr.flush()

    def finish_run(self, label: str, run: runner.RunResult) -> None:
        self.done += 1
        if not self.tty:
            sys.stderr.write(
                f"[{self.done}/{self.total}] {label}: {run.virtual_s:.0f}s virtual in "
                f"{run.wall_s:.1f}s ({run.speed_factor:.0f}x real time)\n"
            )

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


def run_files(
    files: Sequence[Path],
    policies: Sequence[str] | None,
    *,
    duration_s: float | None = None,
    progress: bool = True,
    slo_factor: float | None = None,
    request_boundaries: bool | None = None,
) -> list[runner.ScenarioResult]:
    """Load the scenarios and run every policy on each (the reference run first).

    ``slo_factor`` overrides every online service's ``slo_factor`` (its SLO as a multiple of its
    p99 alone); a service with an explicit ``slo_p99_ms`` keeps it. ``request_boundaries``
    overrides whether every online service sends request boundaries (``False``: no request
    gating anywhere).

    Raises:
        scenario.ScenarioError: a bad scenario file.
        PolicyError: an unknown policy.
        data.DataError: the data a scenario names is missing.
    """
    loaded = [scenario.load(f) for f in files]
    if duration_s is not None:
        loaded = [
            dataclasses.replace(s, duration_s=duration_s, warmup_s=min(s.warmup_s, duration_s / 4))
            for s in loaded
        ]
    if slo_factor is not None:
        loaded = [
            dataclasses.replace(
                s,
                online=tuple(dataclasses.replace(o, slo_factor=slo_factor) for o in s.online),
                llm=tuple(dataclasses.replace(x, slo_factor=slo_factor) for x in s.llm),
            )
            for s in loaded
        ]
    if request_boundaries is not None:
        loaded = [
            dataclasses.replace(
                s,
                online=tuple(
                    dataclasses.replace(o, request_boundaries=request_boundaries) for o in s.online
                ),
            )
            for s in loaded
        ]
    names = list(policies) if policies else list(policy_names())
    make_policies(names, loaded[0].config.control)  # fail on a bad name before running anything
    # The daemon's loop runs inside: its info log (duty changes, readiness) is not the report.
    logs.configure_logging("warning")
    bar = _Progress(len(loaded) * (len(names) + 1)) if progress else None
    results = []
    for sc in loaded:
        made = make_policies(names, sc.config.control)
        results.append(_run_one(sc, made, bar))
    if bar is not None:
        bar.close()
    return results


def _run_one(
    sc: scenario.Scenario, made: list[tuple[str, Policy[Any]]], bar: _Progress | None
) -> runner.ScenarioResult:
    if bar is None:
        return runner.run_scenario(sc, made)
    return runner.run_scenario(
        sc,
        made,
        progress=lambda label, frac: bar.update(f"{sc.name} / {label}", frac),
        on_run=lambda label, run: bar.finish_run(f"{sc.name} / {label}", run),
    )


def write_outputs(result: runner.ScenarioResult, out: Path) -> list[str]:
    """Write ``<name>.json`` and the plots; return lines saying what was written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.scenario.name}.json"
    path.write_text(json.dumps(report.to_json(result), indent=1) + "\n")
    lines = [f"wrote {path}"]
    plots = report.plot(result, out)
    if isinstance(plots, str):
        lines.append(plots)
    else:
        lines.extend(f"wrote {p}" for p in plots)
    return lines


def llm_line(x: llm_node.LlmResult) -> str:
    """One LLM server's TTFT and TPOT p99s against their SLOs, and its attainment."""

    def slo(v: float | None, fmt: str) -> str:
        return f" (SLO {v:{fmt}})" if v is not None else ""

    att = f", {x.slo_attainment:.2%} inside both" if x.slo_attainment is not None else ""
    return (
        f"{x.name} TTFT p99 {x.ttft_p99_ms:.0f} ms{slo(x.slo_ttft_p99_ms, '.0f')}, "
        f"TPOT p99 {x.tpot_p99_ms:.1f} ms{slo(x.slo_tpot_p99_ms, '.1f')}{att}"
    )


def report_runs(
    scenarios: Sequence[Path],
    policy: Sequence[str] | None,
    out: Path,
    duration: float | None,
    no_progress: bool,
) -> None:
    """Run the scenarios, print their tables and write their outputs (``gpushare sim``)."""
    wall0 = time.perf_counter()
    try:
        results = run_files(scenarios, policy, duration_s=duration, progress=not no_progress)
    except (scenario.ScenarioError, PolicyError, data.DataError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    wall = time.perf_counter() - wall0
    virtual = 0.0
    slowest: runner.RunResult | None = None
    for res in results:
        about = res.scenario.description if res.scenario.description else res.scenario.file
        typer.echo(f"\n== {res.scenario.name}: {about}")
        if res.alone is not None:
            alone = ", ".join(
                f"{o.name} p50 {o.p50_ms:.1f} ms p99 {o.p99_ms:.1f} ms (SLO {res.slo_ms[o.name]:.1f})"
                for o in res.alone.online
            )
            typer.echo(f"alone: {alone}")
        for run in [*([res.alone] if res.alone else []), *res.runs]:
            for x in run.llm:
                typer.echo(f"{run.policy}: {llm_line(x)}")
        typer.echo(report.text_table(report.summarise(res)))
        for line in write_outputs(res, out):
            typer.echo(line)
        for run in [*([res.alone] if res.alone else []), *res.runs]:
            virtual += run.virtual_s
            if slowest is None or run.speed_factor < slowest.speed_factor:
                slowest = run
    if slowest is not None:
        typer.echo(
            f"\nsimulated {virtual:.0f} s of virtual time in {wall:.1f} s: "
            f"{virtual / wall:.0f}x real time overall; slowest run "
            f"{slowest.scenario} / {slowest.policy} at {slowest.speed_factor:.0f}x"
        )
        typer.echo(f"engine: {engine.loaded()} ({ENGINE.reason})")
