"""Cost of one adoption scan: every process of this host read from /proc and matched against rules.

The daemon runs the scan every ``daemon.adopt_scan_period``; this says what one costs here, with
this host's processes plus ``--extra`` idle ones (a busy GPU node runs a few hundred to a few
thousand). Prints the numbers and writes them to bench/results/adopt_scan.json.

    .venv/bin/python bench/adopt_scan.py [--extra 500] [--rounds 20]
"""

from __future__ import annotations

import argparse
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
from gpushare.adoption import Rule  # noqa: E402
from gpushare.daemon.adopter import Adopter  # noqa: E402
from gpushare.node import procs  # noqa: E402

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
        times = []
        adopted = 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = adopter.scan(rules, clients=(), gpu_pids=gpu_pids)
            times.append(time.perf_counter() - t0)
            adopted = len(out.adopt)
        n = len(procs.all_pids())
    finally:
        for p in extra:
            p.kill()
        for p in extra:
            p.wait()
    result = {
        "processes": n,
        "rounds": args.rounds,
        "scan_ms_median": round(statistics.median(times) * 1000, 2),
        "scan_ms_max": round(max(times) * 1000, 2),
        "per_process_us": round(statistics.median(times) / n * 1e6, 1),
        "adopted_per_scan": adopted,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(
        f"{n} processes: one scan {result['scan_ms_median']} ms median "
        f"({result['per_process_us']} us/process, max {result['scan_ms_max']} ms), "
        f"{adopted} adopted"
    )
    out_path = ROOT / "bench" / "results" / "adopt_scan.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
