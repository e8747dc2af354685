"""On a GPU host: how long a frozen client keeps the GPU busy (docs/design.md §2, the freezer's limit).

Usage (root, a GPU, any command that keeps the GPU busy, e.g. a training script):

    sudo .venv/bin/python bench/freeze_gpu_lag.py [--gpu 0] [--cycles 5] -- CMD ARGS...

The command runs in a fresh client cgroup (spawned into it before exec). After a warm-up the script
freezes it and measures the time until ``nvidia-smi`` reports 0 % utilisation on that GPU (the
queued-kernel backlog draining), then thaws and waits for the GPU to be busy again. Prints the lag
per cycle and writes ``bench/results/freeze_gpu_lag.json``. Without nvidia-smi, a workload or a
cgroup freezer it prints why it skipped and exits 0 (so ``make bench`` passes on CPU-only hosts).
Sampling granularity is nvidia-smi's (its utilisation is averaged over up to ~1/6 s on many GPUs),
so read the numbers as an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from gpushare.node.cgroups.choice import make_pauser
from gpushare.node.cgroups.discovery import own_cgroup
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.procs.spawning import spawn

RESULTS = Path(__file__).resolve().parent / "results" / "freeze_gpu_lag.json"


def _utilisation(smi: str, gpu: str) -> int | None:
    out = subprocess.run(
        [smi, "-i", gpu, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=5, check=False,
    )  # fmt: skip
    try:
        return int(out.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


def _wait_util(smi: str, gpu: str, busy: bool, timeout_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        util = _utilisation(smi, gpu)
        if util is not None and ((util > 0) if busy else (util == 0)):
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else args.command
    smi = shutil.which("nvidia-smi")
    if smi is None:
        print("skipped: nvidia-smi not found (run this on a GPU host)")
        return 0
    if not command:
        print("skipped: no GPU workload given after '--'")
        return 0
    own = own_cgroup()
    if own is None:
        print("skipped: no cgroup v2, the freezer cannot be measured here")
        return 0
    base = own / f"gpushare-gpulag-{uuid.uuid4().hex[:6]}"
    choice = make_pauser(base)
    if not isinstance(choice.pauser, CgroupPauser):
        print(f"skipped: no cgroup freezer: {choice.reason}")
        return 0
    pauser = choice.pauser
    fd = pauser.open_procs_fd("gpu")
    try:
        proc = spawn(
            command, uid=os.getuid(), gid=os.getgid(), cwd=os.getcwd(),
            env=dict(os.environ), log_path=RESULTS.with_suffix(".log"), cgroup_procs_fd=fd,
        )  # fmt: skip
    finally:
        os.close(fd)
    lags: list[float | None] = []
    try:
        time.sleep(args.warmup_s)
        for _ in range(args.cycles):
            if _wait_util(smi, args.gpu, busy=True, timeout_s=30) is None:
                print("the workload never made the GPU busy; is it a CUDA program?")
                break
            time.sleep(1.0)
            pauser.freeze("gpu")
            lags.append(_wait_util(smi, args.gpu, busy=False, timeout_s=30))
            pauser.thaw("gpu")
            time.sleep(2.0)
    finally:
        pauser.kill("gpu")
        proc.wait()
        pauser.release("gpu")
        base.rmdir()
    done = [x for x in lags if x is not None]
    result = {
        "command": command,
        "gpu": args.gpu,
        "lag_s": lags,
        "lag_median_s": statistics.median(done) if done else None,
        "lag_max_s": max(done) if done else None,
    }
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
