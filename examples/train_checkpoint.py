#!/usr/bin/env python3
r"""A PyTorch training job that loses nothing when gpushare restarts it.

gpushare restarts a ``--restartable`` offline job to apply a new SM share (MPS fixes a client's
share when it connects) and requeues it after an eviction: it sends the job its checkpoint signal
(``submit --checkpoint-signal``, SIGUSR1 by default), waits for it to exit, and relaunches the
same command. A job loses nothing when it does three things, all of them here:

1. **Checkpoint on the signal, at an iteration boundary.** The handler only sets a flag; the
   training loop finishes the iteration in progress, saves, and exits 0. Saving from inside the
   handler could catch the model half-updated.
2. **Save atomically.** Write to a temporary file in the same directory, flush it to disk, then
   ``os.replace`` it over the checkpoint: a job killed mid-save (gpushare sends SIGKILL after
   ``control.evict_grace`` when an evicted job does not exit) leaves the previous checkpoint whole.
3. **Resume from the checkpoint at start.** Model, optimizer, the iteration counter and the
   random state; then carry on from the next iteration.

Also save every ``--every`` iterations, so a crash (or a SIGKILL) loses at most that many.

Usage (as gpushare runs it)::

    gpushare submit --offline --restartable -- \
        python3 examples/train_checkpoint.py --checkpoint /path/ckpt.pt --iterations 100000

Each completed iteration appends ``<pid> <iteration> <loss>`` to ``--log`` (when given), which
the test (tests/daemon/test_e2e_torch_restart.py) reads. Runs on the CPU when no GPU is visible.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch
from torch import nn

_stop = False


def _ask_to_stop(signum: int, frame: FrameType | None) -> None:
    """The checkpoint signal: stop at the end of the iteration in progress."""
    global _stop
    _stop = True


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, iteration: int) -> None:
    """Write the checkpoint atomically (a temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    state = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
    }
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The last completed iteration saved in ``path`` (0: none), with the state restored."""
    if not path.exists():
        return 0
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["iteration"])


def main() -> int:
    """Train, checkpointing on the signal and every ``--every`` iterations; resume at start."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint file")
    ap.add_argument("--iterations", type=int, default=1000, help="train this many iterations")
    ap.add_argument("--every", type=int, default=50, help="also checkpoint every N iterations")
    ap.add_argument("--log", type=Path, help="append '<pid> <iteration> <loss>' per iteration")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per iteration (a slow job)")
    ap.add_argument("--signal", default="SIGUSR1", help="the checkpoint signal (submit's)")
    args = ap.parse_args()

    signal.signal(getattr(signal, args.signal), _ask_to_stop)
    signal.signal(signal.SIGTERM, _ask_to_stop)  # a plain stop: save as well
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = load(args.checkpoint, model, opt)
    print(f"train_checkpoint: resuming after iteration {done}", file=sys.stderr, flush=True)
    x = torch.randn(256, 32, device=device)
    y = x.sum(dim=1, keepdim=True)
    log = open(args.log, "a", buffering=1) if args.log else None  # noqa: SIM115
    try:
        for it in range(done + 1, args.iterations + 1):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if args.sleep:
                time.sleep(args.sleep)
            if log is not None:
                log.write(f"{os.getpid()} {it} {loss.item():.6f}\n")
            if _stop or it % args.every == 0 or it == args.iterations:
                save(args.checkpoint, model, opt, it)
            if _stop:
                print(f"train_checkpoint: saved iteration {it}, exiting", file=sys.stderr)
                return 0
    finally:
        if log is not None:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
