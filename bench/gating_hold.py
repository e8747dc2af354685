"""Request gating's hold time on the simulator: the trade-off curve (issue 14).

Runs gpushare (request gating on, offline clients ``--queue auto``, so shallow) on the
Tally-shaped pairs for each ``[gate] hold`` at each SLO factor, and prints mean SLO attainment,
mean p99 overhead and mean offline throughput (of running alone) per hold, with the daemon's
default shallow queue (``[gate] shallow_queue``: bounded, 4 kernels in flight); with
``--launch-gap-us`` the same with blocking shallow queues (``CUDA_LAUNCH_BLOCKING=1``) at each
launch gap (the model's W3 constant, a sensitivity, not a tunable; the gap does not apply to a
bounded queue, bench/inflight_bound.py sweeps that one). Writes bench/results/gating_hold.json.

    .venv/bin/python bench/gating_hold.py                  # ~2 min on 2 busy cores

The hold is picked by a rule stated before looking (docs/benchmarks.md): the longest hold whose
mean offline throughput is within 5 % of the best at every factor, among those whose attainment
is the best within 0.05 percentage points (a longer hold saves a thaw and a freeze between
requests that come close together, which matters more on hardware than the model charges).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.control.registry import make_policy  # noqa: E402
from gpushare.sim import report, runner, scenario  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from frontier import pair_cell, pair_files  # noqa: E402

HOLDS_MS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
FACTORS = (1.05, 1.1, 1.5, 2.0)


def one(path: str, factor: float, hold_s: float, gap_s: float | None) -> dict[str, Any]:
    """gpushare on one scenario with the given hold (and launch gap)."""
    sc = scenario.load(Path(path))
    online = tuple(dataclasses.replace(o, slo_factor=factor) for o in sc.online)
    gate = dataclasses.replace(sc.config.gate, hold_s=hold_s)
    sc = dataclasses.replace(sc, online=online, config=dataclasses.replace(sc.config, gate=gate))
    if gap_s is not None:  # the gap is blocking mode's: sweep it with blocking shallow queues
        gate = dataclasses.replace(gate, shallow_queue="blocking")
        sc = dataclasses.replace(sc, config=dataclasses.replace(sc.config, gate=gate))
        sc = dataclasses.replace(sc, gpu=dataclasses.replace(sc.gpu, launch_gap_s=gap_s))
    alone, slo = runner.standalone(sc)
    run = runner.run_policy(
        sc, make_policy("gpushare", sc.config.control), name="gpushare", slo_ms=slo
    )
    (row,) = report.summarise(runner.ScenarioResult(sc, alone, slo, [run]))
    return row.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-ms", type=float, action="append", help="holds to try (repeat)")
    ap.add_argument("--launch-gap-us", type=float, action="append", help="launch gaps (repeat)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gating_hold.json")
    args = ap.parse_args()
    logs.configure_logging("warning")
    holds = args.hold_ms or list(HOLDS_MS)
    gaps: list[float | None] = (
        [g * 1e-6 for g in args.launch_gap_us] if args.launch_gap_us else [None]
    )
    files = pair_files()
    t0 = time.perf_counter()
    rows = []
    print(
        "| launch gap | hold | "
        + " | ".join(f"{f:g}x: SLO attained, p99 ovh, offline" for f in FACTORS)
        + " |"
    )
    print("|---|---|" + "---|" * len(FACTORS))
    for gap in gaps:
        for hold in holds:
            cells = []
            for factor in FACTORS:
                runs = [one(f, factor, hold * 1e-3, gap) for f in files]
                cell = pair_cell(
                    runs,
                    launch_gap_us=None if gap is None else gap * 1e6,
                    hold_ms=hold,
                    slo_factor=factor,
                )
                rows.append(cell)
                cells.append(
                    f"{cell['slo_attainment_mean'] * 100:.2f} %, "
                    f"{cell['p99_overhead_mean'] * 100:+.1f} %, {cell['offline_norm_mean']:.3f}"
                )
            gap_text = "bounded (default)" if gap is None else f"blocking, {gap * 1e6:g} us"
            print(f"| {gap_text} | {hold:g} ms | " + " | ".join(cells) + " |", flush=True)
    command = "python bench/gating_hold.py " + " ".join(sys.argv[1:])
    doc = {"command": command.strip(), "wall_s": time.perf_counter() - t0, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
