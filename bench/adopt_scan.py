"""Cost of one adoption scan: every process of this host read from /proc and matched against rules.

The daemon runs the scan every ``daemon.adopt_scan_period``; this says what one costs here (the
first, which reads every process in full, and the later ones, which check what is cached), with
this host's processes plus ``--extra`` idle ones (a busy GPU node runs a few hundred to a few
thousand). Prints the numbers and writes them to bench/results/adopt_scan.json.

    .venv/bin/python bench/adopt_scan.py [--extra 500] [--rounds 20]

``--compare-procs OLD.py`` also times ``process_facts`` of another version of
``gpushare/node/procs/facts.py`` (e.g. ``git show REV:gpushare/node/procs/facts.py > /tmp/old.py``;
before the split into a package, ``REV:gpushare/node/procs.py``) against this one, alternating
round by round on the same processes, so that a loaded machine slows both alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpushare import config  # noqa: E402
from gpushare.control.adoption import FACT_ENV, Rule  # noqa: E402
from gpushare.daemon.adopter import Adopter  # noqa: E402
from gpushare.node.procs import facts  # noqa: E402

RULES = """
[[adopt]]
name = "marker"
marker = true
uses_gpu = true

[[adopt]]
name = "triton"
unit = "triton*.service"
class = "online"

[[adopt]]
name = "slurm"
env = { SLURM_JOB_ID = "*" }
class = "offline"
"""


def main() -> int:
    """Run the benchmark; write bench/results/adopt_scan.json."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", type=int, default=500, help="idle processes to add (default 500)")
    ap.add_argument("--rounds", type=int, default=20, help="scans to time (default 20)")
    ap.add_argument(
        "--compare-procs",
        type=Path,
        help="another procs/facts.py (or procs.py) to time against this one",
    )
    args = ap.parse_args()
    rules = [Rule(spec, 0, "bench") for spec in config.loads(RULES).adopt]
    marked = {**os.environ, "GPUSHARE_CLASS": "offline"}
    extra = [
        subprocess.Popen(["sleep", "600"], env=marked if i % 10 == 0 else None)
        for i in range(args.extra)
    ]
    try:
        time.sleep(0.5)
        adopter = Adopter(min_age_s=0.0)
        # NVML is stood in for: every tenth extra process is listed as a GPU process.
        gpu_pids = {p.pid: ("GPU-0",) for p in extra[::10]}
        t0 = time.perf_counter()
        first = adopter.scan(rules, clients=(), gpu_pids=gpu_pids)
        first_s = time.perf_counter() - t0
        # A scan with an empty cache reads every process in full, as the daemon's first does, and
        # as the scan before the cache did every time; the later ones are the steady state.
        times = []
        adopted = len(first.adopt)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = adopter.scan(rules, clients=(), gpu_pids=gpu_pids)
            times.append(time.perf_counter() - t0)
            adopted = len(out.adopt)
        n = len(facts.all_pids())
        compared = _compare(args.compare_procs, args.rounds) if args.compare_procs else None
    finally:
        for p in extra:
            p.kill()
        for p in extra:
            p.wait()
    result = {
        "processes": n,
        "rounds": args.rounds,
        "first_scan_ms": round(first_s * 1000, 2),
        "first_per_process_us": round(first_s / n * 1e6, 1),
        "scan_ms_median": round(statistics.median(times) * 1000, 2),
        "scan_ms_max": round(max(times) * 1000, 2),
        "per_process_us": round(statistics.median(times) / n * 1e6, 1),
        "adopted_per_scan": adopted,
        "facts_us_per_process": compared,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(
        f"{n} processes: first scan {result['first_scan_ms']} ms "
        f"({result['first_per_process_us']} us/process); later scans {result['scan_ms_median']} ms median "
        f"({result['per_process_us']} us/process, max {result['scan_ms_max']} ms), "
        f"{adopted} adopted"
    )
    if compared is not None:
        print(f"process_facts: {compared['other']} us/process with {args.compare_procs}, "
              f"{compared['this']} us/process with this checkout's")  # fmt: skip
    out_path = ROOT / "bench" / "results" / "adopt_scan.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path.relative_to(ROOT)}")
    return 0


def _compare(other_path: Path, rounds: int) -> dict[str, float]:
    """Median microseconds per process of process_facts, the other module against this one."""
    spec = importlib.util.spec_from_file_location("procs_other", other_path)
    assert spec is not None
    assert spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    names = set(FACT_ENV)
    times: dict[str, list[float]] = {"other": [], "this": []}
    for _ in range(rounds):
        for label, mod in (("other", other), ("this", facts)):
            pids = facts.all_pids()
            t0 = time.perf_counter()
            for pid in pids:
                mod.process_facts(pid, names, {})
            times[label].append((time.perf_counter() - t0) / len(pids) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
