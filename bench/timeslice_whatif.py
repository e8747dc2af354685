"""What-if: two other time-slicing rules for a context that runs out of work (issue 33 item 4).

**Not the model.** G9 (docs/simulator.md) follows NVIDIA's host manual: a context (TSG) with no
kernel running or issued gives the GPU up at once, and every switch costs ``switch_s`` (112 us,
calibrated on saturated contexts, where every switch preempts a running kernel). This bench
patches, in its own process only, the two alternatives issue 33 asks about and measures the
time-slicing baseline on the pairs (host-bound and GPU-bound) under each:

* ``keep-slice``: a context whose queue empties keeps the GPU to the end of its slice (nobody runs
  meanwhile; its new kernels run at once), as a scheduler that only switches on the timeslice
  would;
* ``free-yield``: a context that runs out of work gives the GPU up at once, and that switch costs
  nothing (nothing is running, so nothing is saved: the lower bound of a wait-for-idle switch;
  NVIDIA's DRIVE OS scheduling guide says only that it is "minimal").

It forces the Python engine (``GPUSHARE_SIM_ENGINE=python``): the patch replaces the dispatcher's
``slice_owner``.

    python bench/timeslice_whatif.py --jobs 1 --duration 20

Writes ``bench/results/timeslice_whatif.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Chosen when gpushare.sim is first imported, so before the imports below.
os.environ["GPUSHARE_SIM_ENGINE"] = "python"

from sim_pairs import SETS, VARIANTS, summarise  # noqa: E402

from gpushare import logs  # noqa: E402
from gpushare.sim import baseline_check, dispatch, engine, scenario, timeslice  # noqa: E402
from gpushare.sim.gpu import Gpu, Stream  # noqa: E402

RULES = ("model", "keep-slice", "free-yield")
MODEL_OWNER = timeslice.slice_owner


def _has_work(s: Stream) -> bool:
    return s.run is not None or s.nxt is not None


def keep_slice_owner(gpu: Gpu, now: float) -> Stream | None:
    """G9, except that an idle owner keeps the GPU until its slice ends."""
    st = gpu.slicing
    active = st.active
    if (
        now >= st.switch_until_s
        and active is not None
        and active in gpu.streams
        and not _has_work(active)
        and now - st.active_since_s < gpu.slice_s - 1e-12
        and any(_has_work(s) for s in gpu.streams if s is not active)
    ):
        timeslice._arm_slice_timer(gpu, st.active_since_s + gpu.slice_s)
        return None
    return MODEL_OWNER(gpu, now)


def free_yield_owner(gpu: Gpu, now: float) -> Stream | None:
    """G9, except that switching away from an owner with no work costs nothing."""
    st = gpu.slicing
    active = st.active
    idle = (
        now >= st.switch_until_s
        and active is not None
        and active in gpu.streams
        and not _has_work(active)
    )
    if not idle:
        return MODEL_OWNER(gpu, now)
    cost, gpu.switch_s = gpu.switch_s, 0.0
    try:
        return MODEL_OWNER(gpu, now)
    finally:
        gpu.switch_s = cost


OWNERS = {"model": MODEL_OWNER, "keep-slice": keep_slice_owner, "free-yield": free_yield_owner}


def run_pair(args: tuple[str, str, float]) -> list[dict[str, Any]]:
    """The time-slicing baseline's ratios on one pair under one rule."""
    name, rule, duration = args
    dispatch.slice_owner = OWNERS[rule]  # type: ignore[assignment]
    try:
        ratios = baseline_check.pair_ratios(
            scenario.load(name), ("time-slicing",), duration_s=duration
        )
    finally:
        dispatch.slice_owner = MODEL_OWNER
    return [dataclasses.asdict(r) | {"scenario": name, "rule": rule} for r in ratios]


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "timeslice_whatif.json"))
    args = ap.parse_args(argv)
    logs.configure_logging("warning")
    widest = SETS["21 with ResNet-50"]
    names = [
        n
        for n in scenario.shipped()
        if n.startswith(tuple(f + p for f in VARIANTS.values() for p in widest))
    ]
    wall0 = time.perf_counter()
    doc: dict[str, Any] = {
        "command": "python bench/timeslice_whatif.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
        "duration_s": args.duration,
        "rules": {},
    }
    print("| rule | variant | pairs | latency, median (max) | service, median (max) |")
    print("|---|---|---|---|---|")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for rule in RULES:
            work = [(n, rule, args.duration) for n in names]
            rows = [r for rs in pool.map(run_pair, work) for r in rs]
            doc["rules"][rule] = {"pairs": rows, "checks": []}
            for variant, folder in VARIANTS.items():
                for label, prefixes in SETS.items():
                    by = {c.metric: c for c in summarise(rows, folder, prefixes)}
                    doc["rules"][rule]["checks"].extend(
                        dataclasses.asdict(c) | {"variant": variant, "set": label}
                        for c in by.values()
                    )
                    lat, srv = by["latency"], by["service"]
                    print(
                        f"| {rule} | {variant} | {label} | {lat.median_ratio:.2f}x "
                        f"({lat.worst_ratio:.1f}x) | {srv.median_ratio:.2f}x "
                        f"({srv.worst_ratio:.1f}x) |",
                        flush=True,
                    )
    doc["wall_s"] = time.perf_counter() - wall0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s, engine {doc['engine']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
