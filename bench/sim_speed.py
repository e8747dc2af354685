"""Simulator speed in CPU time: every shipped scenario under every policy, one run at a time.

``bench/sharing.py`` reports wall-clock speed factors, which a machine shared with other work
deflates; this bench measures each run's CPU time (``time.process_time``) in one process, so the
factor is the simulator's own. Prints the slowest runs and how many fall under 10x real time;
writes ``bench/results/sim_speed.json``.

    python bench/sim_speed.py [--policy NAME ...] [scenario ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.cli.sim_run import make_policies, policy_names  # noqa: E402
from gpushare.sim import engine, runner, scenario  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run, time and report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenarios", nargs="*", help="default: every shipped one")
    ap.add_argument("--policy", action="append", help="repeat; default: all")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_speed.json"))
    args = ap.parse_args(argv)
    # The 1-hour variants (long/, issue 32) would take most of the run: left to bench/sharing.py --long.
    # The GPU-bound pairs (gpubound/, issue 33) are the pairs' kernels with another host cost: run
    # them by name (bench/sim_speed.py gpubound/NAME ...) to keep the default set comparable.
    names = args.scenarios or [
        n for n in scenario.shipped() if not n.startswith(("long/", "gpubound/"))
    ]
    policies = args.policy or list(policy_names())
    runs = []
    cpu0 = time.process_time()
    virtual = 0.0
    for name in names:
        sc = scenario.load(name)
        c0 = time.process_time()
        alone, slo = runner.standalone(sc)
        if alone is not None:
            runs.append({"scenario": name, "policy": "alone", "cpu_s": time.process_time() - c0})
            virtual += sc.duration_s
        for pname, policy in make_policies(policies, sc.config.control):
            c0 = time.process_time()
            runner.run_policy(sc, policy, name=pname, slo_ms=slo)
            runs.append({"scenario": name, "policy": pname, "cpu_s": time.process_time() - c0})
            virtual += sc.duration_s
        for r in runs:
            if r["scenario"] == name:
                r["speed"] = sc.duration_s / r["cpu_s"] if r["cpu_s"] > 0 else float("inf")
    cpu = time.process_time() - cpu0
    runs.sort(key=lambda r: r["speed"])
    doc = {
        "command": "python bench/sim_speed.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
        "virtual_s": virtual,
        "cpu_s": cpu,
        "speed_overall": virtual / cpu if cpu > 0 else None,
        "under_10x": sum(1 for r in runs if r["speed"] < 10.0),
        "runs": runs,
    }
    print(f"engine {doc['engine']}: {virtual:.0f} s virtual in {cpu:.1f} s CPU")
    print(f"overall {doc['speed_overall']:.0f}x; {doc['under_10x']} of {len(runs)} runs under 10x")
    for r in runs[:10]:
        print(f"  {r['speed']:6.1f}x  {r['scenario']} / {r['policy']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
