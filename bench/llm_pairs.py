"""An LLM server next to training jobs: TTFT/TPOT attainment and offline throughput per setup.

For each load (30, 50, 70 % of the server's capacity alone) and each shipped training job, runs
the server (Llama-2-7B on a simulated V100-32GB, the Azure conversation trace) under gpushare
and every baseline of the policy registry that the LLM server supports, each driven by the
daemon's own loop (``gpushare.sim.llm_daemon``), and under the levers of
``gpushare.sim.llm_pairs`` (an SM cap on the trainer, a fixed duty cycle), and scores it at SLO factors 1.1, 1.5 and 2 (x the p99 TTFT
and p99 TPOT of the server alone at that load): the fraction of requests inside both SLOs, the
p99s, the trainer's throughput over its throughput alone, and the run's speed (virtual seconds
per CPU second). Prints a table per factor; writes JSON (``bench/results/llm_pairs.json``).
``--trainer-after S`` submits the training job after the server has served alone for S seconds
(the daemon-driven setups, and ``exclusive-policy`` to score exclusive use over the same window):
a server already running when the job comes, as on a host whose servers run for days.

    python bench/llm_pairs.py [--jobs 2] [--duration 600] [--quick] [--trainer-after S]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.logs import configure_logging  # noqa: E402
from gpushare.sim import engine, llm_daemon, llm_pairs  # noqa: E402
from gpushare.sim.llm import LlmServerConfig  # noqa: E402

LOADS = (0.3, 0.5, 0.7)
FACTORS = (1.1, 1.5, 2.0)
#: Registry policies run through the daemon's loop. ``tally-like`` is left out: its kernel
#: preemption routes a server's kernels through the Tally scheduler, which the LLM server does
#: not use.
POLICIES = ("gpushare", "mps", "mps-priority", "time-slicing", "static-split", "tgs")
#: gpushare with its starting offline SM share at 100 % instead of 50 % (``[control]
#: offline_sm_pct_default``).
SHARE100 = "gpushare-share100"
#: ... and with the TPOT window sized like the TTFT's (the last 200 within 120 s).
LLM = "gpushare-llm"
CONTROLS = {
    SHARE100: "[control]\noffline_sm_pct_default = 100.0\n",
    LLM: '[control]\noffline_sm_pct_default = 100.0\n[latency]\ntpot_window = "120s"\n'
    "tpot_max_samples = 200\n",
}
#: ... and with the server reporting, at each further token, its sequence's mean TPOT so far
#: (the per-request TPOT the SLO is scored on, known at every token, without the completion lag).
RUNNING = "gpushare-running"
CONTROLS[RUNNING] = CONTROLS[SHARE100] + '[latency]\ntpot_window = "10s"\n'  # as measured
#: ... and ``gpushare-llm`` with the server submitted at N % of the SMs (``submit --online --sm
#: N``, N in 75, 80, 85): the trainer always has the other 100 - N % (``psrvcap-N`` under the
#: daemon). The server's SM percentage per setup (default 100):
SERVER_SM = {f"{LLM}-sm{n}": float(n) for n in (75, 80, 85)}
#: gpushare's defaults with the server reporting one TPOT per token (the inter-token gap, whose p99
#: jumps with any stall of the batch) instead of one per request (its mean, the TPOT the SLO is
#: scored on): the default before issue 33's per-request TPOT.
TOKEN = "gpushare-token"
CONTROLS[TOKEN] = '[latency]\ntpot_window = "10s"\n'  # the default with per-token reports
#: How each setup's server reports TPOT to the daemon (default: once per request, its mean).
TPOT_REPORT = {RUNNING: "running", TOKEN: "token"}
for _name in SERVER_SM:
    CONTROLS[_name] = CONTROLS[LLM]
#: ... gpushare-token, with the TPOT SLO the daemon is given set on the inter-token gaps'
#: p99 alone instead of the per-request means' (``llm_daemon.tpot_slo_s``).
ITL = llm_daemon.ITL_SETUP
CONTROLS[ITL] = CONTROLS[TOKEN]
TPOT_REPORT[ITL] = "token"
#: ... gpushare's defaults with offline clients launched at the online clients' MPS priority
#: (``[control] offline_mps_priority = 0``) instead of below it.
PRIO0 = "gpushare-prio0"
CONTROLS[PRIO0] = "[control]\noffline_mps_priority = 0\n"
#: ... gpushare's defaults without the offline priority chosen per GPU (``[control]
#: equal_priority_below = 0``): offline launches always below online clients, the default before.
PRIO1 = "gpushare-prio1"
CONTROLS[PRIO1] = "[control]\nequal_priority_below = 0.0\n"
#: Levers run directly on the model (``llm_pairs``): not policies of the registry.
LEVERS = (
    "cap-50", "duty-50", "mpsduty-30", "mpsduty-50", "srvcap-70", "psrvcap-70", "psrvcap-75",
    "psrvcap-80", "psrvcap-85", "psrvcap-90",
)  # fmt: skip

Work = tuple[str, str | None, float, float, float, float, float, float]
#: The registry's ``exclusive`` policy through the daemon's loop (the trainer waits, frozen, while
#: the server is live): exclusive use scored over the same window as the daemon-driven setups
#: when the trainer joins late (``--trainer-after``); the base row ``exclusive`` is the server
#: run alone from 0, which the SLOs are set on.
EXCLUSIVE_POLICY = "exclusive-policy"


def one(args: Work) -> tuple[llm_pairs.PairResult, float]:
    """One run and its speed (virtual s per CPU s)."""
    setup, trainer, load, duration, slo_ttft_s, slo_tpot_s, s_sat, after = args
    cfg = LlmServerConfig(s_sat=s_sat)
    configure_logging("error", json=False)
    t0 = time.process_time()
    if setup in POLICIES or setup in CONTROLS or setup == EXCLUSIVE_POLICY:
        assert trainer is not None
        policy = "exclusive" if setup == EXCLUSIVE_POLICY else setup
        res = llm_daemon.run_policy(
            "gpushare" if setup in CONTROLS else policy, trainer, load, slo_ttft_s=slo_ttft_s,
            slo_tpot_s=slo_tpot_s, duration_s=duration, control=CONTROLS.get(setup, ""), config=cfg,
            tpot_report=TPOT_REPORT.get(setup, "request"), server_sm_pct=SERVER_SM.get(setup, 100.0),
            trainer_after_s=after,
        )  # fmt: skip
        res = dataclasses.replace(res, setup=setup)
    else:
        res = llm_pairs.run_pair(setup, trainer, load, duration_s=duration, config=cfg)
    return res, duration / max(1e-9, time.process_time() - t0)


def _rows(
    res: llm_pairs.PairResult, speed: float, base: llm_pairs.PairResult
) -> list[dict[str, Any]]:
    """A run scored at every factor against the server alone at its load."""
    rows = []
    for factor in FACTORS:
        o = llm_pairs.score(res, base, factor)
        rows.append(
            {
                "setup": res.setup,
                "trainer": res.trainer.rsplit("/", 1)[-1].removesuffix(".csv"),
                "load": res.load,
                "slo_factor": factor,
                "requests": len(res.timings),
                "attainment": o.attainment,
                "ttft_p99_ms": o.ttft_p99_ms,
                "tpot_p99_ms": o.tpot_p99_ms,
                "slo_ttft_ms": factor * llm_pairs.p99(base.ttft_s) * 1e3,
                "slo_tpot_ms": factor * llm_pairs.p99(base.tpot_s) * 1e3,
                # The inter-token gaps' p99 (exclusive runs only): gpushare-itl's TPOT SLO basis.
                "itl_p99_ms": llm_pairs.p99(res.itl_s) * 1e3 if res.itl_s else None,
                "offline_norm": o.offline_norm,
                "preemptions": res.preemptions,
                "trainer_priority": res.trainer_priority,
                "speed_factor": speed,
            }
        )
    return rows


def _print_tables(rows: list[dict[str, Any]], loads: tuple[float, ...], setups: list[str]) -> None:
    """One table per factor: attainment (min), p99s and offline throughput, mean over trainers."""
    for factor in FACTORS:
        print(f"\nSLO {factor}x (p99 TTFT and TPOT alone); mean over trainers")
        print("| load | setup | attainment (min) | TTFT p99 ms | TPOT p99 ms | offline |")
        print("|---|---|---|---|---|---|")
        for load in sorted(loads):
            for setup in ["exclusive", *setups]:
                sel = [
                    r
                    for r in rows
                    if r["slo_factor"] == factor and r["load"] == load and r["setup"] == setup
                ]
                if not sel:
                    continue
                att = [r["attainment"] for r in sel]
                print(
                    f"| {load:.0%} | {setup} | {statistics.mean(att):.4f} ({min(att):.4f}) "
                    f"| {statistics.mean(r['ttft_p99_ms'] for r in sel):.0f} "
                    f"| {statistics.mean(r['tpot_p99_ms'] for r in sel):.1f} "
                    f"| {statistics.mean(r['offline_norm'] for r in sel):.3f} |"
                )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=600.0, help="virtual seconds per run")
    ap.add_argument("--quick", action="store_true", help="load 0.5 and the first trainer only")
    ap.add_argument(
        "--loads", default="0.5,0.3,0.7", help="fractions of capacity, run in this order"
    )
    ap.add_argument(
        "--control-factor",
        type=float,
        default=1.5,
        help="SLO factor the daemon is given (x the p99 TTFT and TPOT alone); results are scored "
        "at every factor",
    )
    ap.add_argument(
        "--s-sat",
        type=float,
        default=LlmServerConfig().s_sat,
        help="the server's kernels on fewer SMs follow the saturating law with this fraction "
        "(docs/simulator.md L3b; default: the measured one); 0: G7, the sensitivity",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/llm_pairs.json")
    ap.add_argument("--setups", help="comma-separated setups (default: every one)")
    ap.add_argument(
        "--trainer-after",
        type=float,
        default=0.0,
        help="submit the training job after the server has served alone this many seconds (the "
        "daemon-driven setups and exclusive-policy only); the run is scored from then",
    )
    ap.add_argument(
        "--summarise",
        type=Path,
        help="print and write the tables from the rows of an earlier run (its .partial.jsonl)",
    )
    return ap


def _run_all(
    args: argparse.Namespace,
    loads: tuple[float, ...],
    trainers: tuple[str, ...],
    setups: list[str],
    partial: Path,
) -> list[dict[str, Any]]:
    """Every run (the server alone at each load first: the SLOs), each row kept in ``partial``."""
    rows: list[dict[str, Any]] = []
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        first = list(
            pool.map(
                one,
                [("exclusive", None, x, args.duration, 0.0, 0.0, args.s_sat, 0.0) for x in loads],
            )
        )
        alone = {r.load: r for r, _ in first}
        k = args.control_factor
        work: list[Work] = [
            (
                s,
                t,
                x,
                args.duration,
                k * llm_pairs.p99(alone[x].ttft_s),
                llm_daemon.tpot_slo_s(s, alone[x], k),
                args.s_sat,
                args.trainer_after,
            )
            for x in loads
            for t in trainers
            for s in setups
        ]
        futures = [pool.submit(one, w) for w in work]
        for res, speed in first:
            rows += _rows(res, speed, alone[res.load])
        with partial.open("a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
            for fut in as_completed(futures):
                res, speed = fut.result()
                new = _rows(res, speed, alone[res.load])
                rows += new
                for r in new:
                    fh.write(json.dumps(r) + "\n")
                fh.flush()
    return rows


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    loads = (0.5,) if args.quick else tuple(float(x) for x in args.loads.split(","))
    trainers = llm_pairs.TRAINERS[:1] if args.quick else llm_pairs.TRAINERS
    setups = (
        args.setups.split(",")
        if args.setups
        else [*POLICIES, SHARE100, LLM, RUNNING, TOKEN, PRIO0, PRIO1, *SERVER_SM, ITL, *LEVERS]
    )
    late = [s for s in setups if s not in (*POLICIES, *CONTROLS, EXCLUSIVE_POLICY)]
    if args.trainer_after and late:
        ap.error(f"--trainer-after: {', '.join(late)} run on the model directly, from 0")
    print(f"engine: {engine.loaded()}")
    print(f"capacity alone: {llm_pairs.capacity_rps():.3f} req/s")
    partial = args.out.with_suffix(".partial.jsonl")
    if args.summarise is not None:
        rows = [json.loads(line) for line in args.summarise.read_text().splitlines() if line]
        loads = tuple(x for x in loads if any(r["load"] == x for r in rows))
    else:
        rows = _run_all(args, loads, trainers, setups, partial)
    _print_tables(rows, loads, setups)
    speeds = [r["speed_factor"] for r in rows if r["slo_factor"] == FACTORS[0]]
    print(
        f"\nspeed: slowest run {min(speeds):.1f}x real time, median {statistics.median(speeds):.1f}x"
    )
    out = {
        "duration_s": args.duration,
        "control_factor": args.control_factor,
        "trainer_after_s": args.trainer_after,
        "s_sat": args.s_sat,
        "capacity_rps": llm_pairs.capacity_rps(),
        "rows": rows,
        "speed_min": min(speeds),
        "speed_median": statistics.median(speeds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, allow_nan=True) + "\n")
    print(f"wrote {args.out}")
    assert all(math.isfinite(s) for s in speeds)


if __name__ == "__main__":
    main()
