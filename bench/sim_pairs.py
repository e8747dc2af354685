"""The sharing baselines on the Tally-shaped pairs, host-bound and GPU-bound, against hardware.

Issue 13 compared the model's pairs (BERT b2 and Transformer-XL b4 inference at load 0.5 next to
each of the 7 training profiles) with published hardware; issue 33 item 4 asks the same of their
GPU-bound variants (``gpushare/scenarios/gpubound``: 5 us of CPU per kernel, a CUDA-graph or
TensorRT server, instead of eager PyTorch's 56.2 us). Per variant, pair set and run length it
prints the median (max) of p99 over p99 alone per baseline on two metrics (latency with queueing,
service time without: ``gpushare/sim/baseline_check.py``), each set against the range hardware
measured, with how far outside it is.

    python bench/sim_pairs.py --jobs 1 --duration 10 20
    python bench/sim_pairs.py --jobs 1 --duration 20 --switch 0us     # a sensitivity

``--slice``/``--switch`` override the GPU's time-slicing constants, ``--host-per-kernel`` the
servers' CPU time per kernel (both variants then get it). Writes ``bench/results/sim_pairs.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.sim import baseline_check, engine, scenario  # noqa: E402
from gpushare.units import parse_duration  # noqa: E402

#: The variants: the shipped pairs (eager PyTorch servers) and their GPU-bound copies.
VARIANTS = {"host-bound": "pairs/", "gpu-bound": "gpubound/"}
#: The Tally-shaped pairs (BERT, Transformer-XL), and the same with the ResNet-50 server.
SETS = {
    "14 Tally-shaped": ("bert_2_fwd+", "transformer_xl_4_fwd+"),
    "21 with ResNet-50": ("bert_2_fwd+", "transformer_xl_4_fwd+", "resnet50_4_fwd+"),
}


def run_pair(args: tuple[str, float, dict[str, float]]) -> list[dict[str, Any]]:
    """Every baseline's ratios on one pair."""
    name, duration, gpu = args
    ratios = baseline_check.pair_ratios(scenario.load(name), duration_s=duration, **gpu)
    return [dataclasses.asdict(r) | {"scenario": name} for r in ratios]


def summarise(rows: list[dict[str, Any]], folder: str, prefixes: tuple[str, ...]) -> list[Any]:
    """The checks over the pairs of one variant whose server is one of ``prefixes``."""
    picked = [
        baseline_check.PairRatio(r["pair"], r["baseline"], r["latency_ratio"], r["service_ratio"])
        for r in rows
        if r["scenario"].startswith(tuple(folder + p for p in prefixes))
    ]
    return baseline_check.checks(picked)


def main(argv: list[str] | None = None) -> int:
    """Print the tables and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, nargs="+", default=[10.0, 20.0])
    ap.add_argument("--slice", help="time slice, e.g. 2ms (default: the model's)")
    ap.add_argument("--switch", help="context-switch cost, e.g. 218us (default: the model's)")
    ap.add_argument("--host-per-kernel", help="servers' CPU per kernel, both variants (e.g. 5us)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_pairs.json"))
    args = ap.parse_args(argv)
    logs.configure_logging("warning")
    gpu: dict[str, float] = {}
    for key, value in (
        ("slice_s", args.slice),
        ("switch_s", args.switch),
        ("host_per_kernel_s", args.host_per_kernel),
    ):
        if value:
            gpu[key] = parse_duration(value)
    widest = SETS["21 with ResNet-50"]
    names = [
        n
        for n in scenario.shipped()
        if n.startswith(tuple(f + p for f in VARIANTS.values() for p in widest))
    ]
    probe = scenario.load(names[0]).gpu
    doc: dict[str, Any] = {
        "command": "python bench/sim_pairs.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
        "slice_s": gpu.get("slice_s", probe.slice_s),
        "switch_s": gpu.get("switch_s", probe.switch_s),
        "host_per_kernel_s": gpu.get("host_per_kernel_s"),
        "ranges": baseline_check.RANGES,
        "runs": [],
    }
    print(f"slice {doc['slice_s'] * 1e3:.3f} ms, switch {doc['switch_s'] * 1e6:.0f} us")
    print("| variant | pairs | run | baseline | range | latency, median (max) | service |")
    print("|---|---|---|---|---|---|---|")
    wall0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for duration in args.duration:
            rows = [r for rs in pool.map(run_pair, [(n, duration, gpu) for n in names]) for r in rs]
            run: dict[str, Any] = {"duration_s": duration, "pairs": rows, "checks": []}
            for variant, folder in VARIANTS.items():
                for label, prefixes in SETS.items():
                    by = {(c.baseline, c.metric): c for c in summarise(rows, folder, prefixes)}
                    for c in by.values():
                        run["checks"].append(
                            dataclasses.asdict(c)
                            | {"variant": variant, "set": label, "off_by": c.off_by}
                        )
                    for b, (low, high) in baseline_check.RANGES.items():
                        cells = [_cell(by[(b, m)]) for m in baseline_check.METRICS]
                        print(
                            f"| {variant} | {label} | {duration:g} s | {b} | {low:g}-{high:g}x | "
                            + " | ".join(cells)
                            + " |",
                            flush=True,
                        )
            doc["runs"].append(run)
    doc["wall_s"] = time.perf_counter() - wall0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s, engine {doc['engine']})")
    return 0


def _cell(c: baseline_check.Check) -> str:
    where = "inside" if c.inside else f"**x{c.off_by:.2f}**"
    return f"{c.median_ratio:.2f}x ({c.worst_ratio:.1f}x) {where}"


if __name__ == "__main__":
    raise SystemExit(main())
