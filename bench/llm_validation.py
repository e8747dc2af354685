"""The LLM iteration model against published measurements: every point, measured and modelled.

Fits the model's three constants on the calibration points (LMDeploy, Llama-2-7B FP16, one
A100-80G), checks the fit equals the shipped ``DEFAULT_EFFICIENCY``, and prints every point,
calibration and validation (TensorRT-LLM v0.6.1 on an A100 and on an H100 in FP8), with its
error; writes the same as JSON (``bench/results/llm_validation.json``).

    python bench/llm_validation.py [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.sim import llm_validation as v  # noqa: E402
from gpushare.sim.llm_cost import DEFAULT_EFFICIENCY  # noqa: E402

UNITS = {"throughput_tok_s": "out tok/s", "ttft_ms": "TTFT ms", "tpot_ms": "TPOT ms"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/llm_validation.json")
    args = ap.parse_args()
    eff = v.fit()
    print(f"fitted: {eff}  (shipped: {DEFAULT_EFFICIENCY}, same: {eff == DEFAULT_EFFICIENCY})")
    rows = v.evaluate(eff)
    print("| role | setup | metric | batch | prompt | output | measured | model | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r.point
        print(
            f"| {p.role} | {p.setup} | {UNITS[p.metric]} | {p.batch} | {p.prompt} | {p.output} "
            f"| {p.measured:g} | {r.model:.4g} | {r.error:+.1%} |"
        )
    summary = {}
    for role in ("calibration", "validation"):
        for setup in sorted({r.point.setup for r in rows if r.point.role == role}):
            errs = [abs(r.error) for r in rows if r.point.role == role and r.point.setup == setup]
            key = f"{role}: {setup}"
            summary[key] = {
                "points": len(errs),
                "median_abs_error": statistics.median(errs),
                "max_abs_error": max(errs),
            }
            print(
                f"{key}: {len(errs)} points, median |error| {statistics.median(errs):.1%}, "
                f"max {max(errs):.1%}"
            )
    out = {
        "fitted": dataclasses.asdict(eff),
        "shipped": dataclasses.asdict(DEFAULT_EFFICIENCY),
        "points": [
            {**dataclasses.asdict(r.point), "model": r.model, "error": r.error} for r in rows
        ],
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
