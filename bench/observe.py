"""Cost of building one tick's observations (8 GPUs x 48 clients) and of an NVML sample.

Also measures one NvmlBackend.sample() of 8 fake GPUs through the real adapter (thread hand-off,
error policy, versioned calls), which is the other per-tick sensing cost.

Run: .venv/bin/python bench/observe.py [ITERATIONS]   -> prints numbers, writes
bench/results/observe.json (ITERATIONS: observation builds timed, default 2000).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support import fake_nvml  # noqa: E402
from gpushare.config import Config  # noqa: E402
from gpushare.daemon.observe import build_observation  # noqa: E402
from gpushare.latency.p99 import LatencyP99  # noqa: E402
from gpushare.model import (  # noqa: E402
    ClientClass,
    ClientState,
    ClientView,
    GpuSample,
    Limits,
    MpsState,
    ProbeReading,
)
from gpushare.node.nvml import NvmlBackend  # noqa: E402

GPUS = 8
CLIENTS = 48
ONLINE_PER_GPU = 8
ITERATIONS = 2000
NVML_ITERATIONS = 300


def stats_us(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[max(0, int(len(ordered) * 0.99) - 1)]
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": p99 * 1e6,
        "max_us": ordered[-1] * 1e6,
        "n": len(ordered),
    }


def _clients(
    samples: tuple[GpuSample, ...],
) -> tuple[dict[str, list[ClientView]], dict[str, LatencyP99]]:
    """Each GPU's client views (the first ``ONLINE_PER_GPU`` online) and the online p99s."""
    clients_by_gpu = {}
    app_p99 = {}
    for g, s in enumerate(samples):
        views = []
        for j in range(CLIENTS):
            cls = ClientClass.ONLINE if j < ONLINE_PER_GPU else ClientClass.OFFLINE
            cid = f"g{g}c{j}"
            views.append(
                ClientView(
                    client_id=cid,
                    cls=cls,
                    state=ClientState.RUNNING,
                    limits=Limits(sm_pct=50.0, pinned_mem_bytes=4 << 30, priority=cls.mps_priority),
                    uid=1000 + j,
                    pid=s.processes[j].pid,
                    slo_p99_ms=20.0 if cls is ClientClass.ONLINE else None,
                )
            )
            if cls is ClientClass.ONLINE:
                app_p99[cid] = LatencyP99(12.0, 500)
        clients_by_gpu[s.uuid] = views
    return clients_by_gpu, app_p99


def _time_builds(samples: tuple[GpuSample, ...], iterations: int) -> dict[str, float]:
    """What building every GPU's observation takes, per tick."""
    clients_by_gpu, app_p99 = _clients(samples)
    # The probe's readings by GPU: what its adapter returns (a probe at its baseline).
    reading = ProbeReading(
        latency_ms=0.05, run_ms=0.05, baseline_ms=0.05, ratio=1.0, samples=200, reason=None
    )
    probe = {s.uuid: reading for s in samples}
    config = Config()
    mps_states = {s.uuid: MpsState.UP for s in samples}

    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        obs = [
            build_observation(
                sample=s,
                probe=probe[s.uuid],
                clients=clients_by_gpu[s.uuid],
                config=config,
                app_p99=app_p99,
                mps_state=mps_states[s.uuid],
            )
            for s in samples
        ]
        times.append(time.perf_counter() - t0)
    assert len(obs) == GPUS
    assert all(len(o.clients) == CLIENTS for o in obs)
    return stats_us(times)


def _time_nvml_samples() -> dict[str, float]:
    """What ``NvmlBackend.sample()`` takes on the fake driver, per tick."""
    lib = fake_nvml.FakeNvmlLib(
        [
            fake_nvml.FakeGpu(
                uuid=fake_nvml.uuid_of(i), mps_procs=[(10_000 + j, 1 << 30) for j in range(CLIENTS)]
            )
            for i in range(GPUS)
        ]
    )
    nvml = NvmlBackend(nvml=lib, events=False)
    nvml.open()
    nvml_times = []
    for _ in range(NVML_ITERATIONS):
        t0 = time.perf_counter()
        got = nvml.sample()
        nvml_times.append(time.perf_counter() - t0)
    nvml.close()
    assert len(got) == GPUS
    assert len(got[0].processes) == CLIENTS + 1
    return stats_us(nvml_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("iterations", nargs="?", type=int, default=ITERATIONS, help="builds timed")
    iterations = ap.parse_args().iterations
    samples = tuple(fake_nvml.uniform_samples(GPUS, CLIENTS))
    build = _time_builds(samples, iterations)
    sample_cost = _time_nvml_samples()

    result = {
        "bench": "observe",
        "gpus": GPUS,
        "clients_per_gpu": CLIENTS,
        "build_observations": build,
        "nvml_sample_fake_driver": sample_cost,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(
        f"build_observations {GPUS} GPUs x {CLIENTS} clients: median {build['median_us']:.0f} us, "
        f"p99 {build['p99_us']:.0f} us over {iterations} ticks"
    )
    print(
        f"NvmlBackend.sample() {GPUS} fake GPUs: median {sample_cost['median_us']:.0f} us, "
        f"p99 {sample_cost['p99_us']:.0f} us over {NVML_ITERATIONS} ticks"
    )
    out = ROOT / "bench" / "results" / "observe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
