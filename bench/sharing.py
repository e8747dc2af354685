"""Sharing quality: every shipped scenario x every policy on the simulated GPU node.

Runs the shipped scenarios (``gpushare/scenarios/**/*.toml``; the 1-hour ``long/`` ones only with
``--long``) under each policy of the registry
(plus each scenario's online services alone, the reference), prints a per-policy summary and writes
``bench/results/sharing.json`` and ``bench/results/sharing.md`` (the per-scenario table and the
summary). Usage::

    .venv/bin/python bench/sharing.py [--jobs 2] [--duration S] [--slo-factor F] [--policy NAME ...]
        [SCENARIO ...]

Numbers are virtual-time results of the model described in ``docs/simulator.md``: they rank
policies on one model, they are not measurements of a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.cli import sim_run  # noqa: E402
from gpushare.sim import engine, report  # noqa: E402

RESULTS = REPO / "bench" / "results"


def _run(
    args: tuple[str, list[str] | None, float | None, float | None, bool | None],
) -> dict[str, Any]:
    path, policies, duration, slo_factor, boundaries = args
    t0 = time.perf_counter()
    (result,) = sim_run.run_files(
        [Path(path)],
        policies,
        duration_s=duration,
        progress=False,
        slo_factor=slo_factor,
        request_boundaries=boundaries,
    )
    rows = report.summarise(result)
    return {
        "file": str(Path(path).resolve().relative_to(REPO)),
        "scenario": result.scenario.name,
        "wall_s": time.perf_counter() - t0,
        "virtual_s": result.scenario.duration_s,
        "alone_speed": result.alone.speed_factor if result.alone else None,
        "rows": [r.as_dict() for r in rows],
    }


def summary(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy: mean and worst p99 overhead, mean offline and system throughput, SLO, speed."""
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for sc in scenarios:
        for row in sc["rows"]:
            by_policy.setdefault(row["policy"], []).append(row)
    out = []
    for policy, rows in by_policy.items():
        ovh = [r["p99_overhead"] for r in rows if r["p99_overhead"] is not None]
        off = [r["offline_norm"] for r in rows if r["offline_norm"] is not None]
        slo = [r["slo_attainment"] for r in rows if r["slo_attainment"] is not None]
        rph = [
            r["restarts_per_job_hour"] for r in rows if r.get("restarts_per_job_hour") is not None
        ]
        out.append(
            {
                "policy": policy,
                "scenarios": len(rows),
                "p99_overhead_mean": statistics.fmean(ovh) if ovh else None,
                "p99_overhead_median": statistics.median(ovh) if ovh else None,
                "p99_overhead_worst": max(ovh) if ovh else None,
                "within_7pct": sum(1 for x in ovh if x <= 0.07),
                "slo_attainment_mean": statistics.fmean(slo) if slo else None,
                "offline_norm_mean": statistics.fmean(off) if off else None,
                "restarts_per_job_hour_mean": statistics.fmean(rph) if rph else None,
                "restarts_per_job_hour_worst": max(rph) if rph else None,
                "system_throughput_mean": statistics.fmean(r["system_throughput"] for r in rows),
                "busy_mean": statistics.fmean(r["busy_fraction"] for r in rows),
                "speed_min": min(r["speed_factor"] for r in rows),
            }
        )
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 100:+.0f}%"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """The per-policy summary as a Markdown table."""
    head = (
        "| policy | p99 overhead mean | median | worst | scenarios within 7 % | SLO attainment "
        "| offline tput | restarts per job-hour | system tput | GPU busy | slowest run |"
    )
    out = [head, "|" + "---|" * 11]
    for r in rows:
        out.append(
            f"| {r['policy']} | {_pct(r['p99_overhead_mean'])} | {_pct(r['p99_overhead_median'])} "
            f"| {_pct(r['p99_overhead_worst'])} | {r['within_7pct']}/{r['scenarios']} "
            f"| {_num(r['slo_attainment_mean'] and r['slo_attainment_mean'] * 100)}% "
            f"| {_num(r['offline_norm_mean'])} | {_num(r.get('restarts_per_job_hour_mean'))} "
            f"| {_num(r['system_throughput_mean'])} "
            f"| {r['busy_mean'] * 100:.0f}% | {r['speed_min']:.0f}x |"
        )
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: every shipped one)")
    ap.add_argument("--policy", action="append", help="policy to run (repeat; default: all)")
    ap.add_argument("--duration", type=float, help="override each scenario's virtual duration")
    ap.add_argument(
        "--slo-factor",
        type=float,
        help="every online SLO = this x its p99 alone (overrides scenarios' slo_factor; "
        "an explicit slo_p99_ms is kept)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="scenarios run in parallel")
    ap.add_argument(
        "--no-gating",
        action="store_true",
        help="online services send no request boundaries (no request gating anywhere)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the 3 trace scenarios + the 5 pairs with ResNet-50 training, 10 s each (~1 min)",
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help="the 1-hour variants (scenarios/long/: restarts per job-hour over a daemon's hours); "
        "the default set leaves them out",
    )
    ap.add_argument(
        "--gpu-bound",
        action="store_true",
        help="the GPU-bound variants of the pairs (scenarios/gpubound/: 5 us of CPU per kernel, "
        "issue 33); the default set leaves them out",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "sharing.json",
        help="JSON file to write; the Markdown table goes beside it as NAME.md",
    )
    return ap


def _files(args: argparse.Namespace) -> list[str]:
    """The scenario files to run (``--quick`` also sets its duration on ``args``)."""
    shipped = sorted(str(p) for p in (REPO / "gpushare" / "scenarios").rglob("*.toml"))
    # Issue 32: the 1-hour variants run only when asked (--long): hours of virtual time each.
    # LLM pairs (llm/) have their own bench, bench/llm_pairs.py.
    files: list[str] = args.scenarios or [
        f
        for f in shipped
        if ("/long/" in f) == args.long
        and ("/gpubound/" in f) == args.gpu_bound
        and "/llm/" not in f
    ]
    if args.quick and not args.scenarios:
        files = [f for f in files if "/pairs/" not in f or f.endswith("+resnet50_32_fb1.toml")]
        args.duration = args.duration or 10.0
    return files


def _run_all(work: list[Any], jobs: int) -> list[dict[str, Any]]:
    """Every scenario's results, ``jobs`` at a time (one at a time: with progress)."""
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            return list(pool.map(_run, work))
    scenarios = []
    for i, w in enumerate(work, 1):
        scenarios.append(_run(w))
        print(
            f"[{i}/{len(work)}] {scenarios[-1]['scenario']} ({scenarios[-1]['wall_s']:.1f}s)",
            file=sys.stderr,
        )
    return scenarios


def _write(args: argparse.Namespace, scenarios: list[dict[str, Any]], wall: float) -> None:
    """Write the JSON and the Markdown beside it, and print the summary."""
    # with_suffix would cut "run_1.5" to "run_1.md"; only a .json suffix is replaced.
    md_path = args.out.with_suffix(".md") if args.out.suffix == ".json" else Path(f"{args.out}.md")
    summ = summary(scenarios)
    policies = [s["policy"] for s in summ]
    virtual = sum(sc["virtual_s"] * (len(policies) + 1) for sc in scenarios)
    command = "python bench/sharing.py " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "wall_s": wall,
        "virtual_s": virtual,
        "speed_overall": virtual / wall,
        "engine": engine.loaded(),
        "gating": not args.no_gating,
        "summary": summ,
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    all_rows = [report.Row(**r) for sc in scenarios for r in sc["rows"]]
    md = [
        f"Command: `{doc['command']}` ({len(scenarios)} scenarios x {len(policies)} policies, "
        f"{virtual:.0f} s virtual in {wall:.0f} s wall, {virtual / wall:.0f}x real time overall, "
        f"{engine.loaded()} engine)",
        "",
        "### Summary per policy",
        "",
        summary_markdown(summ),
        "",
        "### Every scenario",
        "",
        report.markdown_table(all_rows, with_scenario=True),
        "",
    ]
    md_path.write_text("\n".join(md))
    print(summary_markdown(summ))
    print(
        f"\n{len(scenarios)} scenarios, {virtual:.0f} s virtual in {wall:.0f} s "
        f"({virtual / wall:.0f}x real time); wrote {args.out} and {md_path}"
    )


def main() -> None:
    """Run the benchmark and write its results."""
    ap = _parser()
    args = ap.parse_args()
    if args.out.is_dir():
        args.out = args.out / "sharing.json"
    files = _files(args)
    t0 = time.perf_counter()
    if args.slo_factor is not None and args.slo_factor < 1.0:
        ap.error(f"--slo-factor {args.slo_factor:g}: must be >= 1 (an SLO under the p99 alone)")
    boundaries = False if args.no_gating else None
    work = [(f, args.policy, args.duration, args.slo_factor, boundaries) for f in files]
    scenarios = _run_all(work, args.jobs)
    _write(args, scenarios, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
