"""What-if: grids of equal-priority MPS clients dispatched FIFO by submission (not the model).

The model (docs/simulator.md G5/G6) is gentler on plain MPS than two measurements: Orion's V100
point (ResNet-50 b4 inference next to ResNet-50 b32 training) and a LithOS reproduction on an
A100 (gpushare/data/validation/README.md). One hypothesis for both: the hardware queues grids of
equal-priority clients closer to FIFO by submission. This benchmark patches that rule into the
simulator **for this process only** (the model's source is unchanged) and runs the points
under the model as shipped and under the variant.

Two variants, both patched at a kernel's completion (``Gpu.complete``) and at the dispatch
(``Gpu.dispatch``):

* ``fifo-order`` (reorder only):

  - **submission time**: an asynchronous client's next grid was queued by its CPU no later than
    the moment its current grid started (queue depth one: the CPU launches faster than the GPU
    runs). So when a kernel completes and its stream's next kernel is issued, that kernel's
    submission time becomes the start of the kernel that just completed, not the completion
    (a trainer: always, iterations are not synchronised in the model; a server: within one
    request; a launch-blocking client: never, its next launch follows the completion);
  - **no deferral**: the model serves the next kernel of the stream whose kernel just completed
    after every other waiter (its dependency resolves while the block scheduler refills the
    slots). Under FIFO by submission an earlier-submitted grid goes first, so when every other
    waiter has the completing stream's priority the dispatch is plain (priority, submission)
    order. With a waiter of another priority the model's rule is kept (priorities are not in
    question here), so ``mps-priority`` should not move.

* ``fifo`` (the hypothesis in full): ``fifo-order`` plus **hold-back**: a grid not yet started
  gets no slots, even free ones, while another client of its priority has an earlier-submitted
  grid that has not dispatched all its blocks: a running kernel not yet in its last wave, or the
  grid queued behind a running kernel (submitted when that kernel started). So a small grid
  submitted during a long kernel's last wave waits until the next long kernel's last wave.

What is not changed: a running grid keeps its slots to its end (a later grid of the same priority
still enters the slots its last, partial wave leaves: G6), and higher priority still goes first.

Points: Orion's plain-MPS point (3 seeds, as bench/sim_validation.py), ``trtlab-mps-8`` and
``t4-mps-5`` (gpushare/sim/validation.py), the LithOS set-up (an A100 with 108 SMs: a closed-loop
client launching one 16-block 9 us kernel, then sleeping 300 us, next to a client launching one
kernel of G blocks back to back, both as one-kernel profiles; the BE batches of 20 and their
synchronisation are left out), and the median and max of p99 over p99 alone under ``mps`` and
``mps-priority`` over the Tally-shaped pairs (bench/sim_pairs.py's set). It forces the Python
engine (``GPUSHARE_SIM_ENGINE=python``): the patch replaces methods of the source class.

    python bench/mps_dispatch_whatif.py --jobs 2 --duration 10

Writes ``bench/results/mps_dispatch_whatif.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Chosen when gpushare.sim is first imported, so before the imports below.
os.environ["GPUSHARE_SIM_ENGINE"] = "python"

import dataclasses  # noqa: E402

from gpushare import logs  # noqa: E402
from gpushare.cli.sim_run import make_policies  # noqa: E402
from gpushare.sim import data, engine, runner, scenario, validation, workloads  # noqa: E402
from gpushare.sim.gpu import EventLoop, Gpu, Run, Stream  # noqa: E402
from gpushare.stats import percentile  # noqa: E402

PAIR_PREFIXES = ("pairs/bert_2_fwd+", "pairs/transformer_xl_4_fwd+")
POLICIES = ("mps", "mps-priority")
VARIANTS = ("model", "fifo-order", "fifo")
#: Whether the installed variant holds later grids back (``fifo``) or only reorders them.
HOLD = {"on": False}
RESULTS = REPO / "bench" / "results" / "mps_dispatch_whatif.json"

#: LithOS reproduction (README of gpushare/data/validation): BE grid blocks, BE kernel ms, and
#: the measured HP p50/p99 in us (p50 published for the longest kernel only).
LITHOS = (
    (512, 0.04, None, 28.6),
    (2048, 0.24, None, 130.0),
    (8192, 2.2, None, 1869.0),
    (20000, 10.8, 10419.0, 10473.0),
)
A100_SMS = 108
#: Blocks of 128 threads per SM at full occupancy (2,048 threads per A100 SM).
BLOCKS_PER_SM = 16

_orig_complete = Gpu.complete
_orig_dispatch = Gpu.dispatch


def _waits(s: Stream) -> bool:
    r = s.run
    return (r is None and s.nxt is not None) or (r is not None and r.g < r.want)


def _queued_since(s: Stream) -> float | None:
    """When the grid queued behind the stream's running kernel was submitted, or None (none)."""
    c = s.client
    if s.run is None or getattr(c, "launch_blocking", False):
        return None
    if isinstance(c, workloads.OfflineTrainer):
        if not c.active or c.frozen:
            return None
    elif getattr(c, "pos", 0) >= getattr(c, "_n", 0) - 1:
        return None  # a server's last kernel of a request: the next request is not launched
    return float(getattr(s, "_fifo_start", s.run.since))


def _dispatching(r: Run, now: float) -> bool:
    """Whether a running kernel still has blocks to dispatch (it is not in its last wave)."""
    ws = r.wave_s
    if not 0.0 < ws < r.dur_s or r.g < r.want:
        return r.g < r.want
    end = now + (r.remaining - (now - r.last_s) * r.rate) / r.rate
    return now < end - ws - 1e-12


def _fifo_dispatch(self: Gpu, completing: Stream | None = None) -> None:
    """The model's dispatch with later-submitted equal-priority grids held back (module doc)."""
    now = self.loop.now
    held: list[tuple[Stream, Any]] = []
    blockers: list[Run] = []
    if HOLD["on"] and not self.time_sliced:
        for x in self.streams:
            if x.run is not None or x.nxt is None:
                continue
            since = x.eligible_since
            for s in self.streams:
                r = s.run
                if s is x or r is None or s.priority != x.priority:
                    continue
                q = _queued_since(s)
                if (q is not None and q < since) or (r.since < since and _dispatching(r, now)):
                    held.append((x, x.nxt))
                    x.nxt = None
                    blockers.append(r)
                    break
    try:
        _orig_dispatch(self, completing)
    finally:
        for x, nxt in held:
            x.nxt = nxt
    now = self.loop.now
    for s in self.streams:
        r = s.run
        if r is not None and getattr(s, "_fifo_kseq", -1) != r.kseq:
            s._fifo_kseq = r.kseq  # type: ignore[attr-defined]
            s._fifo_start = now  # type: ignore[attr-defined]
    # A held grid is looked at again when a blocker completes (a dispatch) or its last, partial
    # wave starts: arm that event as waves.arm_waves would for a waiter of the blocker's priority.
    for r in blockers:
        if r.stream.run is r and r.g > 0 and r.tail < 1.0 and not r.tail_armed:
            ws = r.wave_s
            if 0.0 < ws < r.dur_s:
                r.tail_armed = True
                end = now + (r.remaining - (now - r.last_s) * r.rate) / r.rate
                t_tail = max(end - ws, now)
                self.loop.at(t_tail, self.tail_start, (r, r.kseq))


def _fifo_complete(self: Gpu, run: Run) -> None:
    """``Gpu.complete`` with the variant's submission time and no deferral (module doc)."""
    stream = run.stream
    started = getattr(stream, "_fifo_start", run.since)
    self.account()
    self.free += run.g
    self.runs.remove(run)
    stream.run = None
    self.stats.kernels_done += 1
    client = stream.client
    client.on_kernel_done(self.loop.now)
    queued = stream.nxt is not None and not getattr(client, "launch_blocking", False)
    if queued and (isinstance(client, workloads.OfflineTrainer) or getattr(client, "pos", 0) > 0):
        stream.eligible_since = min(stream.eligible_since, started)
    others = [s for s in self.streams if s is not stream and _waits(s)]
    if others and all(s.priority == stream.priority for s in others):
        self.dispatch(None)  # plain (priority, submission) order
    else:
        self.dispatch(stream)  # the model's rule (fast path or deferral)


def set_variant(name: str) -> None:
    """Install the variant's methods on the Python ``Gpu`` class, or the model's."""
    HOLD["on"] = name == "fifo"
    if name in ("fifo", "fifo-order"):
        Gpu.complete = _fifo_complete  # type: ignore[method-assign]
        Gpu.dispatch = _fifo_dispatch  # type: ignore[method-assign]
    else:
        Gpu.complete = _orig_complete  # type: ignore[method-assign]
        Gpu.dispatch = _orig_dispatch  # type: ignore[method-assign]


class ClosedLoop(workloads.OnlineServer):
    """LithOS's HP client: launch one kernel, synchronise, sleep ``think_s``, again."""

    think_s = 300e-6

    def on_kernel_done(self, now: float) -> None:
        """Advance; when a request completes, the next one arrives ``think_s`` later."""
        done = len(self.completed)
        super().on_kernel_done(now)
        if len(self.completed) > done:
            t = now + self.think_s
            self._loop.at(t, self._arrive, t)


def lithos(variant: str, blocks: int, be_ms: float, end_s: float) -> dict[str, float]:
    """HP p50/p99 (us) next to back-to-back BE kernels of ``blocks`` blocks, plain MPS, A100."""
    set_variant(variant)
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-lithos", index=0, sm_count=A100_SMS)
    # SM_usage in full-occupancy V100 SMs, as the wave rule reads it (G6): chosen so that the
    # rule's wave count is the A100's, blocks / (16 x 108).
    u_be = round(blocks / BLOCKS_PER_SM * data.PROFILE_SM_COUNT / A100_SMS)
    be = data.merge_kernels([(be_ms * 1e3, A100_SMS, 0.5, u_be)], 0.0, "be", A100_SMS)
    hp = data.merge_kernels([(9.0, 1, 0.5, 1)], 0.0, "hp", A100_SMS)
    server = ClosedLoop("hp", gpu, hp, iter([1e-3]), sm_pct=100, mem_bytes=0)
    gpu.attach(server)
    server.start(loop)
    train = workloads.OfflineTrainer("be", gpu, be, sm_pct=100, mem_bytes=0)
    train.priority = 0  # plain MPS: no client priority
    train.start(0.0)
    loop.run_until(end_s)
    lats = [lat * 1e6 for arr, lat in server.completed if arr >= 0.05]
    return {
        "p50_us": percentile(lats, 50),
        "p99_us": percentile(lats, 99),
        "requests": len(lats),
    }


def points(variant: str) -> dict[str, Any]:
    """Orion, trtlab-mps-8, t4-mps-5 and the LithOS set-up under one variant."""
    set_variant(variant)
    runs = [validation.orion_point(s) for s in (1, 2, 3)]
    pts = validation.load_points()
    r50 = data.load_profile(f"{validation.ORION}/resnet50_4_fwd.csv")
    trt = pts["trtlab-mps-8"]
    t4 = pts["t4-mps-5"]
    out: dict[str, Any] = {
        "orion": {
            "p50_ms": statistics.fmean(r.p50_ms for r in runs),
            "p99_ms": statistics.fmean(r.p99_ms for r in runs),
            "train_it_s": statistics.fmean(r.train_it_s for r in runs),
        },
        "trtlab_mps_8": validation.throughput_gain(r50, trt.clients, mode="mps", sm_count=trt.sms),
        "t4_mps_5": validation.closed_loop_ratio(
            validation.spin_kernel(t4.measured_alone),
            t4.clients,
            mode="mps",
            sm_count=t4.sms,
            iterations=1,
        ),
        "lithos": [],
    }
    for blocks, ms, _, _ in LITHOS:
        # At least ~150 HP requests after the warm-up.
        end_s = max(0.2, 150 * (ms * 1e-3 + 300e-6))
        out["lithos"].append({"blocks": blocks, "be_ms": ms, **lithos(variant, blocks, ms, end_s)})
    return out


def pair(args: tuple[str, str, float]) -> dict[str, Any]:
    """p99 over p99 alone of one pair under mps and mps-priority, under one variant."""
    variant, name, duration = args
    set_variant(variant)
    sc = scenario.load(name)
    sc = dataclasses.replace(sc, duration_s=duration)
    alone, slo = runner.standalone(sc)
    assert alone is not None
    out: dict[str, Any] = {"pair": name}
    for pname, policy in make_policies(list(POLICIES), sc.config.control):
        res = runner.run_policy(sc, policy, name=pname, slo_ms=slo)
        out[pname] = res.online[0].p99_ms / alone.online[0].p99_ms
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=10.0, help="virtual seconds per pair run")
    ap.add_argument("--no-pairs", action="store_true", help="skip the Tally-shaped pairs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    logs.configure_logging("warning")
    wall0 = time.perf_counter()
    pts = validation.load_points()
    doc: dict[str, Any] = {
        "command": "python bench/mps_dispatch_whatif.py " + " ".join(sys.argv[1:]),
        "engine": engine.loaded(),
        "measured": {
            "orion": {"p50_ms": 64.4, "p99_ms": 181.0},
            "trtlab_mps_8": pts["trtlab-mps-8"].ratio,
            "t4_mps_5": pts["t4-mps-5"].ratio,
            "lithos": [
                {"blocks": b, "be_ms": ms, "p50_us": p50, "p99_us": p99}
                for b, ms, p50, p99 in LITHOS
            ],
        },
        "variants": {},
    }
    pairs = [n for n in scenario.shipped() if n.startswith(PAIR_PREFIXES)]
    doc["pairs"] = len(pairs)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {v: pool.submit(points, v) for v in VARIANTS}
        pair_res: dict[str, list[dict[str, Any]]] = {}
        if not args.no_pairs:
            for v in VARIANTS:
                pair_res[v] = list(pool.map(pair, [(v, n, args.duration) for n in pairs]))
        for v in VARIANTS:
            row = futs[v].result()
            if v in pair_res:
                for p in POLICIES:
                    vals = [r[p] for r in pair_res[v]]
                    row[p] = {
                        "median": statistics.median(vals),
                        "max": max(vals),
                        "pairs": {r["pair"]: r[p] for r in pair_res[v]},
                    }
            doc["variants"][v] = row
    m = doc["measured"]
    print(
        "| rule | Orion p50 ms | Orion p99 ms | trtlab-mps-8 gain | t4-mps-5 ratio | "
        "LithOS 10.8 ms p50 / p99 us | LithOS p99 us (0.04 / 0.24 / 2.2 ms) | "
        "pairs mps | pairs mps-priority |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    lm = m["lithos"]
    print(
        f"| measured | {m['orion']['p50_ms']:.1f} | {m['orion']['p99_ms']:.0f} | "
        f"{m['trtlab_mps_8']:.2f}x | {m['t4_mps_5']:.2f} | "
        f"{lm[3]['p50_us']:.0f} / {lm[3]['p99_us']:.0f} | "
        f"{lm[0]['p99_us']:.0f} / {lm[1]['p99_us']:.0f} / {lm[2]['p99_us']:.0f} | - | - |"
    )
    for v in VARIANTS:
        r = doc["variants"][v]
        li = r["lithos"]
        cells = " | ".join(
            f"{r[p]['median']:.2f}x (max {r[p]['max']:.1f}x)" if p in r else "-" for p in POLICIES
        )
        print(
            f"| {v} | {r['orion']['p50_ms']:.1f} | {r['orion']['p99_ms']:.0f} | "
            f"{r['trtlab_mps_8']:.2f}x | {r['t4_mps_5']:.2f} | "
            f"{li[3]['p50_us']:.0f} / {li[3]['p99_us']:.0f} | "
            f"{li[0]['p99_us']:.0f} / {li[1]['p99_us']:.0f} / {li[2]['p99_us']:.0f} | {cells} |"
        )
    doc["wall_s"] = time.perf_counter() - wall0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s, engine {doc['engine']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
