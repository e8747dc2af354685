"""The 14 Tally-shaped pairs under plain MPS and time-slicing, on two latency metrics.

Issue 13's done-when item compares the model's pairs (BERT b2 and Transformer-XL b4 inference at
load 0.5 next to each of the 7 training profiles) with published hardware. Two latencies are
reported per request, because the published benchmark and the simulator define it differently
(docs/simulator.md section 4, "What Tally measures"):

* **latency**: completion - arrival, queueing included (the simulator's metric, W1); a server
  that falls behind shows it here, growing with the run's length;
* **service**: completion - the moment the server took the request off its queue, queueing
  excluded (what ``tally-bench``'s ``ServerInferMonitor`` records as a request's latency).

For each, the median and max over the 14 pairs of p99 over p99 alone, per baseline and run length.
``--slice``/``--switch`` override the GPU's time-slicing constants (to compare settings).

    python bench/sim_pairs.py --jobs 1 --duration 10 20
    python bench/sim_pairs.py --jobs 1 --duration 10 20 --slice 2ms --switch 218us

Writes ``bench/results/sim_pairs.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.cli.sim_run import make_policies  # noqa: E402
from gpushare.sim import engine, runner, scenario  # noqa: E402
from gpushare.stats import percentile  # noqa: E402
from gpushare.units import parse_duration  # noqa: E402

PAIR_PREFIXES = ("pairs/bert_2_fwd+", "pairs/transformer_xl_4_fwd+")
BASELINES = ("mps", "time-slicing")

#: Service times of the last run's online services, captured as the run is collected.
_SERVED: dict[str, list[float]] = {}
_collect = runner.collect


def _capture(node: Any, sc: Any, *args: Any, **kwargs: Any) -> Any:
    _SERVED.clear()
    for c in node.online:
        _SERVED[c.cid] = [s * 1e3 for arr, s in c.served if arr >= sc.warmup_s]
    return _collect(node, sc, *args, **kwargs)


runner.collect = _capture


def pair(args: tuple[str, float, dict[str, float]]) -> dict[str, Any]:
    """p99 over p99 alone of one pair, on both metrics, under each baseline."""
    name, duration, gpu = args
    sc = scenario.load(name)
    sc = dataclasses.replace(sc, duration_s=duration, gpu=dataclasses.replace(sc.gpu, **gpu))
    alone, slo = runner.standalone(sc)
    assert alone is not None
    alone_lat = alone.online[0].p99_ms
    alone_srv = percentile(next(iter(_SERVED.values())), 99.0)
    out: dict[str, Any] = {"pair": name}
    for pname, policy in make_policies(list(BASELINES), sc.config.control):
        res = runner.run_policy(sc, policy, name=pname, slo_ms=slo)
        served = next(iter(_SERVED.values()))
        out[pname] = {
            "latency": res.online[0].p99_ms / alone_lat,
            "service": percentile(served, 99.0) / alone_srv,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, nargs="+", default=[10.0, 20.0])
    ap.add_argument("--slice", help="time slice, e.g. 2ms (default: the model's)")
    ap.add_argument("--switch", help="context-switch cost, e.g. 218us (default: the model's)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_pairs.json"))
    args = ap.parse_args(argv)
    logs.configure_logging("warning")
    gpu: dict[str, float] = {}
    if args.slice:
        gpu["slice_s"] = parse_duration(args.slice)
    if args.switch:
        gpu["switch_s"] = parse_duration(args.switch)
    pairs = [n for n in scenario.shipped() if n.startswith(PAIR_PREFIXES)]
    wall0 = time.perf_counter()
    probe = scenario.load(pairs[0]).gpu
    doc: dict[str, Any] = {
        "command": "python bench/sim_pairs.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
        "slice_s": gpu.get("slice_s", probe.slice_s),
        "switch_s": gpu.get("switch_s", probe.switch_s),
        "rows": [],
    }
    print(f"slice {doc['slice_s'] * 1e3:.3f} ms, switch {doc['switch_s'] * 1e6:.0f} us")
    print("| run | baseline | latency p99/alone, median (max) | service p99/alone, median (max) |")
    print("|---|---|---|---|")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for duration in args.duration:
            res = list(pool.map(pair, [(n, duration, gpu) for n in pairs]))
            for b in BASELINES:
                row: dict[str, Any] = {"duration_s": duration, "baseline": b}
                for metric in ("latency", "service"):
                    vals = [r[b][metric] for r in res]
                    row[metric] = {"median": statistics.median(vals), "max": max(vals)}
                row["pairs"] = {r["pair"]: r[b] for r in res}
                doc["rows"].append(row)
                lat, srv = row["latency"], row["service"]
                print(
                    f"| {duration:g} s | {b} | {lat['median']:.2f}x ({lat['max']:.1f}x) | "
                    f"{srv['median']:.2f}x ({srv['max']:.1f}x) |",
                    flush=True,
                )
    doc["wall_s"] = time.perf_counter() - wall0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s, engine {doc['engine']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
