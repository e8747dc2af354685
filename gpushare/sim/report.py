"""Summaries of simulation runs: rows, a text table, a Markdown table, JSON and plots.

Metric definitions (the Tally evaluation's, Tally's, ``docs/sources.md``):

* **p99 overhead**: an online service's p99 under the policy over its p99 running alone (the same
  arrivals with no offline work), minus one. With several services, the worst one is shown.
* **service overhead**: the same for the p99 of the service time (queueing excluded: from the
  moment the server takes a request off its queue to its completion), which is what Tally's
  benchmark records as a request's latency; a server that falls behind shows it in the p99
  overhead, not here.
* **SLO attainment**: the fraction of requests under the service's p99 SLO.
* **offline throughput**: iterations per second over the iterations per second alone on the whole
  GPU (summed over offline jobs).
* **system throughput**: online requests served over those served alone, plus the offline
  normalised throughputs (Tally's "sum of normalised throughputs").
* **GPU busy**: the fraction of time at least one kernel ran; **SM active**: the mean fraction of
  SMs held.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushare.sim import engine
from gpushare.sim.results import RunResult, ScenarioResult


@dataclass(frozen=True, slots=True)
class Row:
    """One policy on one scenario, summarised."""

    scenario: str
    policy: str
    online_p50_ms: float | None
    online_p99_ms: float | None
    p99_overhead: float | None
    service_overhead: float | None
    slo_attainment: float | None
    offline_norm: float | None
    system_throughput: float
    busy_fraction: float
    sm_active_fraction: float
    mem_peak_bytes: int
    mem_total_bytes: int
    speed_factor: float
    failures: int
    #: The daemon's ``RestartClient`` actions over the whole run (issue 32), and per hour of
    #: offline job time (jobs x virtual hours): how often a policy costs a job its restart.
    restarts: int = 0
    restarts_per_job_hour: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes None)."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            v = getattr(self, name)
            out[name] = None if isinstance(v, float) and not math.isfinite(v) else v
        return out


def summarise(result: ScenarioResult) -> list[Row]:
    """One row per policy run of a scenario."""
    alone = result.alone
    rows = []
    for run in result.runs:
        rows.append(_row(result, run, alone))
    return rows


def _row(result: ScenarioResult, run: RunResult, alone: RunResult | None) -> Row:
    worst_overhead: float | None = None
    worst_service: float | None = None
    worst = None
    online_norm = 0.0
    attain: list[float] = []
    for i, o in enumerate(run.online):
        ref = alone.online[i] if alone is not None else None
        if ref is not None and ref.p99_ms > 0 and math.isfinite(o.p99_ms):
            ovh = o.p99_ms / ref.p99_ms - 1.0
            if worst_overhead is None or ovh > worst_overhead:
                worst_overhead, worst = ovh, o
        if ref is not None and ref.service_p99_ms > 0 and math.isfinite(o.service_p99_ms):
            svc = o.service_p99_ms / ref.service_p99_ms - 1.0
            worst_service = svc if worst_service is None else max(worst_service, svc)
        elif worst is None:
            worst = o
        if ref is not None and ref.requests:
            online_norm += o.requests / ref.requests
        if o.slo_attainment is not None:
            attain.append(o.slo_attainment)
    # LLM servers: inside both their TTFT and TPOT SLOs.
    attain += [x.slo_attainment for x in run.llm if x.slo_attainment is not None]
    offline_norm = (
        sum(f.iter_per_s / f.standalone_iter_per_s for f in run.offline) if run.offline else None
    )
    return Row(
        scenario=result.scenario.name,
        policy=run.policy,
        online_p50_ms=worst.p50_ms if worst is not None else None,
        online_p99_ms=worst.p99_ms if worst is not None else None,
        p99_overhead=worst_overhead,
        service_overhead=worst_service,
        slo_attainment=min(attain) if attain else None,
        offline_norm=offline_norm,
        system_throughput=online_norm + (offline_norm or 0.0),
        busy_fraction=run.busy_fraction,
        sm_active_fraction=run.sm_active_fraction,
        mem_peak_bytes=run.mem_peak_bytes,
        mem_total_bytes=run.mem_total_bytes,
        speed_factor=run.speed_factor,
        failures=sum(1 for f in run.offline if f.final_state == "failed"),
        restarts=run.actions.get("RestartClient", 0),
        restarts_per_job_hour=restarts_per_job_hour(run),
    )


def restarts_per_job_hour(run: RunResult) -> float | None:
    """The run's restarts per hour of offline job time; ``None`` without offline jobs."""
    job_hours = len(run.offline) * run.virtual_s / 3600.0
    if job_hours <= 0:
        return None
    return run.actions.get("RestartClient", 0) / job_hours


HEADERS = (
    "policy",
    "p50 ms",
    "p99 ms",
    "p99 ovh",
    "svc ovh",
    "SLO att",
    "offline",
    "system",
    "busy",
    "SM act",
    "mem peak",
    "speed",
)


def _cells(row: Row) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None or not math.isfinite(v) else format(v, fmt)

    return [
        row.policy,
        num(row.online_p50_ms, ".1f"),
        num(row.online_p99_ms, ".1f"),
        "-" if row.p99_overhead is None else f"{row.p99_overhead * 100:+.0f}%",
        "-" if row.service_overhead is None else f"{row.service_overhead * 100:+.0f}%",
        "-" if row.slo_attainment is None else f"{row.slo_attainment * 100:.1f}%",
        num(row.offline_norm, ".2f"),
        f"{row.system_throughput:.2f}",
        f"{row.busy_fraction * 100:.0f}%",
        f"{row.sm_active_fraction * 100:.0f}%",
        f"{row.mem_peak_bytes / (1 << 30):.1f}/{row.mem_total_bytes / (1 << 30):.0f}G",
        f"{row.speed_factor:.0f}x",
    ]


def text_table(rows: Sequence[Row]) -> str:
    """A fixed-width table for the terminal."""
    cells = [list(HEADERS), *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = []
    for k, c in enumerate(cells):
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(c, widths, strict=True))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row], *, with_scenario: bool = False) -> str:
    """A Markdown table (optionally with a scenario column)."""
    head = (["scenario"] if with_scenario else []) + list(HEADERS)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r.scenario] if with_scenario else []) + _cells(r)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def to_json(result: ScenarioResult) -> dict[str, Any]:
    """Everything about one scenario's runs, JSON-ready."""

    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    def run_json(run: RunResult) -> dict[str, Any]:
        out: dict[str, Any] = clean(
            {
                "policy": run.policy,
                "virtual_s": run.virtual_s,
                "wall_s": run.wall_s,
                "speed_factor": run.speed_factor,
                "online": [
                    {
                        k: getattr(o, k)
                        for k in ("name", "requests", "p50_ms", "p99_ms", "service_p99_ms")
                    }
                    | {"slo_p99_ms": o.slo_p99_ms, "slo_attainment": o.slo_attainment}
                    for o in run.online
                ],
                "offline": [vars(f) for f in run.offline],
                "llm": [dataclasses.asdict(x) for x in run.llm],
                "busy_fraction": run.busy_fraction,
                "sm_active_fraction": run.sm_active_fraction,
                "mem_peak_bytes": run.mem_peak_bytes,
                "actions": run.actions,
                "restarts_per_job_hour": restarts_per_job_hour(run),
                "kernels": run.kernels,
                "series": run.series,
            }
        )
        return out

    sc = result.scenario
    return {
        "engine": engine.loaded(),
        "scenario": sc.name,
        "file": sc.file,
        "description": sc.description,
        "duration_s": sc.duration_s,
        "warmup_s": sc.warmup_s,
        "seed": sc.seed,
        "slo_ms": result.slo_ms,
        "alone": run_json(result.alone) if result.alone is not None else None,
        "rows": [r.as_dict() for r in summarise(result)],
        "runs": [run_json(r) for r in result.runs],
    }


def plot(result: ScenarioResult, out_dir: Path) -> list[Path] | str:
    """Write the latency CDF, offline throughput and duty plots; a message when matplotlib is absent."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "matplotlib is not installed: plots skipped (pip install 'gpushare[plot]')"
    name = result.scenario.name
    written: list[Path] = []
    runs = ([result.alone] if result.alone is not None else []) + result.runs

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        if run.online:
            lats = sorted(x for o in run.online for x in o.latencies_ms)
            if lats:
                ys = [(i + 1) / len(lats) for i in range(len(lats))]
                ax.plot(lats, ys, label=run.policy)
    ax.set_xscale("log")
    ax.set_xlabel("online request latency (ms)")
    ax.set_ylabel("CDF")
    ax.set_title(f"{name}: online latency")
    if ax.get_legend_handles_labels()[0]:  # LLM servers alone draw no request-latency line
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / f"{name}-latency-cdf.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in result.runs:
        series = run.series.get("offline_ips", {})
        if series:
            total = [sum(v) for v in zip(*series.values(), strict=True)]
            t0, dt = run.series["t0_s"], run.series["bin_s"]
            ax.step([t0 + i * dt for i in range(len(total))], total, where="post", label=run.policy)
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("offline throughput (x alone)")
    ax.set_title(f"{name}: offline throughput")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / f"{name}-offline-throughput.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in result.runs:
        duty = run.series.get("duty", {})
        if duty:
            first = next(iter(duty.values()))
            if first:
                ax.step(
                    [t for t, _ in first], [d for _, d in first], where="post", label=run.policy
                )
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("offline duty (GPU 0)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{name}: duty cycle")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / f"{name}-duty.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
