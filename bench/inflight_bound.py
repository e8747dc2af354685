"""Bounded in-flight shallow queues against CUDA_LAUNCH_BLOCKING on the simulator (issue 14).

gpushare (request gating on, offline clients ``--queue auto``, so shallow while gating is on) on
the 14 Tally-shaped pairs at each SLO factor, with the shallow queue either

* ``blocking`` (``CUDA_LAUNCH_BLOCKING=1``): one kernel in flight, ``[gpu] launch_gap`` per source
  kernel (docs/simulator.md W3), at each ``--gap-us``; or
* ``bounded`` (the interposer, ``GPUSHARE_MAX_INFLIGHT=k``): at most k kernels in flight, a slot
  freed ``[gpu] inflight_wake`` late (W3b), at each ``--k`` x ``--wake-us``.

``--train-host-us H`` gives the training jobs H of CPU time per kernel (``[gpu]
train_host_per_kernel``, 0 in the model, W3): a deep queue hides it behind the iteration, a
bounded one only within its k kernels, a blocking one pays it per kernel with the gap.

Prints mean SLO attainment (and the worst pair's), mean p99 overhead and mean offline throughput
(of running alone) per cell, and each training profile's run time alone per mode over its
asynchronous time. Writes bench/results/inflight_bound.json.

    .venv/bin/python bench/inflight_bound.py --jobs 1 --k 1 --k 2          # ~1 min per cell

The mode is the daemon's own setting (``[gate] shallow_queue`` and ``inflight_kernels``): the
daemon launches the shallow client with ``GPUSHARE_MAX_INFLIGHT=k`` or ``CUDA_LAUNCH_BLOCKING=1``
and the simulated launcher decodes it; the bench checks per run that every offline launch was
decoded to the mode asked for (or deep, before gating turned on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.control.registry import make_policy  # noqa: E402
from gpushare.sim import adapters, data, report, runner, scenario  # noqa: E402
from gpushare.sim.inflight import DEFAULT_INFLIGHT_WAKE_S, bound_tables, launch_queue  # noqa: E402
from gpushare.sim.workloads import (  # noqa: E402
    DEFAULT_LAUNCH_GAP_S,
    request_alone_s,
    source_counts,
)

sys.path.insert(0, str(REPO / "bench"))
from frontier import pair_cell, pair_files  # noqa: E402

FACTORS = (1.1, 1.5)
TRAIN_PROFILES = (
    "bert_8_fb1",
    "mobilenetv2_32_fb1",
    "mobilenetv2_64_fb1",
    "mobilenetv2_96_fb1",
    "resnet101_32_fb1",
    "resnet50_32_fb1",
    "transformer_xl_8_fb1",
)

#: A cell: ("blocking", gap_s, 0) or ("bounded", wake_s, k).
Mode = tuple[str, float, int]


def one(task: tuple[str, float, Mode, float]) -> dict[str, Any]:
    """gpushare on one pair at one SLO factor with one shallow-queue mode (and training host
    time per kernel)."""
    path, factor, (kind, t_s, k), host_s = task
    logs.configure_logging("warning")
    seen: list[str] = []
    adapters.launch_queue = _recording_launch_queue(seen)  # this process only
    sc = scenario.load(Path(path))
    online = tuple(dataclasses.replace(o, slo_factor=factor) for o in sc.online)
    if kind == "blocking":
        gpu = dataclasses.replace(sc.gpu, launch_gap_s=t_s)
        gate = dataclasses.replace(sc.config.gate, shallow_queue="blocking")
    else:
        gpu = dataclasses.replace(sc.gpu, inflight_wake_s=t_s)
        gate = dataclasses.replace(sc.config.gate, shallow_queue="bounded", inflight_kernels=k)
    gpu = dataclasses.replace(gpu, train_host_per_kernel_s=host_s)
    config = dataclasses.replace(sc.config, gate=gate)
    sc = dataclasses.replace(sc, online=online, gpu=gpu, config=config)
    alone, slo = runner.standalone(sc)
    run = runner.run_policy(
        sc, make_policy("gpushare", sc.config.control), name="gpushare", slo_ms=slo
    )
    (row,) = report.summarise(runner.ScenarioResult(sc, alone, slo, [run]))
    return {"modes": sorted(set(seen)), **row.as_dict()}


def _recording_launch_queue(seen: list[str]) -> Any:
    """``adapters.launch_queue`` that also notes how each offline launch was decoded."""

    def decode(env: Any) -> tuple[bool, int]:
        blocking, bound = launch_queue(env)
        seen.append("blocking" if blocking else f"bounded{bound}" if bound else "deep")
        return blocking, bound

    return decode


def alone_costs(modes: list[Mode], host_s: float) -> dict[str, dict[str, float]]:
    """Each training profile's run time alone per mode over its asynchronous run time with no
    host time ("deep": a deep queue with the training host time, 1 without)."""
    out: dict[str, dict[str, float]] = {}
    for name in TRAIN_PROFILES:
        prof = data.load_profile(f"orion-v100-kernels/{name}.csv", data.DEFAULT_MERGE_OFFLINE_US)
        row = {"deep": request_alone_s(prof, host_s) / prof.total_s}
        for kind, t_s, k in modes:
            if kind == "blocking":
                cost = (prof.total_s + (t_s + host_s) * sum(source_counts(prof))) / prof.total_s
            else:
                cost = bound_tables(prof, k, t_s, host_s).alone_s / prof.total_s
            row[label((kind, t_s, k))] = cost
        out[name] = row
    return out


def label(mode: Mode) -> str:
    kind, t_s, k = mode
    if kind == "blocking":
        return f"blocking, gap {t_s * 1e6:g} us"
    return f"bounded k={k}, wake {t_s * 1e6:g} us"


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, action="append", help="in-flight bounds (repeat)")
    ap.add_argument(
        "--wake-us", type=float, action="append", help="wake latencies (repeat; default W3b's)"
    )
    ap.add_argument(
        "--gap-us", type=float, action="append", help="blocking launch gaps to compare (repeat)"
    )
    ap.add_argument("--slo-factor", type=float, action="append", help="default 1.1 and 1.5")
    ap.add_argument(
        "--train-host-us",
        type=float,
        default=0.0,
        help="training jobs' CPU time per kernel ([gpu] train_host_per_kernel; default 0, W3)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "inflight_bound.json")
    return ap


def _modes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[Mode]:
    """The shallow queues to compare, from the checked arguments (``ap.error`` exits)."""
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be >= 1")
    for k in args.k or []:
        if k < 1:
            ap.error(f"--k {k}: must be >= 1")
    for v in [*(args.wake_us or []), *(args.gap_us or []), args.train_host_us]:
        if not 0 <= v < float("inf"):
            ap.error(f"{v:g} us: wakes and gaps must be finite and >= 0")
    wakes = [w * 1e-6 for w in args.wake_us] if args.wake_us else [DEFAULT_INFLIGHT_WAKE_S]
    modes: list[Mode] = [("blocking", g * 1e-6, 0) for g in args.gap_us or []]
    modes += [("bounded", w, k) for k in args.k or [] for w in wakes]
    return modes or [("blocking", DEFAULT_LAUNCH_GAP_S, 0)]


def _table(
    modes: list[Mode],
    factors: list[float],
    by_cell: dict[tuple[Mode, float], list[dict[str, Any]]],
    train_host_us: float,
) -> list[dict[str, Any]]:
    """Each mode x factor cell, printed as a Markdown table as it is made."""
    rows = []
    print(
        "| shallow queue | "
        + " | ".join(f"{f:g}x: attained (worst), p99 ovh, offline" for f in factors)
        + " |"
    )
    print("|---|" + "---|" * len(factors))
    for mode in modes:
        cells = []
        for factor in factors:
            runs = by_cell[(mode, factor)]
            kind, t_s, k = mode
            cell = pair_cell(
                runs,
                mode=kind,
                k=k,
                time_us=t_s * 1e6,
                train_host_us=train_host_us,
                slo_factor=factor,
            )
            cell["label"] = label(mode)
            rows.append(cell)
            cells.append(
                f"{cell['slo_attainment_mean'] * 100:.2f} % ({cell['slo_attainment_min'] * 100:.2f}),"
                f" {cell['p99_overhead_mean'] * 100:+.1f} %, {cell['offline_norm_mean']:.3f}"
            )
        print(f"| {label(mode)} | " + " | ".join(cells) + " |", flush=True)
    return rows


def main() -> None:
    ap = _parser()
    args = ap.parse_args()
    modes = _modes(ap, args)
    factors = args.slo_factor or list(FACTORS)
    files = pair_files()
    t0 = time.perf_counter()
    host_s = args.train_host_us * 1e-6
    tasks = [(f, factor, m, host_s) for m in modes for factor in factors for f in files]
    if args.jobs == 1:
        results = [one(t) for t in tasks]
    else:
        with Pool(args.jobs) as pool:
            results = pool.map(one, tasks, chunksize=1)
    by_cell: dict[tuple[Mode, float], list[dict[str, Any]]] = {}
    for (_, factor, mode, _), res in zip(tasks, results, strict=True):
        want = "blocking" if mode[0] == "blocking" else f"bounded{mode[2]}"
        if want not in res["modes"] or any(m not in (want, "deep") for m in res["modes"]):
            sys.exit(f"{res['scenario']}: offline clients ran {res['modes']}, not {want}")
        by_cell.setdefault((mode, factor), []).append(res)
    rows = _table(modes, factors, by_cell, args.train_host_us)
    costs = alone_costs(modes, host_s)
    print("\nalone, run time over asynchronous:")
    for name, row in costs.items():
        print(f"  {name}: " + ", ".join(f"{m}: {c:.3f}" for m, c in row.items()))
    command = "python bench/inflight_bound.py " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
        "alone_cost": costs,
        "runs": [
            {**r, "mode": label(m), "slo_factor": f}
            for (_, f, m, _), r in zip(tasks, results, strict=True)
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
