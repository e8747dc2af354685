"""What-if: offline clients at the online client's MPS priority, beside requests (issue 14).

A what-if of the model, not a shipped lever. gpushare launches offline clients at MPS client
priority 1 (below normal) and online ones at 0, so between waves the online client's pending
blocks go first (docs/simulator.md, MPS priority). With a gate delay (docs/controller.md, "Gate
delay") offline work runs beside the first ``D`` of every busy spell of requests, where at
priority 1 it gets little. ``CUDA_MPS_CLIENT_PRIORITY`` is read when a client starts, so a
controller could relaunch offline clients at 0 at a loose SLO; this benchmark asks what that
would buy, before anyone builds it.

Runs policy gpushare (request gating on, offline ``--queue auto``, so shallow) on the
Tally-shaped pairs (bench/frontier.py's ``pair_files()``) at each SLO factor for each cell of

* offline MPS priority: 1 (as shipped) or 0 (the online client's), set on the policy object
  (``offline_mps_priority``, which the simulated node and the daemon's launch environment read);
* gate delay: the shipped rule (``rule``) or a fixed delay in ms, patched **in this process
  only** over the controller's ``gate_delay`` (:mod:`gpushare.control.gatedelay`) (``D`` whenever gating is on with shallow queues,
  where the rule would move it; 0 elsewhere, as the rule).

``--launch-gap-us`` sets the shallow queue's launch gap (the model's W3 constant: a sensitivity,
not a lever). Each run checks that the patches took (every offline client at the priority asked for, the fixed
delay emitted). Prints mean SLO attainment, mean p99 overhead and mean offline throughput (of
running alone) per cell and writes bench/results/gating_priority.json.

    .venv/bin/python bench/gating_priority.py --jobs 1     # 1.5x 2x 1.1x, ~3 min compiled
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.control import controller as ctl  # noqa: E402
from gpushare.control.gpu_state import gated_shallow  # noqa: E402
from gpushare.control.registry import make_policy  # noqa: E402
from gpushare.sim import engine, report, runner, scenario  # noqa: E402
from gpushare.sim import node as simnode  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from frontier import pair_cell, pair_files  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gating_priority.json"
DELAYS = ("rule", "0", "10", "30", "50", "70", "100", "300", "1000")
FACTORS = (1.5, 2.0, 1.1)
PRIORITIES = (1, 0)

#: The fixed delay of the current run in seconds (None: the shipped rule), and what it emitted.
FIXED: dict[str, float | None] = {"delay_s": None}
SEEN: dict[str, Any] = {"max_delay_s": 0.0, "nodes": []}

# Looked up, not assumed: the controller is being reorganised; _patch says so if it moved.
_rule = getattr(ctl, "gate_delay", None)
_node_init = simnode.SimNode.__init__


def _fixed_gate_delay(
    cfg: Any, state: Any, obs: Any, signals: Any, on: bool, now: float
) -> tuple[Any, str]:
    d = FIXED["delay_s"]
    if d is None:
        assert _rule is not None  # _patch checked
        state, why = _rule(cfg, state, obs, signals, on, now)
    else:
        # Where the rule may move the delay (gating on, shallow queues) it is D; elsewhere 0.
        delay = d if on and gated_shallow(state, obs) else 0.0
        state, why = dataclasses.replace(state, gate_delay_s=delay), ""
    SEEN["max_delay_s"] = max(SEEN["max_delay_s"], state.gate_delay_s)
    return state, why


def _recording_init(self: simnode.SimNode, *args: Any, **kwargs: Any) -> None:
    _node_init(self, *args, **kwargs)
    SEEN["nodes"].append(self)


def _patch() -> None:
    if not callable(_rule):
        raise SystemExit(
            "gpushare.control.controller.gate_delay is gone: this what-if patches it; "
            "update the bench"
        )
    ctl.gate_delay = _fixed_gate_delay
    simnode.SimNode.__init__ = _recording_init  # type: ignore[method-assign]


def _pair(
    args: tuple[str, float, float | None, float | None, list[int], list[str]],
) -> list[dict[str, Any]]:
    """Every cell on one pair at one factor (the reference run once)."""
    path, factor, duration, gap_s, prios, delays = args
    logs.configure_logging("warning")
    _patch()
    sc = scenario.load(Path(path))
    online = tuple(dataclasses.replace(o, slo_factor=factor) for o in sc.online)
    sc = dataclasses.replace(sc, online=online)
    if duration is not None:
        sc = dataclasses.replace(sc, duration_s=duration, warmup_s=min(sc.warmup_s, duration / 4))
    if gap_s is not None:
        sc = dataclasses.replace(sc, gpu=dataclasses.replace(sc.gpu, launch_gap_s=gap_s))
    alone, slo = runner.standalone(sc)
    out = []
    for prio in prios:
        for delay in delays:
            FIXED["delay_s"] = None if delay == "rule" else float(delay) * 1e-3
            SEEN["max_delay_s"], SEEN["nodes"] = 0.0, []
            policy = make_policy("gpushare", sc.config.control)
            # An instance attribute over the class's 1: PolicyTraits.of and the daemon's state
            # read it (the simulated launch sets CUDA_MPS_CLIENT_PRIORITY from it).
            policy.offline_mps_priority = prio  # type: ignore[attr-defined]
            run = runner.run_policy(sc, policy, name="gpushare", slo_ms=slo)
            _check(sc.name, prio)
            (row,) = report.summarise(runner.ScenarioResult(sc, alone, slo, [run]))
            out.append(
                {"scenario": sc.name, "slo_factor": factor, "offline_priority": prio,
                 "delay": delay, "launch_gap_us": sc.gpu.launch_gap_s * 1e6, **row.as_dict()}
            )  # fmt: skip
    return out


def _check(name: str, prio: int) -> None:
    """The patches took: offline clients ran at ``prio``; a fixed delay was the one emitted."""
    nodes = SEEN["nodes"]
    if len(nodes) != 1:
        raise SystemExit(f"{name}: expected one simulated node per run, saw {len(nodes)}")
    prios = {t.priority for t in nodes[0].offline}
    if prios != {prio}:
        raise SystemExit(f"{name}: offline clients ran at MPS priority {prios}, not {prio}")
    fixed = FIXED["delay_s"]
    if fixed is not None and abs(SEEN["max_delay_s"] - fixed) > 1e-12:
        raise SystemExit(
            f"{name}: the controller's delay peaked at {SEEN['max_delay_s'] * 1e3:g} ms, not the "
            f"fixed {fixed * 1e3:g} ms (gating never on with shallow queues?)"
        )


def _delay(text: str) -> str:
    if text == "rule":
        return text
    try:
        ms = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a delay is 'rule' (the shipped controller's) or milliseconds >= 0"
        ) from None
    if not ms >= 0 or ms == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a fixed delay must be finite ms >= 0")
    return f"{ms:g}"


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--slo-factor", type=float, nargs="+", default=list(FACTORS),
        help="online SLO = this x its p99 alone, each >= 1 (default 1.5 2 1.1)",
    )  # fmt: skip
    ap.add_argument(
        "--delay", type=_delay, nargs="+", default=list(DELAYS),
        help="gate delays: 'rule' (shipped) or fixed ms (default: rule 0 10 30 50 70 100 300 1000)",
    )  # fmt: skip
    ap.add_argument(
        "--priority", type=int, nargs="+", choices=PRIORITIES, default=list(PRIORITIES),
        help="offline MPS client priorities: 1 as shipped, 0 the online client's (default both)",
    )  # fmt: skip
    ap.add_argument("--duration", type=float, help="override each pair's virtual seconds")
    ap.add_argument(
        "--launch-gap-us", type=float,
        help="the shallow queue's launch gap per kernel (the model's W3 constant, a "
        "sensitivity, not a lever; default the scenario's, 10 us)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap


def _refuse_bad(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad arguments, one line each (``ap.error`` exits)."""
    for f in args.slo_factor:
        if not f >= 1.0 or f == float("inf"):
            ap.error(f"--slo-factor {f:g}: must be finite and >= 1 (an SLO under the p99 alone)")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be >= 1")
    if args.duration is not None and not 0 < args.duration < float("inf"):
        ap.error(f"--duration {args.duration:g}: must be a finite number of seconds > 0")
    if args.launch_gap_us is not None and not 0 <= args.launch_gap_us < float("inf"):
        ap.error(f"--launch-gap-us {args.launch_gap_us:g}: must be finite and >= 0")


def _cells(
    rows: list[dict[str, Any]], factor: float, prios: list[int], delays: list[str]
) -> list[dict[str, Any]]:
    """One factor's cells (priority x delay), each printed as a table row as it is made."""
    cells = []
    for prio in prios:
        for delay in delays:
            sel = [r for r in rows if r["offline_priority"] == prio and r["delay"] == delay]
            cell = pair_cell(
                sel,
                slo_factor=factor,
                offline_priority=prio,
                delay=delay,
                launch_gap_us=sel[0]["launch_gap_us"],
            )
            cells.append(cell)
            dtext = "rule" if delay == "rule" else f"{delay} ms"
            print(
                f"| {factor:g}x | {prio} | {dtext} | {cell['slo_attainment_mean'] * 100:.2f} %"
                f" (min {cell['slo_attainment_min'] * 100:.2f} %) | "
                f"{cell['p99_overhead_mean'] * 100:+.1f} % | {cell['offline_norm_mean']:.3f} |",
                flush=True,
            )
    return cells


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _refuse_bad(ap, args)
    gap_s = None if args.launch_gap_us is None else args.launch_gap_us * 1e-6
    files = pair_files()
    if not files:
        ap.error("no Tally-shaped pair scenarios found under gpushare/scenarios/pairs")
    prios = list(dict.fromkeys(args.priority))
    delays = list(dict.fromkeys(args.delay))
    t0 = time.perf_counter()
    cells: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    print(f"engine: {engine.loaded()}; {len(files)} pairs", flush=True)
    print("| SLO | offline priority | gate delay | SLO attained | p99 ovh | offline |")
    print("|---|---|---|---|---|---|", flush=True)
    for factor in args.slo_factor:
        work = [(f, factor, args.duration, gap_s, prios, delays) for f in files]
        if args.jobs == 1:
            per_pair = [_pair(w) for w in work]
        else:
            with Pool(args.jobs) as pool:
                per_pair = pool.map(_pair, work)
        rows = [r for pair in per_pair for r in pair]
        runs += rows
        cells += _cells(rows, factor, prios, delays)
    command = ".venv/bin/python bench/gating_priority.py " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "what_if": "offline MPS priority and fixed gate delays patched in-process; not shipped",
        "engine": engine.loaded(),
        "wall_s": time.perf_counter() - t0,
        "cells": cells,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
