"""The SLO frontier (issue 14): SLO attainment and offline throughput per policy at 1.05x-2x.

Runs ``bench/sharing.py`` at each SLO factor twice: every policy with the online services sending
request boundaries (gpushare then gates offline work on them, docs/simulator.md "Request
gating"), and gpushare alone without them (``--no-gating``: its row "gpushare (no gating)").
The baselines never gate, so boundaries change nothing for them. Prints one table, per policy
mean SLO attainment and mean offline throughput (of running alone) at each factor, and writes
bench/results/frontier.json (``--pairs``: the Tally-shaped pairs only, frontier_pairs.json;
``--pairs --gpu-bound``: their GPU-bound variants, scenarios/gpubound/, frontier_pairs_gpubound.json).

    .venv/bin/python bench/frontier.py                      # every shipped scenario
    .venv/bin/python bench/frontier.py --pairs              # the Tally-shaped pairs
    .venv/bin/python bench/frontier.py --pairs --gpu-bound  # the same with 5 us host cost
    .venv/bin/python bench/frontier.py --from 1.1=a.json --from 1.1:nogating=b.json ...

Numbers are the simulator's (docs/simulator.md): they rank policies on one model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FACTORS = (1.05, 1.1, 1.5, 2.0)
RESULTS = ROOT / "bench" / "results"
#: The Tally-shaped pairs: BERT b2 or Transformer-XL b4 inference at load 0.5 next to one
#: training job (as bench/sim_validation.py selects them).
PAIR_PREFIXES = ("bert_2_fwd+", "transformer_xl_4_fwd+")
NO_GATING = "gpushare (no gating)"


def pair_files(folder: str = "pairs") -> list[str]:
    """The Tally-shaped pair scenarios (``gpubound``: their GPU-bound variants, issue 33)."""
    pairs = sorted((ROOT / "gpushare" / "scenarios" / folder).glob("*.toml"))
    return [str(p) for p in pairs if p.name.startswith(PAIR_PREFIXES)]


def pair_cell(runs: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
    """One cell of a sweep over the pairs: ``keys`` plus the means (and the worst attainment)
    of the ``bench/sharing.py``-style rows ``runs`` (bench/gating_hold.py and its kin)."""
    return {
        **keys,
        "slo_attainment_mean": statistics.fmean(r["slo_attainment"] for r in runs),
        "slo_attainment_min": min(r["slo_attainment"] for r in runs),
        "p99_overhead_mean": statistics.fmean(r["p99_overhead"] for r in runs),
        "offline_norm_mean": statistics.fmean(r["offline_norm"] for r in runs),
        "scenarios": len(runs),
    }


def run(factor: float, out: Path, jobs: int, extra: list[str]) -> None:
    """One bench/sharing.py run at ``factor``."""
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sharing.py"), "--jobs", str(jobs),
         "--slo-factor", str(factor), "--out", str(out), *extra],
        check=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--from",
        dest="inputs",
        action="append",
        default=[],
        metavar="FACTOR[:nogating]=FILE",
        help="use a sharing.py JSON already written at that SLO factor (repeat)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="passed to bench/sharing.py")
    parser.add_argument("--pairs", action="store_true", help="the Tally-shaped pairs only")
    parser.add_argument(
        "--gpu-bound",
        action="store_true",
        help="with --pairs: their GPU-bound variants (5 us of CPU per kernel, scenarios/gpubound/)",
    )
    args = parser.parse_args()
    files: dict[tuple[float, bool], Path] = {}
    for item in args.inputs:
        key, _, path = item.partition("=")
        factor, _, kind = key.partition(":")
        files[(float(factor), kind == "nogating")] = Path(path)
    if args.gpu_bound and not args.pairs:
        parser.error("--gpu-bound goes with --pairs")
    scenarios = pair_files("gpubound" if args.gpu_bound else "pairs") if args.pairs else []
    tmp = Path(tempfile.mkdtemp(prefix="gpushare-frontier-"))
    for factor in FACTORS:
        for nogating in (False, True):
            if (factor, nogating) in files:
                continue
            out = tmp / f"sharing-{factor}{'-nogating' if nogating else ''}.json"
            extra = ["--policy", "gpushare", "--no-gating"] if nogating else []
            run(factor, out, args.jobs, extra + scenarios)
            files[(factor, nogating)] = out
    table: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    for (factor, nogating), path in sorted(files.items()):
        data = json.loads(path.read_text())
        for row in data["summary"]:
            policy = row["policy"]
            if nogating:
                if policy != "gpushare":
                    continue
                policy = NO_GATING
            cell = table.setdefault(policy, {})
            cell[f"{factor:g}"] = {
                "slo_attainment_mean": row["slo_attainment_mean"],
                "offline_norm_mean": row["offline_norm_mean"],
                "p99_overhead_mean": row["p99_overhead_mean"],
                "p99_overhead_worst": row["p99_overhead_worst"],
            }
            counts[f"{factor:g}"] = row["scenarios"]
    order = [NO_GATING, *(p for p in table if p != NO_GATING)]
    factors = sorted({f for f, _ in files})
    names = [f"{f:g}" for f in factors]
    print("| policy | " + " | ".join(f"{f}x: SLO attained, offline" for f in names) + " |")
    print("|---|" + "---|" * len(names))
    for policy in order:
        cells = table.get(policy, {})
        parts = []
        for f in names:
            c = cells.get(f)
            if c is None or c["slo_attainment_mean"] is None:
                parts.append("-")
                continue
            offline = c["offline_norm_mean"]
            off = "-" if offline is None else f"{offline:.2f}"
            parts.append(f"{c['slo_attainment_mean'] * 100:.2f} %, {off}")
        print(f"| {policy} | " + " | ".join(parts) + " |")
    out = RESULTS / (
        ("frontier_pairs_gpubound.json" if args.gpu_bound else "frontier_pairs.json")
        if args.pairs
        else "frontier.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/frontier.py " + " ".join(sys.argv[1:])
    doc = {"command": command.strip(), "scenarios": counts, "policies": table}
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
