"""The simulator against published measurements, and how its results move with its assumptions.

Prints (and writes as JSON, ``bench/results/sim_validation.json``):

1. the validation table: every published point (``gpushare/sim/validation.py``), measured and
   modelled, calibration or validation, with the error;
2. the sensitivity of the results to the wave rule's one parameter (``[gpu] wave_scale``), to
   the rule that shares slots within one MPS priority (``fifo`` left-over, ``fair``) and to the
   inference servers' host cost per kernel (``[gpu] host_per_kernel``, W3) across its range: the
   Orion point, the MPS throughput gain of eight ResNet-50 servers (``trtlab-mps-8``) and the
   median p99 inflation of the 14 Tally-shaped pairs (BERT and Transformer-XL inference at load
   0.5 next to each training profile) per baseline;
3. the cost of launch-blocking mode (``CUDA_LAUNCH_BLOCKING=1``) per profile.

    python bench/sim_validation.py [--jobs 2] [--duration 10] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.cli.sim_run import make_policies  # noqa: E402
from gpushare.sim import data, engine, runner, scenario, validation  # noqa: E402
from gpushare.sim import node as simnode  # noqa: E402
from gpushare.sim.gpu import EventLoop, Gpu  # noqa: E402
from gpushare.sim.workloads import (  # noqa: E402
    DEFAULT_HOST_PER_KERNEL_S,
    DEFAULT_LAUNCH_GAP_S,
    OfflineTrainer,
)

PAIR_PREFIXES = ("pairs/bert_2_fwd+", "pairs/transformer_xl_4_fwd+")
BASELINES = ("mps", "mps-priority", "time-slicing")
SETTINGS = (
    ("wave_scale 0.5", {"wave_scale": 0.5}),
    ("default (wave_scale 1, host cost 56 us)", {}),
    ("wave_scale 2", {"wave_scale": 2.0}),
    ("share fair", {"share": "fair"}),
    ("host cost 0 (none)", {"host_per_kernel_s": 0.0}),
    ("host cost 30 us", {"host_per_kernel_s": 30e-6}),
    ("host cost 45 us", {"host_per_kernel_s": 45e-6}),
    ("host cost 70 us", {"host_per_kernel_s": 70e-6}),
)


def pair_inflation(args: tuple[str, dict[str, Any], float]) -> dict[str, float]:
    """p99 over p99 alone of one pair under each baseline, with GPU settings overridden."""
    name, overrides, duration = args
    sc = scenario.load(name)
    gpu = {k: v for k, v in overrides.items() if k != "share"}
    sc = dataclasses.replace(sc, duration_s=duration, gpu=dataclasses.replace(sc.gpu, **gpu))
    share = overrides.get("share", "fifo")
    original = simnode.Gpu
    # The share rule is not a scenario key (fifo is the model); the simulated node builds its
    # GPUs through this name, so a partial sets it for this run (one run per process at a time).
    simnode.Gpu = functools.partial(Gpu, share=share)  # type: ignore[misc]
    try:
        alone, slo = runner.standalone(sc)
        assert alone is not None
        out = {}
        for pname, policy in make_policies(list(BASELINES), sc.config.control):
            res = runner.run_policy(sc, policy, name=pname, slo_ms=slo)
            out[pname] = res.online[0].p99_ms / alone.online[0].p99_ms
        return out
    finally:
        simnode.Gpu = original  # type: ignore[misc]


def orion(overrides: dict[str, Any]) -> dict[str, float]:
    """The Orion point (3 seeds) under the settings."""
    runs = [
        validation.orion_point(
            s,
            share=overrides.get("share", "fifo"),
            wave_scale=overrides.get("wave_scale", 1.0),
            host_per_kernel_s=overrides.get("host_per_kernel_s", DEFAULT_HOST_PER_KERNEL_S),
        )
        for s in (1, 2, 3)
    ]
    return {
        "p50_ms": statistics.fmean(r.p50_ms for r in runs),
        "p99_ms": statistics.fmean(r.p99_ms for r in runs),
        "train_it_s": statistics.fmean(r.train_it_s for r in runs),
    }


def trtlab_mps(overrides: dict[str, Any]) -> float:
    """The model's throughput gain of eight ResNet-50 servers under MPS (``trtlab-mps-8``)."""
    point = validation.load_points()["trtlab-mps-8"]
    prof = data.load_profile(f"{validation.ORION}/resnet50_4_fwd.csv")
    return validation.throughput_gain(
        prof,
        point.clients,
        mode="mps",
        sm_count=point.sms,
        share=overrides.get("share", "fifo"),
        wave_scale=overrides.get("wave_scale", 1.0),
    )


def blocking_costs() -> list[dict[str, Any]]:
    """Run time alone of one pass in launch-blocking mode over asynchronous, per profile."""
    rows = []
    folder = data.package_root() / validation.ORION
    for path in sorted(folder.glob("*_f*.csv")):
        rel = f"{validation.ORION}/{path.name}"
        merge = data.DEFAULT_MERGE_OFFLINE_US if "_fb1" in path.name else data.DEFAULT_MERGE_US
        prof = data.load_profile(rel, merge)
        loop = EventLoop()
        job = OfflineTrainer("j", Gpu(loop, uuid="GPU-b", index=0), prof, sm_pct=100, mem_bytes=0)
        job.launch_blocking = True
        job.start(0.0)
        loop.run_until(prof.total_s * 10)
        rows.append(
            {
                "profile": path.stem,
                "kernels": prof.source_kernels,
                "async_ms": prof.total_s * 1e3,
                "blocking_ms": job.iterations[0] * 1e3,
                "cost": job.iterations[0] / prof.total_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the tables and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0, help="virtual seconds per pair run")
    ap.add_argument("--quick", action="store_true", help="the validation table only")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_validation.json"))
    args = ap.parse_args(argv)
    wall0 = time.perf_counter()
    doc: dict[str, Any] = {
        "command": "python bench/sim_validation.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
    }
    rows = validation.table()
    doc["validation"] = [{**dataclasses.asdict(r), "error": r.error} for r in rows]
    print("| point | role | what | measured | model | error | tolerance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.id} | {r.role} | {r.what} | {r.measured:.3g} | {r.model:.3g} | "
            f"{r.error * 100:+.0f} % | {r.tolerance} |"
        )
    if not args.quick:
        pairs = [n for n in scenario.shipped() if n.startswith(PAIR_PREFIXES)]
        sens = []
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for label, overrides in SETTINGS:
                work = [(n, overrides, args.duration) for n in pairs]
                res = list(pool.map(pair_inflation, work))
                row: dict[str, Any] = {
                    "setting": label,
                    "orion": orion(overrides),
                    "trtlab_mps_gain": trtlab_mps(overrides),
                }
                for b in BASELINES:
                    vals = [r[b] for r in res]
                    row[b] = {"median": statistics.median(vals), "max": max(vals)}
                sens.append(row)
        doc["sensitivity"] = sens
        measured = validation.load_points()["trtlab-mps-8"].ratio
        print(
            f"\n| setting | Orion p50 ms | Orion p99 ms | 8 x ResNet-50 MPS gain ({measured:.2f}"
            " measured) | " + " | ".join(BASELINES) + " |"
        )
        print("|---|---|---|---|" + "---|" * len(BASELINES))
        for row in sens:
            cells = " | ".join(
                f"{row[b]['median']:.2f}x (max {row[b]['max']:.1f}x)" for b in BASELINES
            )
            o = row["orion"]
            print(
                f"| {row['setting']} | {o['p50_ms']:.1f} | {o['p99_ms']:.1f} | "
                f"{row['trtlab_mps_gain']:.2f}x | {cells} |"
            )
        costs = blocking_costs()
        doc["launch_blocking"] = {"gap_s": DEFAULT_LAUNCH_GAP_S, "profiles": costs}
        print(
            f"\n| profile | kernels | async ms | blocking ms ({DEFAULT_LAUNCH_GAP_S * 1e6:.0f} us gap) |"
        )
        print("|---|---|---|---|")
        for c in costs:
            print(
                f"| {c['profile']} | {c['kernels']} | {c['async_ms']:.1f} | "
                f"{c['blocking_ms']:.1f} (x{c['cost']:.2f}) |"
            )
    doc["wall_s"] = time.perf_counter() - wall0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.out} ({doc['wall_s']:.0f} s, engine {doc['engine']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
