"""What-if: CPU time in the training loop, which the model leaves out.

Issue 13's time-slicing item (a server at load 0.5 stays stable next to a trainer) turns on how
much of the time each side leaves the GPU idle. The inference server's CPU time is in the model
(its host cost per kernel, W3, calibrated on published standalone latencies); the trainer's is
not. This benchmark asks what a CPU gap in the training loop would change, on the 12
Tally-shaped pairs (``bench/sim_validation.py``), by patching it into the simulator **for this
process only** (docs/simulator.md section 4 says why the shipped model has none):

* ``--trainer-gap F``: after each training iteration the trainer's GPU idles ``F`` x the
  iteration's kernel time while its CPU works (data loading, ``loss.item()``, optimiser host work)
  before it issues the next iteration.

Prints the median and max of p99 over p99 alone per baseline, and the Orion plain-MPS point for
each trainer gap, and writes ``bench/results/sim_cpu_side.json``. It forces the Python engine
(``GPUSHARE_SIM_ENGINE=python``): the patch is written against the source. The server's host
cost across its range is a setting of ``bench/sim_validation.py`` (no patch needed).

    python bench/sim_cpu_side.py --jobs 2 --duration 10 --trainer-gap 0 0.1 0.25 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Chosen when gpushare.sim is first imported, so before the imports below.
os.environ["GPUSHARE_SIM_ENGINE"] = "python"

import sim_validation as sv

from gpushare.sim import engine, scenario, workloads

RESULTS = Path(__file__).resolve().parent / "results" / "sim_cpu_side.json"

#: The hypothesis patched in for the current run (set in each worker before it runs a pair).
SETTING: dict[str, float] = {"trainer_gap": 0.0}

_trainer_done = workloads.OfflineTrainer.on_kernel_done


def _trainer_on_kernel_done(self: workloads.OfflineTrainer, now: float) -> None:
    gap = SETTING["trainer_gap"]
    if gap <= 0 or self.pos + 1 < self._n:
        _trainer_done(self, now)
        return
    # The iteration's last kernel: record it, then idle while the CPU works before issuing.
    self.counts.done += 1
    self.pos = self._n
    self.nxt = None
    self.iterations.append(now)
    gate = self._gate

    def resume(_: object) -> None:
        if gate == self._gate:
            self._maybe_issue(self.gpu.loop.now)
            self.gpu.wake()

    self.gpu.loop.at(now + gap * self.profile.total_s, resume, None)


def _patch() -> None:
    workloads.OfflineTrainer.on_kernel_done = _trainer_on_kernel_done  # type: ignore[method-assign]


def _pair(args: tuple[dict[str, float], str, float]) -> dict[str, float]:
    setting, name, duration = args
    _patch()
    SETTING.update(setting)
    return sv.pair_inflation((name, {}, duration))


def _orion(setting: dict[str, float]) -> dict[str, float]:
    _patch()
    SETTING.update(setting)
    return sv.orion({})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per pair (default 10)")
    ap.add_argument("--trainer-gap", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5])
    args = ap.parse_args(argv)
    if engine.loaded() != "python":
        print(f"the {engine.loaded()} engine is loaded; this what-if patches the Python engine")
        return 2
    settings = [{"trainer_gap": g} for g in args.trainer_gap]
    pairs = [n for n in scenario.shipped() if n.startswith(sv.PAIR_PREFIXES)]
    rows: list[dict[str, Any]] = []
    with Pool(args.jobs) as pool:
        for setting in settings:
            res = pool.map(_pair, [(setting, n, args.duration) for n in pairs])
            row: dict[str, Any] = dict(setting, duration_s=args.duration)
            for b in sv.BASELINES:
                vals = [r[b] for r in res]
                row[b] = {"median": statistics.median(vals), "max": max(vals)}
            row["orion"] = pool.apply(_orion, (setting,))
            rows.append(row)
            print(json.dumps(row), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
