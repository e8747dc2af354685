"""An LLM step on a fraction of the SMs: G7 and the saturating law against MuxServe's points.

Fits the saturating law's ``s_sat`` on the calibration points (decode, batches 1 and 32), checks
it equals the shipped ``FITTED_S_SAT``, and prints every point (LLaMA-7B on one A100-80GB under an
MPS active-thread percentage; step time over the time on every SM), measured, under G7 and under
the law, with their errors; writes the same as JSON (``bench/results/llm_smshare.json``).

    python bench/llm_smshare.py [--out FILE]
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

from gpushare.sim import llm_smshare as s  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/llm_smshare.json")
    args = ap.parse_args()
    sat = s.fit()
    print(f"fitted s_sat: {sat} (shipped: {s.FITTED_S_SAT}, same: {sat == s.FITTED_S_SAT})")
    rows = s.evaluate(sat)
    print("| role | phase | batch | seq | SMs % | measured | G7 | error | law | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r.point
        print(
            f"| {p.role} | {p.phase} | {p.batch} | {p.seq} | {p.sm_pct} | {p.measured:.3f} "
            f"| {r.g7:.3f} | {r.g7_error:+.1%} | {r.saturating:.3f} | {r.error:+.1%} |"
        )
    summary = {}
    for role, phase in (
        ("calibration", "decode"),
        ("validation", "decode"),
        ("validation", "prefill"),
    ):
        sel = [r for r in rows if r.point.role == role and r.point.phase == phase]
        law = [abs(r.error) for r in sel]
        g7 = [abs(r.g7_error) for r in sel]
        summary[f"{role}: {phase}"] = {
            "points": len(sel),
            "median_abs_error": statistics.median(law),
            "max_abs_error": max(law),
            "g7_median_abs_error": statistics.median(g7),
            "g7_max_abs_error": max(g7),
        }
        print(
            f"{role} {phase}: {len(sel)} points, law median |error| {statistics.median(law):.1%} "
            f"(max {max(law):.1%}); G7 {statistics.median(g7):.1%} (max {max(g7):.1%})"
        )
    out = {
        "source": s.SOURCE,
        "fitted_s_sat": sat,
        "points": [
            {
                **dataclasses.asdict(r.point),
                "g7": r.g7,
                "g7_error": r.g7_error,
                "law": r.saturating,
                "error": r.error,
            }
            for r in rows
        ],  # fmt: skip
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
