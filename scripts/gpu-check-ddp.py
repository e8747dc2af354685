#!/usr/bin/env python3
"""GPU-host check of a 2-GPU DDP job through per-GPU MPS daemons (issue 35, docs/design.md §7).

    sudo .venv/bin/python scripts/gpu-check-ddp.py --mode mps --out ddp_mps.json
    sudo .venv/bin/python scripts/gpu-check-ddp.py --mode plain --out ddp_plain.json

Needs two GPUs and torch with NCCL; never run on the development machines (they have no GPU).
``--mode mps`` starts one ``MpsSupervisor`` per GPU (D1), launches the job with ``torchrun
--nproc-per-node 2`` (this script as the worker), and each worker, before CUDA starts, takes the
pipe directory of the GPU numbered by its ``LOCAL_RANK`` and uses device 0 (design option A, the
per-rank step ``gpushare rank-exec`` would do). ``--mode plain`` is option C's control: each worker
sees its GPU through ``CUDA_VISIBLE_DEVICES``, no MPS. Then, in both modes, it stops rank 1 for two
seconds (SIGSTOP, as a freeze) while both train, to see the model's premise on hardware: a frozen
rank stalls its peer at the next all-reduce.

Expectations (exit 0 only if all hold): every worker sees one device; the all-reduce sums right;
in mps mode each GPU's MPS daemon lists exactly its own rank; rank 0's longest gap between
iterations spans the stop of rank 1 (at least 1.5 s). Writes the numbers (iterations per second,
the gap, what each daemon listed) to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STOP_S = 2.0
RUN_S = 12.0


def worker(args: argparse.Namespace) -> int:
    """One rank: its GPU by LOCAL_RANK, DDP on a small model, iteration times to a JSON file."""
    local = int(os.environ["LOCAL_RANK"])
    if args.mode == "mps":
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = args.pipes.split(",")[local]
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the daemon has it (MPS documentation)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.uuids.split(",")[local]
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    out = Path(args.out_dir) / f"rank{local}.json"
    report: dict[str, object] = {"local_rank": local, "pid": os.getpid()}
    report["device_count"] = torch.cuda.device_count()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)], device="cuda")
    dist.all_reduce(t)
    report["allreduce_ok"] = float(t.item()) == 3.0
    (Path(args.out_dir) / f"started{local}").write_text(str(os.getpid()))
    model = DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda(), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 4096, device="cuda")
    stamps: list[float] = []
    end = time.monotonic() + RUN_S
    while time.monotonic() < end:
        opt.zero_grad()
        model(x).square().mean().backward()  # the gradients' all-reduce waits for the peer
        opt.step()
        torch.cuda.synchronize()
        stamps.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    report["iterations"] = len(stamps)
    report["iter_per_s"] = len(stamps) / RUN_S
    report["max_gap_s"] = max(gaps, default=0.0)
    out.write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


def _gpus() -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.split()


def main() -> int:
    """Run the check (or, with ``--worker``, be one of its ranks)."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=["mps", "plain"], default="mps")
    ap.add_argument("--out", type=Path, default=Path("ddp_check.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pipes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--uuids", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    gpus = _gpus()
    if len(gpus) < 2:
        print(f"SKIP needs two GPUs, this host has {len(gpus)}", flush=True)
        args.out.write_text(json.dumps({"skipped": f"{len(gpus)} GPU(s)"}))
        return 0
    uuids = gpus[:2]
    root = Path(tempfile.mkdtemp(prefix="gsddp", dir="/tmp"))
    sups = []
    if args.mode == "mps":
        from gpushare.config import Config, MpsConfig, PathsConfig
        from gpushare.node.mps import MpsSupervisor

        config = Config(
            paths=PathsConfig(runtime_dir=root, state_dir=root / "state"),
            mps=MpsConfig(compute_mode="leave", quit_timeout_s=5.0, ready_timeout_s=30.0),
        )
        sups = [MpsSupervisor(u, config) for u in uuids]
        for s in sups:
            s.start()
    failures: list[str] = []
    result: dict[str, object] = {"mode": args.mode, "gpus": uuids}

    def expect(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    try:
        pipes = ",".join(str(s.pipe_dir) for s in sups)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker", "--mode", args.mode, "--pipes", pipes,
               "--uuids", ",".join(uuids), "--out-dir", str(root)]  # fmt: skip
        job = subprocess.Popen(cmd)
        started = root / "started1"
        deadline = time.monotonic() + 60
        while not started.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        listed = [[r.client_pid for r in s.control.ps()] for s in sups]
        result["mps_clients"] = listed
        if started.exists():
            time.sleep(3)
            pid1 = int(started.read_text())
            os.kill(pid1, signal.SIGSTOP)  # a freeze of rank 1 (the daemon writes cgroup.freeze)
            time.sleep(STOP_S)
            os.kill(pid1, signal.SIGCONT)
        rc = job.wait(timeout=RUN_S + 90)
        expect(rc == 0, f"torchrun exited 0 (got {rc})")
        ranks = [
            json.loads((root / f"rank{k}.json").read_text())
            for k in range(2)
            if (root / f"rank{k}.json").exists()
        ]
        result["ranks"] = ranks
        expect(len(ranks) == 2, "both ranks reported")
        expect(all(r["device_count"] == 1 for r in ranks), "each rank sees exactly its own GPU")
        expect(
            all(r["allreduce_ok"] for r in ranks), "NCCL all-reduce across the two ranks is right"
        )
        if sups:
            pids = [r["pid"] for r in sorted(ranks, key=lambda r: r["local_rank"])]
            expect(
                len(pids) == 2 and all(lst == [p] for lst, p in zip(listed, pids, strict=True)),
                "each GPU's MPS daemon lists exactly its own rank",
            )
        gap = next((r["max_gap_s"] for r in ranks if r["local_rank"] == 0), 0.0)
        expect(
            gap >= 0.75 * STOP_S,
            f"rank 0 stalled while rank 1 was stopped (longest gap {gap:.2f} s)",
        )
    finally:
        for s in sups:
            s.stop()
    result["failures"] = failures
    args.out.write_text(json.dumps(result, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
