"""The SLO frontier (issue 14): SLO attainment and offline throughput per policy at 1.05x-2x.

Runs ``bench/sharing.py`` on every shipped scenario at each SLO factor (or reads the JSON files
such runs wrote, ``--from``), and prints one table: per policy, mean SLO attainment and mean
offline throughput (of running alone) at each factor. Writes bench/results/frontier.json.

    .venv/bin/python bench/frontier.py                      # 4 full runs, tens of minutes
    .venv/bin/python bench/frontier.py --from 1.05=a.json --from 1.1=b.json ...

Numbers are the simulator's (docs/simulator.md): they rank policies on one model. gpushare runs
without request gating here: the simulated node does not model it yet (docs/controller.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FACTORS = (1.05, 1.1, 1.5, 2.0)
RESULTS = ROOT / "bench" / "results" / "frontier.json"


def run(factor: float, out: Path, jobs: int) -> None:
    """One bench/sharing.py run at ``factor``."""
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sharing.py"), "--jobs", str(jobs),
         "--slo-factor", str(factor), "--out", str(out)],
        check=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--from",
        dest="inputs",
        action="append",
        default=[],
        metavar="FACTOR=FILE",
        help="use a sharing.py JSON already written at that SLO factor (repeat)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="passed to bench/sharing.py")
    args = parser.parse_args()
    files: dict[float, Path] = {}
    for item in args.inputs:
        factor, _, path = item.partition("=")
        files[float(factor)] = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix="gpushare-frontier-"))
    for factor in FACTORS:
        if factor not in files:
            files[factor] = tmp / f"sharing-{factor}.json"
            run(factor, files[factor], args.jobs)
    table: dict[str, dict[str, Any]] = {}
    scenarios: dict[str, int] = {}
    for factor in sorted(files):
        data = json.loads(files[factor].read_text())
        for row in data["summary"]:
            cell = table.setdefault(row["policy"], {})
            cell[f"{factor:g}"] = {
                "slo_attainment_mean": row["slo_attainment_mean"],
                "offline_norm_mean": row["offline_norm_mean"],
                "p99_overhead_worst": row["p99_overhead_worst"],
            }
            scenarios[f"{factor:g}"] = row["scenarios"]
    factors = [f"{f:g}" for f in sorted(files)]
    print("| policy | " + " | ".join(f"{f}x: SLO attained, offline" for f in factors) + " |")
    print("|---|" + "---|" * len(factors))
    for policy, cells in table.items():
        parts = []
        for f in factors:
            c = cells.get(f)
            if c is None or c["slo_attainment_mean"] is None:
                parts.append("-")
                continue
            offline = c["offline_norm_mean"]
            off = "-" if offline is None else f"{offline:.2f}"
            parts.append(f"{c['slo_attainment_mean'] * 100:.2f} %, {off}")
        print(f"| {policy} | " + " | ".join(parts) + " |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"scenarios": scenarios, "policies": table}, indent=2) + "\n", encoding="utf-8"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
