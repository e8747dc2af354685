"""Memory of the daemon's simulated node over a long run (``gpushare daemon --simulate``).

A simulated node serves the daemon for days, so whatever it keeps per request or per probe
launch must be bounded by the windows that read it. This bench drives the real-time node
(``gpushare.sim.realtime.RealTimeSimNode``) on a virtual clock instead of the wall clock, so an
hour of a node takes a minute or two: one online service and one trainer on one GPU, the node
advanced and the probe read once per control period, as the daemon does. It samples the Python
heap (``tracemalloc``) once per simulated minute and reports its growth over the last
``--fit-minutes`` (MiB per simulated minute, least squares), and the lengths of the histories.
Writes ``bench/results/sim_memory.json``.

    python bench/sim_memory.py [--minutes 60] [--fit-minutes 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare.config import Config  # noqa: E402
from gpushare.model import ClientClass  # noqa: E402
from gpushare.sim.realtime import RealTimeSimNode, SimWorkload  # noqa: E402


class _Clock:
    """A clock the bench moves by hand."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def main(argv: list[str] | None = None) -> int:
    """Run, sample and report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=int, default=60, help="simulated minutes (default 60)")
    ap.add_argument("--fit-minutes", type=int, default=40, help="trailing minutes fitted")
    ap.add_argument("--rps", type=float, default=40.0, help="the online service's request rate")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sim_memory.json"))
    args = ap.parse_args(argv)
    clock = _Clock()
    cfg = Config()
    with tempfile.TemporaryDirectory(prefix="gs-simmem-") as run:
        rt = RealTimeSimNode(1, cfg, runtime_dir=Path(run), clock=clock)
        reported = [0]

        def on_latency(_cid: str, _lat: float, _at: float) -> None:
            reported[0] += 1

        rt.on_latency = on_latency
        uuid = rt.gpu_uuids[0]
        rt.add_client("c1", ClientClass.ONLINE, SimWorkload("resnet50-inference", args.rps),
                      gpu_uuid=uuid, sm_pct=100.0, mem_bytes=2 << 30, pid=101, slo_p99_ms=50.0)  # fmt: skip
        rt.add_client("c2", ClientClass.OFFLINE, SimWorkload("resnet50-train"),
                      gpu_uuid=uuid, sm_pct=50.0, mem_bytes=4 << 30, pid=102)  # fmt: skip
        period = cfg.control.period_s
        tracemalloc.start()
        samples: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        steps_per_min = round(60.0 / period)
        for minute in range(1, args.minutes + 1):
            for _ in range(steps_per_min):
                clock.now_s += period
                rt.advance()
                rt.node.probe_reading(uuid)
            mib = tracemalloc.get_traced_memory()[0] / 2**20
            samples.append((float(minute), mib))
            print(f"minute {minute:3d}: heap {mib:7.2f} MiB, {reported[0]} requests reported",
                  flush=True)  # fmt: skip
        wall_s = time.perf_counter() - t0
        (server,) = rt.node.online
        histories = {
            "completed": len(server.completed),
            "served": len(server.served),
            "probe_samples": len(rt.node.probes[uuid].samples),
        }
    fit = samples[-args.fit_minutes :]
    growth = _slope(fit)
    print(f"heap growth over the last {len(fit)} simulated minutes: {growth:.4f} MiB/min "
          f"({growth * 60:.2f} MiB/h); histories kept: {histories}; {wall_s:.0f} s wall")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "minutes": args.minutes, "fit_minutes": len(fit), "rps": args.rps,
        "growth_mib_per_min": growth, "heap_mib_by_minute": samples,
        "histories": histories, "requests_reported": reported[0], "wall_s": wall_s,
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
