"""The LLM iteration model's calibration and validation against published measurements.

Every point is a published number with its source. The model's three constants
(:class:`gpushare.sim.llm_cost.Efficiency`) are fitted on the **calibration** set only: LMDeploy's
static benchmark of Llama-2-7B FP16 on one A100-80G (TurboMind v0.1.0a1: the median time per
output token for batches of 1-64 and prompts of 1-2,048 tokens, 20 points, and the batch-1
first-token latency, 3 points). They are then checked, unchanged, on points that were not fitted:

* the same GPU and model served by another engine (TensorRT-LLM v0.6.1, LLaMA-7B FP16 on one
  A100: three static-batch throughputs and two batch-1 first-token latencies);
* another GPU and precision (TensorRT-LLM v0.6.1, LLaMA-7B FP8 on one H100: four throughputs and
  two first-token latencies).

Sources (``docs/simulator.md`` section 7 cites them in full):

* LMDeploy ``docs/en/benchmark/a100_fp16.md`` at commit 3e391df4673326f79363eebe030876861a9b7090
  (v0.1.0a1, ``profile_generation.py``): per-token latency percentiles and first-token latency.
* TensorRT-LLM ``docs/source/performance.md`` at commit
  138f96d45f90b9667426f7c47297d8c06bafac73 ("updated for v0.6.1"; the low-latency tables "from
  TensorRT-LLM v0.5"): ``gptSessionBenchmark``, static batches, throughput = output tokens of
  the batch over the batch's whole run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gpushare.sim.llm_cost import (
    A100_80G,
    H100_80G,
    LLAMA2_7B,
    Batch,
    Efficiency,
    GpuRoof,
    LlmModel,
    fp8,
    iteration_s,
    static_batch_s,
)

Metric = Literal["throughput_tok_s", "ttft_ms", "tpot_ms"]
Role = Literal["calibration", "validation"]

TRTLLM = "TensorRT-LLM v0.6.1 docs/source/performance.md @138f96d"
LMDEPLOY = "LMDeploy v0.1.0a1 docs/en/benchmark/a100_fp16.md @3e391df"


@dataclass(frozen=True, slots=True)
class Point:
    """One published measurement: a static batch of ``batch`` x (``prompt`` in, ``output`` out)."""

    source: str
    role: Role
    setup: str
    metric: Metric
    batch: int
    prompt: int
    output: int
    measured: float


def _points() -> tuple[Point, ...]:
    cal: Role = "calibration"
    val: Role = "validation"
    a100 = "A100-80G FP16 LLaMA-7B"
    h100 = "H100-80G FP8 LLaMA-7B"
    pts: list[Point] = [
        Point(TRTLLM, val, a100, "throughput_tok_s", 384, 128, 128, 5586),
        Point(TRTLLM, val, a100, "throughput_tok_s", 60, 128, 2048, 1928),
        Point(TRTLLM, val, a100, "throughput_tok_s", 52, 2048, 128, 591),
        Point(TRTLLM, val, a100, "ttft_ms", 1, 128, 1, 16),
        Point(TRTLLM, val, a100, "ttft_ms", 1, 2048, 1, 133),
        Point(TRTLLM, val, h100, "throughput_tok_s", 768, 128, 128, 19694),
        Point(TRTLLM, val, h100, "throughput_tok_s", 112, 128, 2048, 6818),
        Point(TRTLLM, val, h100, "throughput_tok_s", 80, 2048, 128, 2244),
        Point(TRTLLM, val, h100, "throughput_tok_s", 48, 2048, 2048, 2740),
        Point(TRTLLM, val, h100, "ttft_ms", 1, 128, 1, 7),
        Point(TRTLLM, val, h100, "ttft_ms", 1, 2048, 1, 36),
    ]
    lm = "A100-80G FP16 Llama-2-7B (TurboMind)"
    # (batch, prompt, output, per-token latency p50 in s) of the llama2-7b static table.
    tpot = [
        (1, 1, 128, 0.009), (1, 128, 128, 0.01), (1, 128, 2048, 0.01), (1, 2048, 128, 0.01),
        (1, 2048, 2048, 0.011), (16, 1, 128, 0.01), (16, 128, 128, 0.011), (16, 128, 2048, 0.015),
        (16, 2048, 128, 0.02), (16, 2048, 2048, 0.025), (32, 1, 128, 0.011), (32, 128, 128, 0.012),
        (32, 128, 2048, 0.021), (32, 2048, 128, 0.031), (32, 2048, 2048, 0.04),
        (64, 1, 128, 0.012), (64, 128, 128, 0.014), (64, 128, 2048, 0.03), (64, 2048, 128, 0.046),
        (64, 2048, 2048, 0.047),
    ]  # fmt: skip
    pts += [Point(LMDEPLOY, cal, lm, "tpot_ms", b, p, o, s * 1e3) for b, p, o, s in tpot]
    # Batch 1: FTL(ave) of the rows with prompts of 1, 128 and 2048 tokens (one row each).
    pts += [
        Point(LMDEPLOY, cal, lm, "ttft_ms", 1, p, 1, s * 1e3)
        for p, s in ((1, 0.011), (128, 0.022), (2048, 0.139))
    ]
    return tuple(pts)


POINTS = _points()


def _setup(p: Point) -> tuple[LlmModel, GpuRoof]:
    if p.setup.startswith("H100"):
        return fp8(LLAMA2_7B, H100_80G)
    return LLAMA2_7B, A100_80G


def predict(p: Point, eff: Efficiency, stride: int = 1) -> float:
    """The model's value for a point's metric (its unit)."""
    model, roof = _setup(p)
    if p.metric == "ttft_ms":
        return iteration_s(Batch(0, 0, ((p.prompt, 0),), 1), model, roof, eff) * 1e3
    if p.metric == "tpot_ms":
        # The median token of the run: the context half-way through the output.
        ctx = p.batch * (p.prompt + p.output // 2)
        return iteration_s(Batch(p.batch, ctx, (), p.batch), model, roof, eff) * 1e3
    _, _, total = static_batch_s(p.batch, p.prompt, p.output, model, roof, eff, stride)
    return p.batch * p.output / total


def log_error(p: Point, eff: Efficiency, stride: int = 1) -> float:
    """``ln(model / measured)``: symmetric in over- and under-estimates."""
    return math.log(predict(p, eff, stride) / p.measured)


def fit(points: tuple[Point, ...] = POINTS) -> Efficiency:
    """The constants minimising the squared log error over the calibration points.

    A deterministic pattern search from (0.8, 0.7, 2 us) over ``bw_frac`` and ``flop_frac`` in
    (0, 1] and ``floor_s`` in [0, 20 us], halving the step until it is below 0.001 (fractions)
    and 0.01 us; decode steps sampled every 8 (``static_batch_s``'s stride).
    """
    cal = [p for p in points if p.role == "calibration"]

    def cost(x: tuple[float, float, float]) -> float:
        eff = Efficiency(x[0], x[1], x[2] * 1e-6)
        return math.fsum(log_error(p, eff, 8) ** 2 for p in cal)

    x = (0.8, 0.7, 2.0)
    steps = [0.1, 0.1, 2.0]
    best = cost(x)
    while steps[0] > 1e-3:
        moved = False
        for i in range(3):
            for sign in (1.0, -1.0):
                y = list(x)
                y[i] += sign * steps[i]
                hi = 20.0 if i == 2 else 1.0
                lo = 0.0 if i == 2 else 0.05
                if not lo <= y[i] <= hi:
                    continue
                c = cost((y[0], y[1], y[2]))
                if c < best - 1e-15:
                    best, x, moved = c, (y[0], y[1], y[2]), True
        if not moved:
            steps = [s / 2 for s in steps]
    return Efficiency(round(x[0], 4), round(x[1], 4), round(x[2], 3) * 1e-6)


@dataclass(frozen=True, slots=True)
class Row:
    """One point's result."""

    point: Point
    model: float

    @property
    def error(self) -> float:
        """Relative error of the model, ``model / measured - 1``."""
        return self.model / self.point.measured - 1.0


def evaluate(eff: Efficiency, points: tuple[Point, ...] = POINTS) -> list[Row]:
    """Every point's model value under ``eff`` (exact: every decode step computed)."""
    return [Row(p, predict(p, eff)) for p in points]
