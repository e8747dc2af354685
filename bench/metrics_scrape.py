"""A flood of /metrics scrapes against the exporter: its CPU per scrape, and the control loop's delay.

In one process per tree under test (this one, and ``--against`` another tree, e.g. ``git archive
integ gpushare | tar -x -C /tmp/old``), as the daemon holds them: the exporter with a snapshot of
``--gpus`` GPUs x ``--clients`` clients each (default 8 x 200; the source builds a fresh copy when
a build is due, so each build is a new snapshot to render), its HTTP server on loopback, and a
stand-in control loop: a thread that every ``--period`` seconds (0.1) runs 1 ms of Python and
says the tick completed (``Exporter.ticked``). First ``--seconds`` quiet, then ``--seconds`` while
another process floods ``/metrics`` from ``--scrapers`` connections at once (each scraping again
as soon as it has its answer). Reports, per phase: the process's CPU (all its threads: the
loop's, the server's), the scrapes served (200) and refused (503), the CPU per served scrape
(flood CPU less the quiet CPU over as long, per scrape), and the loop's tick delay (how late a
tick started after its due time, and how long its 1 ms of work took: both are the wait for the
interpreter lock a render holds). Prints a table and writes bench/results/metrics_scrape.json.

    git archive integ gpushare | tar -x -C /tmp/old
    .venv/bin/python bench/metrics_scrape.py --against /tmp/old
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench.support; the worker puts its tree first for gpushare

from bench.support.trees import tree_commit  # noqa: E402

OUT = REPO / "bench" / "results" / "metrics_scrape.json"
WORK_S = 0.001  # what the stand-in tick computes


def _snapshot(gpus: int, clients: int) -> Any:
    """A node of ``gpus`` GPUs with ``clients`` clients each, every figure present."""
    from gpushare.metrics import ClientStats, GpuControl, NodeMetrics
    from gpushare.model import (
        ClientClass,
        ClientState,
        ClientView,
        GpuSample,
        Limits,
        MpsState,
        Observation,
        ProbeReading,
    )

    observations, stats, control = [], {}, {}
    for g in range(gpus):
        uuid = f"GPU-{g:08d}-0000-0000-0000-000000000000"
        views = []
        for c in range(clients):
            cid = f"g{g}c{c}"
            online = c % 10 == 0
            cls = ClientClass.ONLINE if online else ClientClass.OFFLINE
            views.append(
                ClientView(
                    client_id=cid,
                    cls=cls,
                    state=ClientState.RUNNING if c % 2 else ClientState.FROZEN,
                    limits=Limits(sm_pct=10.0, pinned_mem_bytes=4 << 30, priority=cls.mps_priority),
                    uid=1000 + c % 50,
                    pid=10_000 + g * clients + c,
                    mem_used_bytes=1 << 30,
                    slo_p99_ms=40.0 if online else None,
                    p99_ms=30.0 if online else None,
                )
            )
            stats[cid] = ClientStats(name=f"job-{cid}", thawed_s=12.5, thawed_ratio=0.5)
        sample = GpuSample(index=g, uuid=uuid, name="NVIDIA H200")
        probe = ProbeReading(latency_ms=2.5, baseline_ms=2.0, ratio=1.25)
        observations.append(
            Observation(
                gpu_uuid=uuid,
                gpu_index=g,
                sample=sample,
                probe=probe,
                clients=tuple(views),
                mps_state=MpsState.UP,
            )
        )
        control[uuid] = GpuControl(duty=0.5, offline_sm_pct=30.0)
    users = {1000 + u: f"user{u}" for u in range(50)}
    return NodeMetrics(observations=observations, control=control, user_names=users, clients=stats)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Loop:
    """The stand-in control loop: a tick every period, each late start and duration recorded."""

    def __init__(self, exporter: Any, period_s: float) -> None:
        self.exporter, self.period_s = exporter, period_s
        self.lates_s: list[float] = []
        self.durations_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> tuple[list[float], list[float]]:
        lates, durations = self.lates_s, self.durations_s
        self.lates_s, self.durations_s = [], []
        return lates, durations

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            start = time.monotonic()
            self.lates_s.append(max(0.0, start - due))
            _spin(WORK_S)
            self.exporter.ticked()
            self.durations_s.append(time.monotonic() - start)
            due += self.period_s
            self._stop.wait(max(0.0, due - time.monotonic()))


def _ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)


def _phase(loop: Loop, seconds: float, flood: list[str] | None) -> dict[str, Any]:
    loop.take()
    cpu0, wall0 = time.process_time(), time.monotonic()
    counts = {"ok": 0, "busy": 0, "bytes": 0}
    if flood is None:
        time.sleep(seconds)
    else:
        out = subprocess.run(
            flood, capture_output=True, text=True, check=True, timeout=seconds + 60
        )
        counts = json.loads(out.stdout)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    lates, durations = loop.take()
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 3),
        "cpu_pct": round(100 * cpu / wall, 1),
        "scrapes_ok": counts["ok"],
        "scrapes_503": counts["busy"],
        "mb_per_scrape": round(counts["bytes"] / max(1, counts["ok"]) / 1e6, 2),
        "ticks": len(lates),
        "tick_late_p50_ms": _ms(lates, 0.5),
        "tick_late_p99_ms": _ms(lates, 0.99),
        "tick_late_max_ms": _ms(lates, 1.0),
        "tick_work_p50_ms": _ms(durations, 0.5),
        "tick_work_p99_ms": _ms(durations, 0.99),
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One tree: the quiet phase, then the flood; what :func:`_phase` reports of each."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    from gpushare.metrics import Exporter

    snap = _snapshot(args.gpus, args.clients)
    exporter = Exporter(hostname="bench-node")
    exporter.attach(lambda: dataclasses.replace(snap))
    host, port = exporter.serve("127.0.0.1:0", tick_period_s=args.period)
    loop = Loop(exporter, args.period)
    loop.start()
    try:
        time.sleep(2 * args.period)  # a tick or two before the first scrape
        quiet = _phase(loop, args.seconds, None)
        flood = [sys.executable, __file__, "--flood", host, str(port), str(args.seconds)]
        flooded = _phase(loop, args.seconds, [*flood, str(args.scrapers)])
    finally:
        loop.stop()
        exporter.close()
    extra_cpu = flooded["cpu_s"] - quiet["cpu_s"] * flooded["wall_s"] / quiet["wall_s"]
    return {
        # The tree's name and commit, not its path: results are committed (no machine paths).
        "tree": Path(args.tree).resolve().name,
        "commit": tree_commit(Path(args.tree)),
        "builds": exporter.builds,
        "quiet": quiet,
        "flood": flooded,
        "cpu_ms_per_scrape": round(1e3 * extra_cpu / max(1, flooded["scrapes_ok"]), 2),
    }


def flood(host: str, port: int, seconds: float, scrapers: int) -> dict[str, int]:
    """``scrapers`` connections scraping back to back for ``seconds``; 200s, 503s, bytes."""
    counts = {"ok": 0, "busy": 0, "bytes": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def one() -> None:
        while time.monotonic() < end:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
                chunks = []
                while chunk := s.recv(1 << 20):
                    chunks.append(chunk)
            reply = b"".join(chunks)
            with lock:
                if reply.startswith(b"HTTP/1.0 200"):
                    counts["ok"] += 1
                    counts["bytes"] += len(reply)
                else:
                    counts["busy"] += 1

    threads = [threading.Thread(target=one) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--clients", type=int, default=200, help="clients per GPU")
    parser.add_argument("--period", type=float, default=0.1, help="the loop's period (s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    parser.add_argument("--scrapers", type=int, default=8, help="concurrent scraping connections")
    parser.add_argument("--against", help="another tree (with gpushare/) to measure first")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=str(REPO), help=argparse.SUPPRESS)
    parser.add_argument("--flood", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        host, port, seconds, scrapers = args.flood
        print(json.dumps(flood(host, int(port), float(seconds), int(scrapers))))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = []
    for tree in [t for t in (args.against, str(REPO)) if t]:
        cmd = [sys.executable, __file__, "--worker", "--tree", tree]
        for key in ("gpus", "clients", "period", "seconds", "scrapers"):
            cmd += [f"--{key}", str(getattr(args, key))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        runs.append(json.loads(out.stdout))
    print(
        f"{args.gpus} GPUs x {args.clients} clients, period {args.period} s, {args.scrapers} scrapers"
    )
    head = "tree phase cpu% ok 503 MB/scrape ticks late_p50 late_p99 late_max work_p50 work_p99"
    print(head)
    for r in runs:
        for name in ("quiet", "flood"):
            p = r[name]
            print(
                f"{Path(r['tree']).name} {name} {p['cpu_pct']} {p['scrapes_ok']} {p['scrapes_503']}"
                f" {p['mb_per_scrape']} {p['ticks']} {p['tick_late_p50_ms']} {p['tick_late_p99_ms']}"
                f" {p['tick_late_max_ms']} {p['tick_work_p50_ms']} {p['tick_work_p99_ms']}"
            )
        print(
            f"{Path(r['tree']).name} cpu_ms_per_scrape {r['cpu_ms_per_scrape']} builds {r['builds']}"
        )
    shown = {**vars(args), "out": Path(args.out).name, "tree": Path(args.tree).resolve().name}
    if args.against:
        shown["against"] = Path(args.against).resolve().name
    Path(args.out).write_text(json.dumps({"args": shown, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
