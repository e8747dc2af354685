"""Controller speed and reaction: step time for 8 GPUs x 48 clients, ticks from SLO breach to freeze.

Prints the numbers and writes them to bench/results/controller.json.

    .venv/bin/python bench/controller.py
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support.observations import (  # noqa: E402
    GIB,
    gpu_uuid,
    job,
    observation,
    offline,
    online,
)
from gpushare.config import ControlConfig  # noqa: E402
from gpushare.control.admission import admit  # noqa: E402
from gpushare.control.controller import GpushareController, GpuState  # noqa: E402
from gpushare.model import ClientClass, Observation, SetDuty  # noqa: E402

GPUS = 8
CLIENTS = 48
ONLINE_PER_GPU = 4
TICKS = 3000
WARMUP_TICKS = 200
OBS_VARIANTS = 64


def fleet(rng: random.Random) -> list[list[Observation]]:
    """Per GPU, a ring of observations with varying latency, probe, memory and SM activity."""
    per_gpu = []
    for g in range(GPUS):
        base = [online(f"g{g}-on{i}", mem=2 * GIB) for i in range(ONLINE_PER_GPU)]
        base += [
            offline(
                f"g{g}-off{i}",
                mem=rng.choice([None, 512 << 20, 1 * GIB]),
                restartable=rng.random() < 0.5,
                guarantee=rng.choice([None, None, 5.0]),
            )
            for i in range(CLIENTS - ONLINE_PER_GPU)
        ]
        variants = []
        for _ in range(OBS_VARIANTS):
            p99 = rng.uniform(10.0, 60.0)  # around a 40 ms SLO: comfort, band and violation
            clients = tuple(
                replace(c, p99_ms=p99) if c.cls is ClientClass.ONLINE else c for c in base
            )
            variants.append(
                observation(
                    clients,
                    gpu=gpu_uuid(g),
                    index=g,
                    probe_ratio=rng.uniform(0.9, 2.0),
                    mem_total=80 * GIB,
                    mem_free=rng.choice([30 * GIB, 30 * GIB, 30 * GIB, 1 * GIB]),
                    sm_active=rng.uniform(10.0, 90.0),
                )
            )
        per_gpu.append(variants)
    return per_gpu


def step_times(ctl: GpushareController, per_gpu: list[list[Observation]]) -> dict[str, float]:
    states: list[GpuState] = [ctl.initial_state(gpu_uuid(g), 0.0) for g in range(GPUS)]
    tick_s: list[float] = []
    per_step_s: list[float] = []
    for tick in range(TICKS + WARMUP_TICKS):
        now = tick * ctl.config.period_s
        t0 = time.perf_counter()
        for g in range(GPUS):
            s0 = time.perf_counter()
            states[g], _ = ctl.step(states[g], per_gpu[g][tick % OBS_VARIANTS], now)
            if tick >= WARMUP_TICKS:
                per_step_s.append(time.perf_counter() - s0)
        if tick >= WARMUP_TICKS:
            tick_s.append(time.perf_counter() - t0)
    return {
        "tick_8gpu_median_ms": statistics.median(tick_s) * 1e3,
        "tick_8gpu_p99_ms": statistics.quantiles(tick_s, n=100)[98] * 1e3,
        "step_1gpu_median_us": statistics.median(per_step_s) * 1e6,
        "step_1gpu_p99_us": statistics.quantiles(per_step_s, n=100)[98] * 1e6,
        "tick_budget_pct_of_period_median": statistics.median(tick_s) / ctl.config.period_s * 100,
    }


def reaction(config: ControlConfig, p99_over_slo: float) -> dict[str, float | int | None]:
    """Ticks from the first breaching observation to offline duty 0 (SetDuty(0) sent)."""
    ctl = GpushareController(config)
    clients = (online(p99_ms=10.0), offline())
    calm = observation(clients, probe_ratio=1.0)
    state = ctl.initial_state(gpu_uuid(0), 0.0)
    for i in range(50):
        state, _ = ctl.step(state, calm, i * config.period_s)
    assert state.duty == 1.0
    breach = observation(
        (replace(clients[0], p99_ms=40.0 * p99_over_slo), clients[1]), probe_ratio=1.0
    )
    frozen_at = None
    for i in range(1, 1000):
        state, actions = ctl.step(state, breach, (50 + i) * config.period_s)
        if any(isinstance(a, SetDuty) and a.duty == 0.0 for a in actions):
            frozen_at = i
            break
    # Then the SLO is comfortably met again: ticks back to duty 1.
    recovered_at = None
    for i in range(1, 10_000):
        state, _ = ctl.step(state, calm, (2000 + i) * config.period_s)
        if state.duty == 1.0:
            recovered_at = i
            break
    return {
        "p99_over_slo": p99_over_slo,
        "ticks_to_frozen": frozen_at,
        "seconds_to_frozen": None if frozen_at is None else frozen_at * config.period_s,
        "ticks_back_to_full": recovered_at,
        "seconds_back_to_full": None if recovered_at is None else recovered_at * config.period_s,
    }


def admission_time(rng: random.Random, per_gpu: list[list[Observation]]) -> dict[str, float]:
    observations = {o[0].gpu_uuid: replace(o[0], clients=o[0].clients[:24]) for o in per_gpu}
    queue = [
        job(f"q{i}", mem=rng.choice([1, 2, 4]) * GIB, duration=rng.uniform(10, 1e4), uid=1000)
        for i in range(200)
    ]
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        admit(queue, observations, {}, 0.0)
        times.append(time.perf_counter() - t0)
    return {
        "admit_200_jobs_8_gpus_median_ms": statistics.median(times) * 1e3,
        "admit_200_jobs_8_gpus_p99_ms": statistics.quantiles(times, n=100)[98] * 1e3,
    }


def main() -> None:
    rng = random.Random(6)
    config = ControlConfig()
    per_gpu = fleet(rng)
    results = {
        "setup": {
            "gpus": GPUS,
            "clients_per_gpu": CLIENTS,
            "online_per_gpu": ONLINE_PER_GPU,
            "ticks": TICKS,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "config": {k: v for k, v in asdict(config).items() if not k.startswith("online_mem")},
        },
        "step": step_times(GpushareController(config), per_gpu),
        "reaction": [reaction(config, r) for r in (1.02, 1.05, 1.5, 1.99, 2.0, 5.0)],
        "admission": admission_time(rng, per_gpu),
    }
    out = ROOT / "bench" / "results" / "controller.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    s = results["step"]
    print(f"step, {GPUS} GPUs x {CLIENTS} clients, one tick of all GPUs:")
    print(f"  median {s['tick_8gpu_median_ms']:.3f} ms   p99 {s['tick_8gpu_p99_ms']:.3f} ms")
    print(
        f"  one GPU: median {s['step_1gpu_median_us']:.1f} us   p99 {s['step_1gpu_p99_us']:.1f} us"
    )
    print(f"  = {s['tick_budget_pct_of_period_median']:.2f} % of the {config.period_s}s period")
    print("reaction (default config), breach -> offline duty 0 -> back to 1:")
    for r in results["reaction"]:
        print(
            f"  p99 {r['p99_over_slo']:.2f}x SLO: frozen after {r['ticks_to_frozen']} tick(s) "
            f"({r['seconds_to_frozen']}s); back to full after {r['ticks_back_to_full']} tick(s)"
        )
    a = results["admission"]
    print(
        f"admission, 200 queued jobs x 8 GPUs: median {a['admit_200_jobs_8_gpus_median_ms']:.2f} ms"
        f"  p99 {a['admit_200_jobs_8_gpus_p99_ms']:.2f} ms"
    )
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
