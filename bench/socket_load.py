"""Socket API load: `status` and `list` latency with many concurrent callers, and `submit` wall time.

Starts a real daemon (tests/support/daemon_proc.py: fake GPUs and MPS, everything else real) from
each tree under test (this one, and ``--against`` another, e.g. a worktree of b0c0ecb), one after
the other in the same run: ``--gpus`` GPUs (default 8) with ``--clients`` sleeping offline
clients (default 48) spread over them; then ``--callers`` threads (default 48), each on its own
connection, call ``status`` (then ``list``) for ``--seconds`` each; ``--procs N`` spreads them over
N processes, as separate monitors would be (each decodes its answers under its own interpreter
lock; with one process, the bench's own decoding is part of every latency it measures). Also times ``gpushare submit
--offline --detach -- true`` as a whole process (median of 10). Prints a table and writes
bench/results/socket_load.json, with the daemon's CPU time per answer beside the latencies (on a
busy host the latencies mostly measure the wait for a core; the CPU per answer does not). Targets
(issue 29): p99 <= 50 ms; submit <= 150 ms.

    git worktree add /tmp/old b0c0ecb
    .venv/bin/python bench/socket_load.py --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from bench.support.trees import tree_commit
from gpushare.client import ApiClient, ApiError

OUT = REPO / "bench" / "results" / "socket_load.json"


class TreeDaemon(DaemonProc):
    """The test daemon, run from a given source tree."""

    def __init__(self, tree: Path, gpus: int) -> None:
        super().__init__("[mps]\nmax_clients = 128", gpus=gpus)
        self.tree = tree

    def start(self, *, wait: bool = True) -> DaemonProc:
        env = {**os.environ, "GPUSHARE_TEST_GPUS": str(self.gpus), "PYTHONPATH": str(self.tree)}
        self.stderr_path = self.base / "daemon.stderr"
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.daemon_proc", str(self.config_path)],
                cwd=self.tree, env=env, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        if wait:
            wait_for(self._answers, 30.0, f"the daemon to answer (stderr: {self.stderr_path})")
        return self


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (every thread), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _callers(
    sock: Path, method: str, params: dict[str, Any], n: int, seconds: float, barrier: Any
) -> tuple[list[float], list[str]]:
    """``n`` threads of this process, each on its own connection: their latencies and errors."""
    lat: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        mine: list[float] = []
        try:
            with ApiClient.connect(sock, timeout_s=60) as api:
                barrier.wait()
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    api.call(method, params)
                    mine.append(time.perf_counter() - t0)
        except (ApiError, OSError) as exc:
            errors.append(str(exc))
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, errors


def _caller_process(
    sock: Path, method: str, params: dict[str, Any], n: int, seconds: float, barrier: Any,
    out: Any,
) -> None:  # fmt: skip
    out.put(_callers(sock, method, params, n, seconds, barrier))


def load(
    sock: Path, method: str, params: dict[str, Any], callers: int, seconds: float, procs: int = 1
) -> dict[str, Any]:
    """``callers`` concurrent callers of ``method``, as threads of ``procs`` processes.

    Monitors polling a daemon are processes of their own, each decoding its answers with its own
    interpreter lock; callers that are threads of one process wait for that one lock too, so with
    one process the load generator's decoding adds to every latency it measures.
    """
    t0 = time.perf_counter()
    if procs <= 1:
        lat, errors = _callers(sock, method, params, callers, seconds, threading.Barrier(callers))
    else:
        ctx = multiprocessing.get_context("fork")
        barrier, out = ctx.Barrier(callers), ctx.SimpleQueue()
        shares = [callers // procs + (i < callers % procs) for i in range(procs)]
        kids = [ctx.Process(target=_caller_process,
                            args=(sock, method, params, n, seconds, barrier, out))
                for n in shares]  # fmt: skip
        for k in kids:
            k.start()
        lat, errors = [], []
        for _ in kids:
            got_lat, got_err = out.get()
            lat += got_lat
            errors += got_err
        for k in kids:
            k.join()
    wall = time.perf_counter() - t0
    return {
        "method": method, "callers": callers, "processes": max(1, procs), "requests": len(lat),
        "errors": len(errors), "requests_per_s": round(len(lat) / wall, 1),
        "p50_ms": round(_pct(lat, 0.50) * 1e3, 1), "p99_ms": round(_pct(lat, 0.99) * 1e3, 1),
    }  # fmt: skip


def submit_wall(tree: Path, sock: Path, runs: int) -> float:
    times = []
    env = {**os.environ, "PYTHONPATH": str(tree), "GPUSHARE_SOCKET": str(sock)}
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "gpushare", "submit", "--offline", "--detach", "--", "true"],
            cwd="/", env=env, check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 1)


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    d = TreeDaemon(tree, args.gpus)
    try:
        d.start()
        for i in range(args.clients):
            d.submit_detached(["sleep", "600"], gpu=str(i % args.gpus), name=f"load-{i}")
        submit_ms = submit_wall(tree, d.socket, 10)
        rows = []
        for method, params in (("status", {}), ("list", {"all": False})):
            assert d.proc is not None
            cpu0 = _cpu_s(d.proc.pid)
            row = load(d.socket, method, params, args.callers, args.seconds, args.procs)
            # The daemon's CPU per answer: unlike the latencies, not set by the other load on the
            # host (on a busy 2-core host the latencies mostly measure the wait for a core).
            row["daemon_cpu_ms_per_request"] = round(
                (_cpu_s(d.proc.pid) - cpu0) * 1e3 / max(1, row["requests"]), 3
            )
            rows.append(row)
    finally:
        d.cleanup()
    return {"tree": tree_commit(tree), "load": rows, "submit_process_median_ms": submit_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--against", type=Path, help="Another tree (e.g. a worktree of b0c0ecb).")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--callers", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument(
        "--procs", type=int, default=1,
        help="Processes the callers are spread over (1: threads of this one, as before).",
    )  # fmt: skip
    args = ap.parse_args()
    trees = {"this": REPO, **({"against": args.against.resolve()} if args.against else {})}
    results = {name: run_tree(tree, args) for name, tree in trees.items()}
    print(f"{args.gpus} GPUs, {args.clients} clients, {args.callers} concurrent callers "
          f"in {args.procs} process(es)")  # fmt: skip
    print(f"{'tree':<10}{'method':<8}{'reqs':>7}{'err':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'daemon CPU ms/req':>19}")  # fmt: skip
    for name, res in results.items():
        for r in res["load"]:
            print(f"{name:<10}{r['method']:<8}{r['requests']:>7}{r['errors']:>5}"
                  f"{r['requests_per_s']:>9}{r['p50_ms']:>9}{r['p99_ms']:>9}"
                  f"{r['daemon_cpu_ms_per_request']:>19}")  # fmt: skip
    for name, res in results.items():
        print(f"{name}: `gpushare submit --offline --detach -- true` median "
              f"{res['submit_process_median_ms']} ms (target 150)")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "host_cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": sys.version.split()[0],
        "gpus": args.gpus, "clients": args.clients, "callers": args.callers,
        "seconds": args.seconds, "procs": args.procs, "results": results,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
