"""Wall time of `gpushare status` (table and --json) on a daemon with clients, end to end.

`gpushare status` is what operators and monitoring scripts run most, so it must stay quick (issue
17: under 100 ms for the whole process). Starts a real daemon (tests/support/daemon_proc.py: fake GPUs and
MPS, everything else real) under /tmp with two GPUs, one online client with an SLO and six offline
clients, lets it tick, then runs the console script repeatedly. Wall time is what the user waits;
the CLI process's CPU time (user + system, from getrusage) is reported beside it because on a
shared, loaded machine the wall time mostly measures the wait for a core. Prints the numbers and
writes bench/results/status_cli.json.

    .venv/bin/python bench/status_cli.py
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.daemon_helpers import REPO, DaemonProc

OUT = REPO / "bench" / "results" / "status_cli.json"
RUNS = 20
TARGET_MS = 100


def _argv() -> list[str]:
    exe = Path(sys.executable).with_name("gpushare")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpushare"]


def wall(sock: Path, args: list[str], runs: int = RUNS) -> dict[str, float | str | int]:
    """Median/min/max wall time of ``gpushare ARGS`` over ``runs`` runs (one warm-up first)."""
    argv = [*_argv(), *args]
    env = {**os.environ, "GPUSHARE_SOCKET": str(sock)}
    subprocess.run(argv, env=env, check=True, capture_output=True)  # page cache, .pyc files
    times, cpu = [], []
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return {
        "command": " ".join(["gpushare", *args]),
        "runs": runs,
        "median_ms": round(statistics.median(times) * 1e3, 1),
        "min_ms": round(min(times) * 1e3, 1),
        "max_ms": round(max(times) * 1e3, 1),
        "cpu_median_ms": round(statistics.median(cpu) * 1e3, 1),
        "load_avg_1m": os.getloadavg()[0],
    }


def main() -> None:
    d = DaemonProc(gpus=2)
    try:
        d.start()
        base = {"argv": ["sleep", "300"], "detach": True, "cwd": "/",
                "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
        clients = [{**base, "cls": "online", "gpu": "0", "slo_p99_ms": 40.0, "name": "web"}]
        clients += [{**base, "cls": "offline", "gpu": str(i % 2)} for i in range(6)]
        for params in clients:
            d.call("submit", params)
        time.sleep(1.0)  # a few ticks: duty, thaw history and admission state exist
        rows = [wall(d.socket, ["status"]), wall(d.socket, ["status", "--json"])]
    finally:
        d.cleanup()  # kills the clients too
    result = {"host_cpus": os.cpu_count(), "python": sys.version.split()[0],
              "clients": len(clients), "target_ms": TARGET_MS, "runs": rows}  # fmt: skip
    for r in rows:
        print(f"`{r['command']}`: median {r['median_ms']} ms (min {r['min_ms']}, max "
              f"{r['max_ms']}; target < {TARGET_MS} ms), CPU {r['cpu_median_ms']} ms, "
              f"load {r['load_avg_1m']:.1f}")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
