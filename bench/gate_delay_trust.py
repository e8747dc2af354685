"""The gate delay's trust span (`[control] gate_delay_trust`) against run length, on the pairs.

The gate delay (docs/controller.md, "Gate delay") lets offline work run beside the first part of
each busy spell of requests, within the room the SLO leaves over the latency tail seen so far.
The room counts in full only once the tail has been known for ``gate_delay_trust`` (60 s): latency
seen in a calm start cannot tell a calm spell from a loose SLO. The shipped scenarios last 20-40 s,
so on them the room rule has little time to act; a loose SLO measured on the mean gated latency
(``gate_delay_loose_below``, docs/controller.md "A loose SLO") is trusted at once. This runs the
14 Tally-shaped pairs under gpushare with the delay off (``gate_delay_max = 0s``), with the room
rule alone (``gate_delay_loose_below = 0``) at the default trust span and with none
(``gate_delay_trust = 0s``), and with the defaults, at run lengths of 20 s (as shipped) and
longer, and prints mean SLO
attainment, mean p99 overhead and mean offline throughput per cell. Writes
bench/results/gate_delay_trust.json.

    .venv/bin/python bench/gate_delay_trust.py [--slo-factor 1.1 1.5 2] [--duration 20 120]

Numbers are the simulator's (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from frontier import pair_cell, pair_files  # noqa: E402

from gpushare import logs  # noqa: E402
from gpushare.control.registry import make_policy  # noqa: E402
from gpushare.sim import report, runner, scenario  # noqa: E402

#: name -> [control] overrides.
VARIANTS: dict[str, dict[str, float]] = {
    "delay off": {"gate_delay_max_s": 0.0},
    "room rule only (loose off), trust 60 s": {"gate_delay_loose_below": 0.0},
    "room rule only (loose off), trust 0 s": {
        "gate_delay_loose_below": 0.0,
        "gate_delay_trust_s": 0.0,
    },
    "default (loose below 0.75, trust 60 s)": {},
}


def one(path: str, factor: float, duration_s: float, control: dict[str, float]) -> dict[str, Any]:
    """gpushare on one pair at one SLO factor and length, with ``control`` overrides."""
    sc = scenario.load(Path(path))
    online = tuple(dataclasses.replace(o, slo_factor=factor) for o in sc.online)
    ctl = dataclasses.replace(sc.config.control, **control)
    sc = dataclasses.replace(
        sc,
        online=online,
        duration_s=duration_s,
        warmup_s=min(sc.warmup_s, duration_s / 4),
        config=dataclasses.replace(sc.config, control=ctl),
    )
    alone, slo = runner.standalone(sc)
    run = runner.run_policy(sc, make_policy("gpushare", ctl), name="gpushare", slo_ms=slo)
    (row,) = report.summarise(runner.ScenarioResult(sc, alone, slo, [run]))
    return row.as_dict()


def main() -> None:
    """Run every cell, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slo-factor", type=float, nargs="+", default=[1.1, 1.5, 2.0])
    ap.add_argument("--duration", type=float, nargs="+", default=[20.0, 120.0], help="seconds")
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "gate_delay_trust.json"
    )
    args = ap.parse_args()
    if any(f < 1.0 for f in args.slo_factor):
        ap.error("--slo-factor: each must be >= 1 (an SLO under the p99 alone)")
    if any(d < 5.0 for d in args.duration):
        ap.error("--duration: each must be >= 5 seconds (the delay needs 5 s of app latency)")
    logs.configure_logging("warning")
    files = pair_files()
    t0 = time.perf_counter()
    rows = []
    print("| run length | variant | " + " | ".join(f"{f:g}x" for f in args.slo_factor) + " |")
    print("|---|---|" + "---|" * len(args.slo_factor))
    for duration in args.duration:
        for name, control in VARIANTS.items():
            cells = []
            for factor in args.slo_factor:
                runs = [one(f, factor, duration, control) for f in files]
                cell = pair_cell(
                    runs, duration_s=duration, variant=name, control=control, slo_factor=factor
                )
                rows.append(cell)
                cells.append(
                    f"{cell['slo_attainment_mean'] * 100:.2f} % (min "
                    f"{cell['slo_attainment_min'] * 100:.2f}), "
                    f"{cell['p99_overhead_mean'] * 100:+.1f} %, {cell['offline_norm_mean']:.3f}"
                )
            print(f"| {duration:g} s | {name} | " + " | ".join(cells) + " |", flush=True)
    command = "python bench/gate_delay_trust.py " + " ".join(sys.argv[1:])
    doc = {"command": command.strip(), "wall_s": time.perf_counter() - t0, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
