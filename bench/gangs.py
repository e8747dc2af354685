"""Gangs on 4- and 8-GPU nodes (issue 35): online attainment and the gang's throughput per SLO.

Each scenario is a simulated node with one-GPU online services and/or a tensor-parallel server
(one shard per GPU, a collective per layer) on some GPUs, and a DDP training job (one rank per
GPU, an all-reduce per iteration that waits for the slowest rank) across GPUs
(:mod:`gpushare.sim.gang`). Each policy runs the daemon's own loop; every rank is an offline
client of its GPU. Prints, per scenario, SLO factor and policy, the worst online service's SLO
attainment and the gang's throughput (iterations per second over the gang alone on idle GPUs),
and writes ``bench/results/gangs.json`` and ``gangs.md``. Usage::

    .venv/bin/python bench/gangs.py [--quick] [--duration S] [--factor F ...] [--policy P ...]

The ``placement`` scenarios put a 4-rank gang on a node with no 4 idle GPUs twice: where
today's per-client rule would (D12: each rank on the GPU with the most available memory) and
where the gang rule puts it (:func:`gpushare.control.gang.place_gang`, D14). Numbers are the
simulator's (docs/simulator.md): they rank policies on one model, they are not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpushare import logs  # noqa: E402
from gpushare.control.gang import GangDuty, GpuForGang, place_gang  # noqa: E402
from gpushare.control.placement import GpuLoad, choose  # noqa: E402
from gpushare.control.policy import Policy  # noqa: E402
from gpushare.control.registry import make_policy  # noqa: E402
from gpushare.sim import engine  # noqa: E402
from gpushare.sim.gang import DdpSpec, TpSpec  # noqa: E402
from gpushare.sim.gangrun import GangScenario, base_scenario, run_gang_policy, slos  # noqa: E402

RESULTS = REPO / "bench" / "results"
K = "orion-v100-kernels/"
TRAIN = K + "resnet50_32_fb1.csv"
FACTORS = (1.05, 1.1, 1.5, 2.0)
POLICIES = ("gpushare", "mps-priority", "exclusive")
GIB = 1 << 30
#: The load of every online service (of its capacity alone), as in the Tally-shaped pairs.
LOAD = 0.5


def _svc(name: str, profile: str, gpu: int) -> tuple[str, str, int, float]:
    return (name, K + profile, gpu, LOAD)


ONE_GPU_4 = (_svc("bert", "bert_2_fwd.csv", 0), _svc("rn50", "resnet50_4_fwd.csv", 1))
ONE_GPU_8 = (
    *ONE_GPU_4,
    _svc("txl", "transformer_xl_4_fwd.csv", 2),
    _svc("mnv2", "mobilenetv2_4_fwd.csv", 3),
)
BESIDE_TP = (
    _svc("rn50", "resnet50_4_fwd.csv", 4),
    _svc("txl", "transformer_xl_4_fwd.csv", 5),
    _svc("mnv2", "mobilenetv2_4_fwd.csv", 6),
)
TP4 = TpSpec("bert-tp4", K + "bert_2_fwd.csv", (0, 1, 2, 3), load=LOAD)


def scenarios(duration_s: float, seed: int = 1) -> list[tuple[GangScenario, str]]:
    """The gang scenarios, each with a one-line description."""
    n4 = base_scenario("n4", 4, ONE_GPU_4, duration_s=duration_s, seed=seed)
    n8 = base_scenario("n8", 8, ONE_GPU_8, duration_s=duration_s, seed=seed)
    n8tp = base_scenario("n8tp", 8, BESIDE_TP, duration_s=duration_s, seed=seed)
    ddp = DdpSpec("ddp", TRAIN, (0, 1, 2, 3))
    ddp8 = DdpSpec("ddp", TRAIN, tuple(range(8)))
    out = [
        (GangScenario("n4-ddp4", n4, ddp=(ddp,)), "4 GPUs; BERT on 0, ResNet-50 on 1; DDP x4"),
        (GangScenario("n8-ddp8", n8, ddp=(ddp8,)), "8 GPUs; 4 one-GPU services on 0-3; DDP x8"),
        (
            GangScenario("n8-tp4-ddp8", n8tp, ddp=(ddp8,), tp=(TP4,)),
            "8 GPUs; BERT TP=4 on 0-3, 3 services on 4-6; DDP x8",
        ),
    ]
    for i, (svc, *_) in enumerate(ONE_GPU_8):
        # The ladder: the 4-rank gang on one service's GPU and three idle ones.
        gpus4 = (i, 4, 5, 6)
        sc = GangScenario(f"n8-ddp4-on-{svc}", n8, ddp=(DdpSpec("ddp", TRAIN, gpus4),))
        out.append((sc, f"the n8 node; DDP x4 on GPUs {list(gpus4)} ({svc}'s GPU and 3 idle)"))
    for rule, gpus in placements(n8tp.gpu.mem_total_bytes).items():
        sc = GangScenario(
            f"n8-tp4-ddp4-{rule}", n8tp, ddp=(DdpSpec("ddp", TRAIN, gpus),), tp=(TP4,)
        )
        out.append((sc, f"as above; DDP x4 placed by {rule}: GPUs {list(gpus)}"))
    return out


def placements(mem_total: int) -> dict[str, tuple[int, ...]]:
    """Where a 4-rank gang of 8 GiB ranks goes on the TP node: by D12, and by the gang rule."""
    used = {g: 0 for g in range(8)}
    services: dict[int, dict[str, float]] = {g: {} for g in range(8)}
    for g in TP4.gpus:
        used[g] += TP4.mem_bytes
        services[g][TP4.name] = LOAD
    for name, _, g, load in BESIDE_TP:
        used[g] += 2 * GIB
        services[g][name] = load
    rank_mem = DdpSpec("x", TRAIN, ()).mem_bytes
    # D12: rank after rank, the most available memory (promised memory counted), then fewer
    # clients, then the lowest index.
    promised = dict.fromkeys(range(8), 0)
    clients = {g: len(services[g]) for g in range(8)}
    d12: list[int] = []
    for _ in range(4):
        loads = [
            GpuLoad(g, f"GPU-{g}", mem_total - used[g], promised[g], clients[g])
            for g in range(8)
            if g not in d12
        ]
        pick = choose(loads).index
        d12.append(pick)
        promised[pick] += rank_mem
        clients[pick] += 1
    gang = place_gang(
        [GpuForGang(g, mem_total - used[g], services[g]) for g in range(8)], 4, rank_mem
    )
    assert gang is not None
    return {"D12": tuple(sorted(d12)), "gang-rule": gang.gpus}


#: Scenarios run only when named with --scenario (the ladder: what one service's GPU costs a gang).
LADDER_PREFIX = "n8-ddp4-on-"


def measured_placement(thawed: list[float], mem_total: int) -> tuple[int, ...]:
    """The gang rule with each GPU's measured share of time offline work was let run.

    ``thawed[g]`` is how long the daemon kept the rank on GPU ``g`` thawed in the n8-tp4-ddp8 run
    (its gate open), so ``1 - thawed`` stands for the busy fraction the rule takes: what the
    daemon's gate can measure on a GPU, gate delays included, where the offered load cannot.
    """
    used = {g: 0 for g in range(8)}
    services: dict[int, dict[str, float]] = {g: {} for g in range(8)}
    for g in TP4.gpus:
        used[g] += TP4.mem_bytes
        services[g][TP4.name] = 1.0 - min(1.0, thawed[g])
    for name, _, g, _ in BESIDE_TP:
        used[g] += 2 * GIB
        services[g][name] = 1.0 - min(1.0, thawed[g])
    rank_mem = DdpSpec("x", TRAIN, ()).mem_bytes
    gpus = [GpuForGang(g, mem_total - used[g], services[g]) for g in range(8)]
    placed = place_gang(gpus, 4, rank_mem)
    assert placed is not None
    return placed.gpus


#: gpushare's controller with every gang rank given the gang's smallest duty (measured, rejected).
GANG_DUTY = "gpushare+gang-duty"


def make_pol(name: str, sc: GangScenario) -> Policy[Any]:
    """A policy of the registry, or :data:`GANG_DUTY`."""
    if name == GANG_DUTY:
        gangs = [[f"GPU-sim-{g:04d}" for g in d.gpus] for d in sc.ddp]
        return GangDuty(make_policy("gpushare", sc.base.config.control), gangs)
    return make_policy(name, sc.base.config.control)


def run_one(
    sc: GangScenario, factor: float, policies: list[str], boundaries: bool
) -> list[dict[str, Any]]:
    """Every policy on one scenario at one SLO factor."""
    _, slo = slos(sc, factor)
    rows = []
    for pol in policies:
        policy = make_pol(pol, sc)
        run, _ = run_gang_policy(sc, policy, name=pol, slo_ms=slo, boundaries=boundaries)
        worst = min(run.services, key=lambda s: s.slo_attainment)
        rows.append(
            {
                "scenario": sc.name,
                "slo_factor": factor,
                "policy": pol,
                "online_min_attainment": worst.slo_attainment,
                "worst_service": worst.name,
                "gating": boundaries,
                "gang_norm": [g.norm for g in run.gangs],
                "run": run.as_dict(),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], desc: dict[str, str]) -> str:
    """One table: scenario x factor x policy, worst online attainment and gang throughput."""
    out = [
        "| scenario | SLO | policy | worst online attainment | gang throughput |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        gang = ", ".join(f"{x:.3f}" for x in r["gang_norm"])
        out.append(
            f"| {r['scenario']} | {r['slo_factor']:g}x | {r['policy']} "
            f"| {r['online_min_attainment'] * 100:.2f} % ({r['worst_service']}) | {gang} |"
        )
    out += ["", *(f"- `{k}`: {v}" for k, v in desc.items())]
    return "\n".join(out)


def frontier_markdown(rows: list[dict[str, Any]]) -> str:
    """The frontier: per scenario and policy, worst online attainment / gang throughput per SLO."""
    factors = sorted({r["slo_factor"] for r in rows})
    cells: dict[tuple[str, str], dict[float, str]] = {}
    for r in rows:
        gang = "/".join(f"{x:.2f}" for x in r["gang_norm"])
        cell = f"{r['online_min_attainment'] * 100:.2f} % / {gang}"
        cells.setdefault((r["scenario"], r["policy"]), {})[r["slo_factor"]] = cell
    head = "| scenario | policy | " + " | ".join(f"{f:g}x" for f in factors) + " |"
    out = [head, "|---|---|" + "---|" * len(factors)]
    for (sc, pol), by in cells.items():
        out.append(f"| {sc} | {pol} | " + " | ".join(by.get(f, "-") for f in factors) + " |")
    return "\n".join(out)


def write_markdown(doc: dict[str, Any], out: Path) -> Path:
    """Write ``doc``'s tables beside its JSON file as NAME.md; return that path."""
    md = out.with_suffix(".md")
    md.write_text(
        f"Command: `{doc['command']}`\n\nWorst online attainment / gang throughput:\n\n"
        + frontier_markdown(doc["rows"])
        + "\n\n"
        + markdown(doc["rows"], doc["scenarios"])
        + "\n"
    )
    return md


def main() -> None:
    """Run the gang scenarios and write their results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=20.0, help="virtual seconds per run")
    ap.add_argument("--factor", type=float, action="append", help="SLO factor (repeat)")
    ap.add_argument(
        "--policy", action="append", help=f"policy (repeat; default {POLICIES}; or {GANG_DUTY})"
    )
    ap.add_argument("--quick", action="store_true", help="10 s runs at 1.1x only")
    ap.add_argument("--no-gating", action="store_true", help="no service sends request boundaries")
    ap.add_argument("--seed", type=int, default=1, help="the arrivals' seed (every scenario)")
    ap.add_argument("--scenario", action="append", help="only these scenarios (repeat)")
    ap.add_argument("--out", type=Path, default=RESULTS / "gangs.json", help="JSON to write")
    ap.add_argument("--render", type=Path, help="only rewrite the Markdown of this JSON file")
    args = ap.parse_args()
    if args.render is not None:
        print(f"wrote {write_markdown(json.loads(args.render.read_text()), args.render)}")
        return
    logs.configure_logging("warning")
    factors = args.factor or ([1.1] if args.quick else list(FACTORS))
    duration = 10.0 if args.quick else args.duration
    policies = args.policy or list(POLICIES)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    desc: dict[str, str] = {}
    for sc, text in scenarios(duration, args.seed):
        if args.scenario and sc.name not in args.scenario:
            continue
        if not args.scenario and sc.name.startswith(LADDER_PREFIX):
            continue
        desc[sc.name] = text
        for f in factors:
            for r in run_one(sc, f, policies, not args.no_gating):
                rows.append(r)
                print(
                    f"{r['scenario']:22s} {f:4g}x {r['policy']:13s} worst online "
                    f"{r['online_min_attainment'] * 100:6.2f} % ({r['worst_service']}), gang "
                    + ", ".join(f"{x:.3f}" for x in r["gang_norm"]),
                    flush=True,
                )
    # The gang rule fed with what the gate measured: each factor's n8-tp4-ddp8 gpushare run.
    probes = {
        r["slo_factor"]: r["run"]["thawed"][0]
        for r in rows
        if r["scenario"] == "n8-tp4-ddp8" and r["policy"] == "gpushare"
    }
    base = scenarios(duration, args.seed)[2][0]
    for f, thawed in probes.items():
        gpus = measured_placement(thawed, base.base.gpu.mem_total_bytes)
        sc = GangScenario(
            "n8-tp4-ddp4-measured", base.base, ddp=(DdpSpec("ddp", TRAIN, gpus),), tp=(TP4,)
        )
        desc[sc.name] = (
            "as D12/gang-rule; DDP x4 placed by the gang rule on measured gate-open shares"
        )
        for r in run_one(sc, f, policies, not args.no_gating):
            r["placement"] = list(gpus)
            rows.append(r)
            print(f"{r['scenario']:22s} {f:4g}x {r['policy']:13s} GPUs {list(gpus)} worst online "
                  f"{r['online_min_attainment'] * 100:6.2f} %, gang {r['gang_norm'][0]:.3f}", flush=True)  # fmt: skip
    command = "python bench/gangs.py " + " ".join(sys.argv[1:])
    doc = {
        "command": command.strip(),
        "wall_s": time.perf_counter() - t0,
        "duration_s": duration,
        "seed": args.seed,
        "engine": engine.loaded(),
        "gating": not args.no_gating,
        "scenarios": desc,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    md = write_markdown(doc, args.out)
    print(f"wrote {args.out} and {md} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
