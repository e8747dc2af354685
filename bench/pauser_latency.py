"""How long freezing, thawing and exit noticing take on this machine.

Measures, over real processes:
- cgroup freezer: time from writing cgroup.freeze to cgroup.events reporting frozen 1 (and back),
  for a sleeping child and a CPU-busy child (CgroupPauser.freeze/thaw wall time), and four busy
  clients frozen one by one vs with freeze_many;
- signal fallback: SignalPauser.freeze (SIGSTOP until every member shows T) and thaw;
- ExitWatcher: time from SIGKILL to the exit being delivered, for a child and a non-child (pidfd).

Prints a table and writes bench/results/pauser_latency.json. Runs in a few seconds; needs root and
a writable cgroup v2 for the freezer rows (they are reported as skipped otherwise).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import structlog

from gpushare.node.cgroups.choice import make_pauser
from gpushare.node.cgroups.discovery import own_cgroup
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.signal_pauser import SignalPauser

CYCLES = 40
RESULTS = Path(__file__).resolve().parent / "results" / "pauser_latency.json"
BUSY = [sys.executable, "-c", "while True: pass"]
SLEEPY = [sys.executable, "-c", "import time; time.sleep(600)"]


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in samples_s)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4),
        "max_ms": round(ms[-1], 4),
    }


def _cycle(pauser: CgroupPauser | SignalPauser, cid: str) -> tuple[list[float], list[float]]:
    freeze, thaw = [], []
    for _ in range(CYCLES):
        t0 = time.perf_counter()
        pauser.freeze(cid)
        t1 = time.perf_counter()
        pauser.thaw(cid)
        t2 = time.perf_counter()
        freeze.append(t1 - t0)
        thaw.append(t2 - t1)
        time.sleep(0.005)
    return freeze, thaw


def bench_cgroup(results: dict[str, object]) -> None:
    own = own_cgroup()
    if os.geteuid() != 0 or own is None:
        results["cgroup"] = "skipped: needs root and cgroup v2"
        return
    base = own / f"gpushare-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    choice = make_pauser(base)
    if not isinstance(choice.pauser, CgroupPauser):
        results["cgroup"] = f"skipped: {choice.reason}"
        return
    pauser = choice.pauser
    procs = []
    try:
        for name, argv in (("sleeping", SLEEPY), ("busy", BUSY)):
            proc = subprocess.Popen(argv, start_new_session=True)
            procs.append(proc)
            pauser.attach(name, proc.pid)
            time.sleep(0.2)
            freeze, thaw = _cycle(pauser, name)
            results[f"cgroup_freeze_{name}"] = _summary(freeze)
            results[f"cgroup_thaw_{name}"] = _summary(thaw)
        for proc in procs:
            proc.kill()
            proc.wait()
        procs.clear()
        # Four busy clients: one after the other vs all requests first (freeze_many).
        ids = [f"busy{i}" for i in range(4)]
        for cid in ids:
            proc = subprocess.Popen(BUSY, start_new_session=True)
            procs.append(proc)
            pauser.attach(cid, proc.pid)
        time.sleep(0.2)
        one_by_one, batched = [], []
        for _ in range(CYCLES // 2):
            t0 = time.perf_counter()
            for cid in ids:
                pauser.freeze(cid)
            one_by_one.append(time.perf_counter() - t0)
            pauser.thaw_many(ids)
            time.sleep(0.005)
            t0 = time.perf_counter()
            pauser.freeze_many(ids)
            batched.append(time.perf_counter() - t0)
            pauser.thaw_many(ids)
            time.sleep(0.005)
        results["cgroup_freeze_4_busy_one_by_one"] = _summary(one_by_one)
        results["cgroup_freeze_4_busy_freeze_many"] = _summary(batched)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for cid in list(pauser.clients()):
            try:
                pauser.kill(cid)
                pauser.release(cid)
            except PauserError as exc:
                print("cleanup:", exc)
        base.rmdir()


def bench_signal(results: dict[str, object]) -> None:
    pauser = SignalPauser()
    proc = subprocess.Popen(BUSY, start_new_session=True)
    try:
        pauser.attach("busy", proc.pid)
        time.sleep(0.2)
        freeze, thaw = _cycle(pauser, "busy")
        results["signal_freeze_busy"] = _summary(freeze)
        results["signal_thaw_busy"] = _summary(thaw)
    finally:
        proc.kill()
        proc.wait()


def bench_exit(results: dict[str, object]) -> None:
    watcher = ExitWatcher().start()
    child, nonchild = [], []
    try:
        for _ in range(CYCLES // 2):
            proc = subprocess.Popen(["sleep", "60"])
            watcher.watch(proc)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGKILL)
            watcher.exits.get(timeout=5)
            child.append(time.perf_counter() - t0)

            out = subprocess.run(
                ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            pid = int(out.stdout)
            watcher.watch(pid)
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            watcher.exits.get(timeout=5)
            nonchild.append(time.perf_counter() - t0)
    finally:
        watcher.stop()
    results["exit_notice_child"] = _summary(child)
    results["exit_notice_nonchild_pidfd"] = _summary(nonchild)


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    results: dict[str, object] = {"cycles": CYCLES, "kernel": os.uname().release}
    bench_cgroup(results)
    bench_signal(results)
    bench_exit(results)
    for key, value in results.items():
        print(f"{key:32} {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
