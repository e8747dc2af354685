"""Socket API load: requests/s and latency of `status` and `submit --detach`, and CLI wall time.

Starts a real daemon (tests/support/daemon_proc.py: fake GPU and MPS, everything else real) under /tmp,
drives it with 1, 10 and 100 concurrent connections, and times `gpushare status` end to end.
Prints a table and writes bench/results/socket_load.json.

    .venv/bin/python bench/socket_load.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushare.client import ApiClient, ApiError
from tests.support.daemon_helpers import REPO, DaemonProc

OUT = REPO / "bench" / "results" / "socket_load.json"
LEVELS = (1, 10, 100)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load(sock: Path, method: str, make_params, concurrency: int, total: int) -> dict[str, float]:
    per = max(1, total // concurrency)
    lat: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency)
    refused: list[str] = []

    def worker() -> None:
        mine: list[float] = []
        with ApiClient.connect(sock, timeout_s=60) as api:
            barrier.wait()
            for i in range(per):
                t0 = time.perf_counter()
                try:
                    api.call(method, make_params(i))
                except ApiError as exc:  # a refusal (no free MPS slot) is an answer too
                    refused.append(exc.code.name)
                mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": len(lat),
        "refused": len(refused),
        "requests_per_s": round(len(lat) / wall, 1),
        "p50_ms": round(_pct(lat, 0.50) * 1e3, 2),
        "p99_ms": round(_pct(lat, 0.99) * 1e3, 2),
        "max_ms": round(max(lat) * 1e3, 2),
    }


def cli_status_wall(sock: Path, runs: int = 10) -> dict[str, float]:
    exe = Path(sys.executable).with_name("gpushare")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpushare"]
    env = {**os.environ, "GPUSHARE_SOCKET": str(sock)}
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([*argv, "status"], env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {
        "command": " ".join([Path(argv[0]).name, *argv[1:], "status"]),
        "runs": runs,
        "median_ms": round(statistics.median(times) * 1e3, 1),
        "min_ms": round(min(times) * 1e3, 1),
        "max_ms": round(max(times) * 1e3, 1),
        "target_ms": 150,
    }


def main() -> None:
    # 128 MPS client slots per GPU (the most config allows) so 100 concurrent submits fit.
    d = DaemonProc("[mps]\nmax_clients = 128")
    try:
        d.start()
        cli = cli_status_wall(d.socket)  # on an idle daemon, before the load runs
        status = [
            load(d.socket, "status", lambda i: {}, c, 2000 if c > 1 else 1000) for c in LEVELS
        ]
        submit_params = {"cls": "offline", "argv": ["true"], "detach": True, "cwd": "/",
                         "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
        submit = [load(d.socket, "submit", lambda i: submit_params, c, 200) for c in LEVELS]
    finally:
        d.cleanup()
    result = {
        "host_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "status": status,
        "submit_detach": submit,
        "cli_status_wall": cli,
    }
    print(
        f"{'method':<14}{'conc':>6}{'reqs':>7}{'refused':>8}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
    )
    for name, rows in (("status", status), ("submit-detach", submit)):
        for r in rows:
            print(f"{name:<14}{r['concurrency']:>6}{r['requests']:>7}{r['refused']:>8}{r['requests_per_s']:>10}"
                  f"{r['p50_ms']:>9}{r['p99_ms']:>9}")  # fmt: skip
    print(f"`{cli['command']}` wall time: median {cli['median_ms']} ms (min {cli['min_ms']}, "
          f"max {cli['max_ms']}; target < 150 ms)")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
