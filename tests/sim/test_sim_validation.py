"""The GPU model against published co-location measurements (docs/simulator.md section 4).

Every point of the validation table is held here to the tolerance the table states. Calibration
points (a constant was chosen from them) and validation points (nothing was fitted to them) are
marked as such in ``gpushare/sim/validation.py``.
"""

from __future__ import annotations

import statistics

import pytest

from gpushare.sim import data, validation
from gpushare.sim.gpu import DEFAULT_SLICE_S, DEFAULT_SWITCH_S

POINTS = validation.load_points()
TS_CALIBRATION = [POINTS[k] for k in ("nos-ts-3", "nos-ts-5", "nos-ts-7")]


def test_the_switch_cost_is_the_one_the_calibration_points_give() -> None:
    # One constant from three points (3, 5 and 7 clients), not from any single one.
    assert validation.switch_cost_from(TS_CALIBRATION) == pytest.approx(DEFAULT_SWITCH_S, rel=0.01)
    spread = [p.ratio / p.clients - 1.0 for p in TS_CALIBRATION]
    assert max(spread) - min(spread) < 0.002  # the three agree: one overhead per slice


@pytest.mark.parametrize("point", TS_CALIBRATION, ids=lambda p: p.id)
def test_time_slicing_reproduces_the_calibration_points_within_3_percent(
    point: validation.Point,
) -> None:
    proxy = data.load_profile(f"{validation.ORION}/transformer_xl_4_fwd.csv")
    model = validation.closed_loop_ratio(
        proxy, point.clients, mode="time_slice", sm_count=point.sms
    )
    assert model == pytest.approx(point.ratio, rel=0.03)


def test_time_slicing_on_a_t4_within_15_percent() -> None:
    p = POINTS["t4-ts-5"]  # validation: a different GPU and workload, nothing fitted to it
    spin = validation.spin_kernel(p.measured_alone)
    model = validation.closed_loop_ratio(
        spin, p.clients, mode="time_slice", sm_count=p.sms, iterations=1
    )
    assert model == pytest.approx(p.ratio, rel=0.15)
    assert model < p.ratio  # the model's switch cost is the A100's: the T4 paid more


def test_mps_on_a_t4_within_15_percent() -> None:
    p = POINTS["t4-mps-5"]  # five one-thread kernels side by side: no slot is contended
    spin = validation.spin_kernel(p.measured_alone)
    model = validation.closed_loop_ratio(spin, p.clients, mode="mps", sm_count=p.sms, iterations=1)
    assert model == pytest.approx(p.ratio, rel=0.15)


def test_orion_plain_mps_point() -> None:
    runs = [validation.orion_point(seed) for seed in (1, 2, 3)]
    real = validation.orion_measured()
    p50 = statistics.fmean(r.p50_ms for r in runs)
    p99 = statistics.fmean(r.p99_ms for r in runs)
    ips = statistics.fmean(r.train_it_s for r in runs)
    # The documented miss: the model is gentler on plain MPS than this measurement (x0.3 at p50;
    # docs/simulator.md section 4 says why and which way it biases the comparison).
    assert real.p50_ms / 3.5 <= p50 <= real.p50_ms
    assert real.p99_ms / 2 <= p99 <= real.p99_ms * 2
    assert ips == pytest.approx(real.train_it_s, rel=0.15)
    # Plain MPS still inflates a 6.5 ms pass several times over.
    assert p50 >= 2.5 * 6.5


def test_the_switch_cost_is_a_multiple_of_the_state_save_and_restore() -> None:
    # Sanity of the calibrated constant: above the pure save/restore arithmetic (~64 us on a
    # V100), below a tenth of the slice.
    assert 64e-6 < DEFAULT_SWITCH_S < DEFAULT_SLICE_S / 5
