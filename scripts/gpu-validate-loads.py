"""The GPU workloads scripts/gpu-validate.sh measures: a small inference loop and a training loop.

Both are ResNet-50 (torchvision, random weights), the model of the simulator's
``resnet50-inference`` and ``resnet50-train`` profiles, so what they measure calibrates it:

- ``infer``: requests of batch 1 arrive at a fixed rate (``--rps``); each request's latency is
  from its arrival to its result on the host (queueing behind a late request included). Writes
  p50/p99/mean and the count as JSON. Under gpushare (``$GPUSHARE_CLIENT_ID`` set by ``gpushare
  submit``) it reports each latency and marks each request's boundaries, as a service would.
- ``train``: batch 32 forward, backward and SGD step until SIGTERM or ``--seconds``; writes its
  iterations per second (and rewrites the file every 2 s, so a killed run leaves a number).
- ``step``: ``--iters`` timed training steps after a warm-up: ms per iteration, the number
  docs/gpu-validation.md's Q1 compares between deep, bounded, one-in-flight and blocking queues.

Usage: ``python scripts/gpu-validate-loads.py {infer,train,step} --out FILE [options]``. Needs
torch and torchvision; exits 3 with one line when they are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EXIT_NO_TORCH = 3


def _torch() -> tuple[Any, Any]:
    try:
        import torch
        import torchvision
    except ImportError as exc:
        print(f"gpu-validate-loads: torch/torchvision not installed ({exc})", file=sys.stderr)
        raise SystemExit(EXIT_NO_TORCH) from exc
    return torch, torchvision


def _write(out: Path, result: dict[str, Any]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(out)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def _gpushare_request() -> Iterator[Callable[[float], None]]:
    """Report to gpushare when submitted by it; otherwise do nothing."""
    if not os.environ.get("GPUSHARE_CLIENT_ID"):
        yield lambda _s: None
        return
    from gpushare import client

    client.request_started()
    try:
        yield client.report_latency
    finally:
        client.request_ended()


def infer(args: argparse.Namespace) -> dict[str, Any]:
    """Fixed-rate batch-1 ResNet-50 requests; latency from arrival to result."""
    torch, tv = _torch()
    model = tv.models.resnet50().cuda().eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        for _ in range(20):  # cudnn autotuning, allocator warm-up
            model(x.cuda()).cpu()
        torch.cuda.synchronize()
        period_s = 1.0 / args.rps
        start_unix_s = time.time()
        start = time.perf_counter()
        arrival = start
        latencies: list[float] = []
        while arrival - start < args.seconds:
            time.sleep(max(0.0, arrival - time.perf_counter()))
            with _gpushare_request() as report:
                model(x.cuda(non_blocking=True)).argmax().item()
                latency_s = time.perf_counter() - arrival
                report(latency_s)
            latencies.append(latency_s)
            arrival += period_s
    ms = [v * 1e3 for v in latencies]
    return {
        "start_unix_s": round(start_unix_s, 3),
        "end_unix_s": round(time.time(), 3),
        "requests": len(ms),
        "rps": args.rps,
        "p50_ms": round(_quantile(ms, 0.5), 3),
        "p99_ms": round(_quantile(ms, 0.99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "max_ms": round(max(ms), 3),
    }


def _trainer(torch: Any, tv: Any, batch: int) -> Callable[[], None]:
    model = tv.models.resnet50().cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, 3, 224, 224, device="cuda")

    def it() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return it


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Training steps until SIGTERM or the deadline; iterations per second.

    ``samples`` holds ``[unix time, iterations done]`` about every half second, so the rate over
    any window (the seconds an inference loop ran beside it) can be read off.
    """
    torch, tv = _torch()
    it = _trainer(torch, tv, args.batch)
    for _ in range(5):
        it()
    torch.cuda.synchronize()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    start = last_write = last_sample = time.perf_counter()
    done = 0
    samples: list[list[float]] = [[round(time.time(), 3), 0]]
    result: dict[str, Any] = {"batch": args.batch, "iters": 0, "iters_per_s": None}
    while not stop["now"] and time.perf_counter() - start < args.seconds:
        it()
        done += 1
        if time.perf_counter() - last_sample < 0.5:
            continue
        torch.cuda.synchronize()
        last_sample = now = time.perf_counter()
        if len(samples) < 1000:
            samples.append([round(time.time(), 3), done])
        rate = round(done / (now - start), 3)
        result = {"batch": args.batch, "iters": done, "iters_per_s": rate, "samples": samples}
        if now - last_write > 2.0:
            _write(args.out, result)
            last_write = now
    return result


def step(args: argparse.Namespace) -> dict[str, Any]:
    """Milliseconds per training step after a warm-up (docs/gpu-validation.md, Q1)."""
    torch, tv = _torch()
    it = _trainer(torch, tv, args.batch)
    for _ in range(10):
        it()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        it()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / args.iters * 1e3
    return {"batch": args.batch, "iters": args.iters, "ms_per_iter": round(ms, 3)}


def main() -> int:
    """Run one workload and write its JSON result to ``--out``."""
    parser = argparse.ArgumentParser(prog="gpu-validate-loads.py")
    parser.add_argument("load", choices=["infer", "train", "step"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rps", type=float, default=25.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    run = {"infer": infer, "train": train, "step": step}[args.load]
    _write(args.out, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
