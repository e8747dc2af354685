"""How exact a p99 read from an LLM server's own latency histograms is, for the simulated server.

vLLM, SGLang and TGI export TTFT and time per output token as Prometheus histograms with fixed
buckets: vLLM's ``vllm/v1/metrics/loggers.py`` at vllm-project/vllm commit
005a810bc40faa25b8870fbc8559c3462581eee3 (``vllm:time_to_first_token_seconds``,
``vllm:time_per_output_token_seconds``); SGLang's ``python/sglang/srt/metrics/collector.py`` at
sgl-project/sglang commit 93d04878cfb9b08645fae7b11bd340ee33b34acf
(``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``); TGI's
``router/src/server.rs`` at huggingface/text-generation-inference commit
db931fcf42da018a3657580c64bf2720f167f9ab (no TTFT histogram;
``tgi_request_mean_time_per_token_duration``, bounds 0.0001 * 1.5**k for k = 1..35, one value per
request that includes the prefill, so the simulated TPOTs only show its buckets' resolution).
gpushare's ``--latency-from vllm:URL`` (``sglang:``, ``tgi:``)
computes a windowed p99 from bucket deltas, interpolating linearly inside the bucket the rank
falls in, as PromQL's ``histogram_quantile`` does (``gpushare.latency.prometheus.bucket_quantile``).
This bench puts the server's TTFTs and TPOTs alone (30, 50 and 70 % load, 600 s) into those
buckets and prints the exact p99, the histogram's, the bucket holding it and the SLOs at 1.1x,
1.5x and 2x, and how much of the time the server alone keeps the GPU busy; writes ``bench/results/llm_histograms.json``.

    python bench/llm_histograms.py [--duration 600]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.latency.prometheus import bucket_quantile  # noqa: E402
from gpushare.sim import llm_pairs  # noqa: E402

INF = math.inf
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, INF)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, INF)  # fmt: skip
SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, INF)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
              0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0, INF)  # fmt: skip
TGI_TPOT = (*(0.0001 * 1.5**k for k in range(1, 36)), INF)
#: server -> (TTFT buckets or None where it exports no TTFT histogram, TPOT buckets)
SERVERS: dict[str, tuple[tuple[float, ...] | None, tuple[float, ...]]] = {
    "vLLM": (TTFT_BUCKETS, TPOT_BUCKETS),
    "SGLang": (SGLANG_TTFT, SGLANG_ITL),
    "TGI": (None, TGI_TPOT),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/llm_histograms.json")
    args = ap.parse_args()
    rows = []
    busy: dict[float, float] = {}
    print(
        "| load | server | metric | requests | exact p99 ms | histogram p99 ms | error"
        " | bucket ms | SLO 1.1x / 1.5x / 2x ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for load in (0.3, 0.5, 0.7):
        alone = llm_pairs.run_pair("exclusive", None, load, duration_s=args.duration)
        busy[load] = alone.server_busy_frac
        for server, (ttft_bounds, tpot_bounds) in SERVERS.items():
            for name, vals, bounds in (
                ("TTFT", alone.ttft_s, ttft_bounds),
                ("TPOT", alone.tpot_s, tpot_bounds),
            ):
                if bounds is not None:
                    rows.append(_row(load, server, name, vals, bounds))
    for load, frac in busy.items():
        print(
            f"load {load:.0%}: the server alone has an iteration on the GPU {frac:.1%} of the time"
        )
    out = {"duration_s": args.duration, "rows": rows, "server_busy_frac": busy}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


def _row(
    load: float, server: str, name: str, vals: tuple[float, ...], bounds: tuple[float, ...]
) -> dict[str, object]:
    exact = llm_pairs.p99(vals)
    hist = bucket_quantile(0.99, {b: float(sum(1 for v in vals if v <= b)) for b in bounds})
    assert hist is not None
    lo = max((b for b in bounds if b < exact), default=0.0)
    hi = min(b for b in bounds if b >= exact)
    print(
        f"| {load:.0%} | {server} | {name} | {len(vals)} | {exact * 1e3:.1f} | {hist * 1e3:.1f} "
        f"| {hist / exact - 1:+.1%} | ({lo * 1e3:.4g}, {hi * 1e3:.4g}] "
        f"| {1.1 * exact * 1e3:.1f} / {1.5 * exact * 1e3:.1f} / {2 * exact * 1e3:.1f} |"
    )
    return {"load": load, "server": server, "metric": name, "requests": len(vals),
            "exact_s": exact, "histogram_s": hist, "bucket_s": [lo, hi]}  # fmt: skip


if __name__ == "__main__":
    main()
