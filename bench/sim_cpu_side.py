"""What-if: CPU time of the training loop or of the inference server, which the model leaves out.

Issue 13's time-slicing item (a server at load 0.5 stays stable next to a trainer) fails in the
model because a trainer always has GPU work. This benchmark asks how much CPU-side time would be
needed to change that, on the 12 Tally-shaped pairs (``bench/sim_validation.py``), by patching
two hypothetical mechanisms into the simulator **for this process only** (the shipped model has
neither; docs/simulator.md section 4 says why):

* ``--trainer-gap F``: after each training iteration the trainer's GPU idles ``F`` x the
  iteration's kernel time while its CPU works (data loading, ``loss.item()``, optimiser host work)
  before it issues the next iteration.
* ``--server-cpu C``: the inference server's CPU issues source kernel ``j`` of a request at
  ``start + (j + 1) C`` seconds (PyTorch's per-op CPU cost); a merged chunk is issuable once its
  last source kernel is. The pair's load is taken against the request time alone,
  ``max(kernel time, kernels x C)``, as a measured standalone latency would be.

Prints the median and max of p99 over p99 alone per baseline, and the Orion plain-MPS point for
each trainer gap, and writes ``bench/results/sim_cpu_side.json``. It forces the Python engine
(``GPUSHARE_SIM_ENGINE=python``): the patches are written against the source.

    python bench/sim_cpu_side.py --jobs 2 --duration 10 --trainer-gap 0 0.1 0.25 0.5
    python bench/sim_cpu_side.py --jobs 2 --duration 10 --server-cpu 0 20e-6 40e-6 60e-6
"""

from __future__ import annotations

import argparse
import itertools
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

from gpushare.sim import data, engine, scenario, workloads
from gpushare.sim import node as simnode

RESULTS = Path(__file__).resolve().parent / "results" / "sim_cpu_side.json"

#: The hypothesis patched in for the current run (set in each worker before it runs a pair).
SETTING: dict[str, float] = {"trainer_gap": 0.0, "server_cpu_s": 0.0}
#: Request time alone over kernel time, per online profile of the current pair.
FACTOR: dict[str, float] = {}

_trainer_done = workloads.OfflineTrainer.on_kernel_done
_server_begin = workloads.OnlineServer._begin_next
_server_done = workloads.OnlineServer.on_kernel_done
_arrivals_for = simnode.arrivals_for


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


def _hold_until_issued(server: workloads.OnlineServer, p: int, now: float) -> None:
    """Withhold chunk ``p`` until the server's CPU has issued its last source kernel."""
    cum = server.__dict__.setdefault("_cpu_cum", list(itertools.accumulate(server._counts)))
    t = server.__dict__["_cpu_t0"] + SETTING["server_cpu_s"] * cum[p]
    if t > now:
        server.nxt = None
        server.gpu.loop.at(t, server._launched_one, (server._gate, p))


def _server_begin_next(self: workloads.OnlineServer, now: float) -> None:
    _server_begin(self, now)
    if SETTING["server_cpu_s"] > 0 and self.pos == 0 and self.nxt is not None:
        self.__dict__["_cpu_t0"] = now
        _hold_until_issued(self, 0, now)


def _server_on_kernel_done(self: workloads.OnlineServer, now: float) -> None:
    _server_done(self, now)
    if SETTING["server_cpu_s"] > 0 and self.nxt is not None and self.pos > 0:
        _hold_until_issued(self, self.pos, now)


def _arrivals(spec: Any, standalone_s: float, seed: int, end_s: float) -> Any:
    return _arrivals_for(spec, standalone_s * FACTOR.get(spec.profile, 1.0), seed, end_s)


def _patch() -> None:
    workloads.OfflineTrainer.on_kernel_done = _trainer_on_kernel_done  # type: ignore[method-assign]
    workloads.OnlineServer._begin_next = _server_begin_next  # type: ignore[method-assign]
    workloads.OnlineServer.on_kernel_done = _server_on_kernel_done  # type: ignore[method-assign]
    simnode.arrivals_for = _arrivals


def _set(setting: dict[str, float], sc: scenario.Scenario) -> None:
    SETTING.update(setting)
    FACTOR.clear()
    c = setting["server_cpu_s"]
    for o in sc.online:
        prof = data.load_profile(o.profile, sc.gpu.merge_online_us, sc.gpu.sm_count)
        kernels = sum(len(part) for part in prof.parts) or len(prof)
        FACTOR[o.profile] = max(1.0, kernels * c / prof.total_s)


def _pair(args: tuple[dict[str, float], str, float]) -> dict[str, float]:
    setting, name, duration = args
    _patch()
    _set(setting, scenario.load(name))
    return sv.pair_inflation((name, {}, duration))


def _orion(setting: dict[str, float]) -> dict[str, float]:
    _patch()
    SETTING.update(setting)
    FACTOR.clear()
    return sv.orion({})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per pair (default 10)")
    ap.add_argument("--trainer-gap", type=float, nargs="*", default=[])
    ap.add_argument("--server-cpu", type=float, nargs="*", default=[], help="seconds per kernel")
    args = ap.parse_args(argv)
    if engine.loaded() != "python":
        print(f"the {engine.loaded()} engine is loaded; this what-if patches the Python engine")
        return 2
    settings = [{"trainer_gap": g, "server_cpu_s": 0.0} for g in args.trainer_gap]
    settings += [{"trainer_gap": 0.0, "server_cpu_s": c} for c in args.server_cpu]
    pairs = [n for n in scenario.shipped() if n.startswith(sv.PAIR_PREFIXES)]
    rows: list[dict[str, Any]] = []
    with Pool(args.jobs) as pool:
        for setting in settings:
            res = pool.map(_pair, [(setting, n, args.duration) for n in pairs])
            row: dict[str, Any] = dict(setting, duration_s=args.duration)
            for b in sv.BASELINES:
                vals = [r[b] for r in res]
                row[b] = {"median": statistics.median(vals), "max": max(vals)}
            if setting["server_cpu_s"] == 0.0:
                row["orion"] = pool.apply(_orion, (setting,))
            rows.append(row)
            print(json.dumps(row), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
