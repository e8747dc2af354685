"""An LLM step's speed on a fraction of the SMs: G7 against a saturating law, on published points.

The GPU model's run-time law (G7, ``docs/simulator.md``) slows a kernel that holds ``g`` of its
``w`` slots by ``(1 - f) + f x w / g`` (``f`` = 0.95, fitted on iGniter's CNN curves) whatever
the kernel does. A kernel bound by memory bandwidth saturates the HBM with a fraction of the SMs,
so it keeps its speed down to that fraction. The **saturating law** (:func:`slowdown`) runs a
memory-bound kernel at full speed down to ``s_sat x w`` slots and at G7 with the saturating width
``s_sat x w`` below it (continuous at ``s_sat x w``); a compute-bound kernel keeps G7. ``s_sat``
is its one parameter.

The points are **MuxServe's profiled cost of LLaMA-7B on one A100-80GB** (hao-ai-lab/MuxServe,
``examples/placement/llama.json`` at commit 223148033454e4740f4b4617c72910c370a5604b, the cost
file its placement reads; its README: milliseconds per iteration under an MPS active-thread
percentage, a decode step over ``batch`` sequences of ``seq`` cached tokens, a prefill of
``batch x seq`` tokens): the step time at 30-90 % of the SMs over the step time at 100 %.
:func:`fit` takes ``s_sat`` from the decode points at batches 1 and 32 (**calibration**); the
decode points at batches 8 and 128 and every prefill point are **validation**, not fitted. The
model side is the LLM server's own roofline (:mod:`gpushare.sim.llm_cost`, A100 roof, the
shipped constants): each kernel of the step slowed by the law on ``round(pct x 108)`` of the 108
SMs, alone (no other client).

The engine applies the law (:func:`gpushare.sim.dispatch.saturating_slow`) to the kernels of an
LLM server whose ``LlmServerConfig.s_sat`` (``[[llm]] s_sat``) is above 0. The default is
:data:`FITTED_S_SAT`, the measured law (it validates at 7.9 % median error on the decode points not
fitted, where G7 is off by 43 %); 0 gives G7, kept as a sensitivity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gpushare.sim.dispatch import saturating_slow
from gpushare.sim.gpu import DEFAULT_PARALLEL_FRACTION
from gpushare.sim.llm_cost import (
    A100_80G,
    DEFAULT_EFFICIENCY,
    LLAMA2_7B,
    Batch,
    iteration_rows,
)

Phase = Literal["decode", "prefill"]
Role = Literal["calibration", "validation"]

SOURCE = "MuxServe examples/placement/llama.json @2231480 (LLaMA-7B, one A100-80GB)"
#: The MPS active-thread percentages of the table's columns (100: the reference).
PCTS = (30, 40, 50, 60, 70, 80, 90, 100)
#: ms per step, one value per :data:`PCTS`: ``(phase, batch, seq) -> times``.
_TABLE: dict[tuple[Phase, int, int], tuple[float, ...]] = {
    ("decode", 1, 128): (16.237, 14.513, 12.55, 12.281, 12.037, 11.835, 11.511, 11.49),
    ("decode", 1, 512): (17.255, 15.495, 13.573, 13.288, 13.002, 12.847, 12.483, 12.484),
    ("decode", 8, 128): (17.329, 14.913, 12.975, 12.675, 12.456, 12.327, 11.918, 11.902),
    ("decode", 8, 512): (19.957, 16.593, 14.531, 14.146, 13.931, 13.712, 13.273, 13.408),
    ("decode", 32, 128): (19.861, 18.498, 16.393, 16.242, 15.213, 14.179, 14.234, 14.427),
    ("decode", 32, 512): (26.238, 24.403, 21.173, 21.235, 19.71, 18.562, 19.021, 18.726),
    ("decode", 128, 128): (43.89, 40.911, 32.51, 28.557, 27.123, 25.893, 25.097, 24.153),
    ("decode", 128, 512): (69.116, 61.882, 50.956, 46.687, 43.004, 42.093, 41.949, 40.856),
    ("prefill", 1, 128): (27.148, 27.65, 21.348, 17.575, 17.205, 16.609, 16.444, 16.023),
    ("prefill", 8, 128): (214.894, 162.745, 131.871, 111.005, 98.131, 88.522, 81.628, 78.332),
    ("prefill", 32, 128): (805.753, 601.631, 502.247, 434.976, 383.58, 349.198, 326.632, 306.311),
}
#: Decode batches whose points calibrate ``s_sat``; the other points validate it.
CALIBRATION_BATCHES = (1, 32)
#: ``s_sat`` that :func:`fit` returns on the shipped points (a test checks it): the LLM server's
#: default (``LlmServerConfig.s_sat``, ``[[llm]] s_sat``).
FITTED_S_SAT = 0.45


@dataclass(frozen=True, slots=True)
class SmPoint:
    """One published ratio: step time at ``sm_pct`` % of the SMs over the time at 100 %."""

    role: Role
    phase: Phase
    batch: int
    seq: int
    sm_pct: int
    measured: float


def _points() -> tuple[SmPoint, ...]:
    out = []
    for (phase, batch, seq), times in _TABLE.items():
        role: Role = (
            "calibration" if phase == "decode" and batch in CALIBRATION_BATCHES else "validation"
        )
        for pct, t in zip(PCTS[:-1], times[:-1], strict=True):
            out.append(SmPoint(role, phase, batch, seq, pct, t / times[-1]))
    return tuple(out)


POINTS = _points()


def slowdown(width: int, slots: int, memory_bound: bool, s_sat: float) -> float:
    """How much longer a kernel of ``width`` takes on ``slots`` (G7; ``s_sat`` = 0: G7 for all)."""
    if slots >= width:
        return 1.0
    f = DEFAULT_PARALLEL_FRACTION
    if s_sat > 0.0:
        # The engine's own law (a merged chunk's memory-bound share is 0 or 1 here).
        return saturating_slow(1.0 - f, f, width, slots, 1.0 if memory_bound else 0.0, s_sat)
    return (1.0 - f) + f * width / slots


def model_ratio(p: SmPoint, s_sat: float) -> float:
    """The roofline step's time on ``p.sm_pct`` % of the SMs over its time on all of them."""
    roof = A100_80G
    if p.phase == "decode":
        batch = Batch(p.batch, p.batch * p.seq, (), p.batch)
    else:
        batch = Batch(0, 0, ((p.seq, 0),) * p.batch, p.batch)
    rows = iteration_rows(batch, LLAMA2_7B, roof, DEFAULT_EFFICIENCY)
    slots = max(1, round(p.sm_pct / 100 * roof.sm_count))
    alone = math.fsum(r[0] for r in rows)
    capped = math.fsum(r[0] * slowdown(r[1], slots, r[2] >= 1.0, s_sat) for r in rows)
    return capped / alone


def log_error(p: SmPoint, s_sat: float) -> float:
    """``ln(model / measured)``."""
    return math.log(model_ratio(p, s_sat) / p.measured)


def fit(points: tuple[SmPoint, ...] = POINTS) -> float:
    """``s_sat`` in [0.05, 1] (steps of 0.05) minimising the squared log error on calibration."""
    cal = [p for p in points if p.role == "calibration"]
    grid = [round(0.05 * k, 2) for k in range(1, 21)]
    return min(grid, key=lambda s: math.fsum(log_error(p, s) ** 2 for p in cal))


@dataclass(frozen=True, slots=True)
class SmRow:
    """One point under G7 and under the saturating law."""

    point: SmPoint
    g7: float
    saturating: float

    @property
    def g7_error(self) -> float:
        """``model / measured - 1`` under G7."""
        return self.g7 / self.point.measured - 1.0

    @property
    def error(self) -> float:
        """``model / measured - 1`` under the saturating law."""
        return self.saturating / self.point.measured - 1.0


def evaluate(s_sat: float, points: tuple[SmPoint, ...] = POINTS) -> list[SmRow]:
    """Every point's model ratio under G7 and under the saturating law with ``s_sat``."""
    return [SmRow(p, model_ratio(p, 0.0), model_ratio(p, s_sat)) for p in points]
