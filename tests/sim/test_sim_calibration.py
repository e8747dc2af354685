"""Calibration of the GPU model against published V100 measurements (docs/simulator.md).

* iGniter (``igniter-v100``): latency against the MPS active-thread percentage. The large-batch
  curve (ResNet-50 b32, VGG-19 b16, AlexNet b64) is reproduced within 6 % at every percentage by a
  wide-kernel profile; the small-batch ResNet-50 b4 curve is under-estimated, by at most 25 %.

The co-location points (Orion's plain-MPS run, time-slicing and MPS on A100 and T4) are in
``tests/sim/test_sim_validation.py``.
"""

from __future__ import annotations

import pytest

from gpushare.sim.validation import capped_pass_s, igniter_curves

ORION = "orion-v100-kernels"
PCTS = range(10, 101, 10)


@pytest.mark.parametrize("measured", [("resnet50", 32), ("vgg19", 16), ("alexnet", 64)])
def test_large_batch_curve_within_6_percent(measured: tuple[str, int]) -> None:
    curve = igniter_curves()[measured]
    full = capped_pass_s(f"{ORION}/resnet50_32_fb1.csv", 100)
    for pct in PCTS:
        model = capped_pass_s(f"{ORION}/resnet50_32_fb1.csv", pct) / full
        real = curve[pct] / curve[100]
        assert model == pytest.approx(real, rel=0.06), f"{measured} at {pct}%"


def test_small_batch_curve_underestimated_by_at_most_25_percent() -> None:
    curve = igniter_curves()[("resnet50", 4)]
    full = capped_pass_s(f"{ORION}/resnet50_4_fwd.csv", 100)
    worst = 0.0
    for pct in PCTS:
        model = capped_pass_s(f"{ORION}/resnet50_4_fwd.csv", pct) / full
        real = curve[pct] / curve[100]
        assert model <= real * 1.05, f"model slower than measured at {pct}%"
        worst = max(worst, 1 - model / real)
    assert worst <= 0.25
    assert worst > 0.05  # the documented gap is real: if the model improves, update the docs
