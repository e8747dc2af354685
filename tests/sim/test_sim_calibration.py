"""Calibration of the GPU model against published V100 measurements (docs/simulator.md).

* iGniter (``igniter-v100``): latency against the MPS active-thread percentage. The large-batch
  curve (ResNet-50 b32, VGG-19 b16, AlexNet b64) is reproduced within 6 % at every percentage by a
  wide-kernel profile; the small-batch ResNet-50 b4 curve is under-estimated, by at most 25 %.

The co-location points (Orion's plain-MPS run, time-slicing and MPS on A100 and T4) are in
``tests/sim/test_sim_validation.py``.
"""

from __future__ import annotations

import csv
from collections import defaultdict

import pytest

from gpushare.sim import data
from gpushare.sim.gpu import EventLoop, Gpu
from gpushare.sim.workloads import OfflineTrainer

ORION = "orion-v100-kernels"


def igniter_curves() -> dict[tuple[str, int], dict[int, float]]:
    curves: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    path = data.resolve("igniter-v100/latency_vs_mps_thread_pct.csv")
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            curves[(row["model"], int(row["batch"]))][int(row["thread_pct"])] = float(
                row["compute_ms_p50"]
            )
    return curves


def sequence_time_s(profile: str, pct: float) -> float:
    """Run one pass of a profile alone on the simulated GPU under an MPS cap."""
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-cal", index=0)
    merge = data.DEFAULT_MERGE_OFFLINE_US if "_fb1" in profile else data.DEFAULT_MERGE_ONLINE_US
    prof = data.load_profile(profile, merge)
    job = OfflineTrainer("job", gpu, prof, sm_pct=pct, mem_bytes=0)
    job.start(0.0)
    loop.run_until(prof.total_s * 20)
    return job.iterations[0]


PCTS = range(10, 101, 10)


@pytest.mark.parametrize("measured", [("resnet50", 32), ("vgg19", 16), ("alexnet", 64)])
def test_large_batch_curve_within_6_percent(measured: tuple[str, int]) -> None:
    curve = igniter_curves()[measured]
    full = sequence_time_s(f"{ORION}/resnet50_32_fb1.csv", 100)
    for pct in PCTS:
        model = sequence_time_s(f"{ORION}/resnet50_32_fb1.csv", pct) / full
        real = curve[pct] / curve[100]
        assert model == pytest.approx(real, rel=0.06), f"{measured} at {pct}%"


def test_small_batch_curve_underestimated_by_at_most_25_percent() -> None:
    curve = igniter_curves()[("resnet50", 4)]
    full = sequence_time_s(f"{ORION}/resnet50_4_fwd.csv", 100)
    worst = 0.0
    for pct in PCTS:
        model = sequence_time_s(f"{ORION}/resnet50_4_fwd.csv", pct) / full
        real = curve[pct] / curve[100]
        assert model <= real * 1.05, f"model slower than measured at {pct}%"
        worst = max(worst, 1 - model / real)
    assert worst <= 0.25
    assert worst > 0.05  # the documented gap is real: if the model improves, update the docs
