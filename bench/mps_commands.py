"""Wall time of one MPS control command round trip against the real control daemon.

This is the controller's cost of talking to MPS: one ``nvidia-cuda-mps-control`` front-end process
per command (MPS docs: one command per invocation), through ``MpsControl``. The daemon is
started by ``MpsSupervisor`` in a temporary directory, exactly as the daemon runs it.

Usage: ``.venv/bin/python bench/mps_commands.py [--n 400]``; prints the numbers and writes
``bench/results/mps_commands.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.helpers import MPS_MISSING, find_mps_control, mps_server_dir  # noqa: E402
from gpushare.config import Config, MpsConfig, PathsConfig  # noqa: E402
from gpushare.node.mps import MpsSupervisor  # noqa: E402

GPU = "GPU-00000000-0000-0000-0000-000000000000"


def _pct(sorted_ms: list[float], q: float) -> float:
    # Nearest-rank percentile: no interpolation above the largest sample.
    index = min(len(sorted_ms) - 1, max(0, round(q * len(sorted_ms) + 0.5) - 1))
    return sorted_ms[index]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=400, help="round trips per command")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    binary = find_mps_control()
    if binary is None:
        print(f"skipped: {MPS_MISSING}", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="gsb", dir="/tmp"))
    config = Config(
        paths=PathsConfig(runtime_dir=root, state_dir=root / "state"),
        mps=MpsConfig(control_binary=str(binary), health_period_s=60.0, quit_timeout_s=1.0),
    )
    server_dir = mps_server_dir()
    sup = MpsSupervisor(GPU, config, extra_path=[server_dir] if server_dir else [])
    results: dict[str, dict[str, float]] = {}
    try:
        sup.start()
        ctl = sup.control
        commands = {
            "get_default_active_thread_percentage": ctl.get_default_active_thread_percentage,
            "set_default_active_thread_percentage": lambda: ctl.set_default_active_thread_percentage(
                50.0
            ),
            "get_server_list": ctl.get_server_list,
        }
        for name, call in commands.items():
            for _ in range(20):  # warm caches
                call()
            samples = []
            for _ in range(args.n):
                t0 = time.perf_counter()
                call()
                samples.append((time.perf_counter() - t0) * 1e3)
            samples.sort()
            results[name] = {
                "n": len(samples),
                "median_ms": statistics.median(samples),
                "p99_ms": _pct(samples, 0.99),
                "min_ms": samples[0],
                "max_ms": samples[-1],
            }
            print(f"{name:40s} n={args.n} median={results[name]['median_ms']:.2f} ms "
                  f"p99={results[name]['p99_ms']:.2f} ms")  # fmt: skip
    finally:
        sup.stop()
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "bench": "mps_commands",
        "what": "wall time of one MPS control front-end round trip (MpsControl, one process per command)",
        # Relative inside the checkout: the results are committed, a machine's paths are not.
        "binary": str(binary.relative_to(REPO)) if binary.is_relative_to(REPO) else binary.name,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "unix_time": time.time(),
        "results": results,
    }
    path = REPO / "bench" / "results" / "mps_commands.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
