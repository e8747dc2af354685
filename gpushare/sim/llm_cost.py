"""What one iteration of an LLM server costs on a GPU: a per-kernel roofline.

An iteration of a continuous-batching server (vLLM, SGLang, TensorRT-LLM) runs one forward pass
over every token scheduled in it: one new token for each sequence in decode, and a chunk of the
prompt for each sequence in prefill. The pass is the same sequence of kernels for every layer
(:func:`layer_kernels`, the kernels a vLLM Llama layer launches: RMSNorm, the fused QKV GEMM,
rotary embedding, attention, the output projection, the fused residual add + RMSNorm, the fused
gate/up GEMM, SiLU-and-multiply, the down projection), plus the embedding, the final norm, the LM
head over the sequences that emit a token, and sampling.

Each kernel's duration is a roofline: ``max(bytes / (bw x bw_frac), flops / (peak x flop_frac))``
plus ``floor_s``, the part that does not scale with work (launch, ramp-up, the last wave's tail).
``bw_frac``, ``flop_frac`` and ``floor_s`` are the model's three constants (:class:`Efficiency`),
fitted on published measurements of one GPU and one model (``gpushare/sim/llm_validation.py``,
``docs/simulator.md`` section 7); the bytes and FLOPs are counted from the model's shapes.

Kernels are merged like the Orion profiles (``docs/simulator.md`` G11): consecutive kernels into
chunks of at most :data:`MERGE_S`; a longer kernel stays alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: Chunk bound when merging an iteration's kernels (the inference profiles' bound, G11).
MERGE_S = 50e-6
#: GEMM output tile edge (rows and columns) used to count a GEMM's thread blocks, so its waves.
GEMM_TILE = 128


@dataclass(frozen=True, slots=True)
class LlmModel:
    """A decoder-only transformer (Llama shapes), weights and KV cache in ``dtype_bytes``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection: ``kv_heads x head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer (QKV, output, gate/up, down; norms neglected)."""
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + h * 2 * self.ffn + self.ffn * h

    @property
    def params(self) -> int:
        """All weights: the layers, the embedding and the LM head (untied, as Llama's)."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token holds over all layers (K and V)."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes


#: Llama-2-7B (and LLaMA-7B: same shapes), FP16.
LLAMA2_7B = LlmModel(
    "llama-2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000
)
#: Llama-3-8B, BF16 (grouped-query attention: 8 KV heads).
LLAMA3_8B = LlmModel(
    "llama-3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256
)


@dataclass(frozen=True, slots=True)
class GpuRoof:
    """A GPU's roof: memory bandwidth and dense FP16/BF16 tensor throughput (vendor datasheets)."""

    name: str
    mem_bw_bytes_per_s: float
    peak_flops_per_s: float
    sm_count: int
    mem_bytes: int


#: A100 SXM4 80 GB: 2,039 GB/s HBM2e, 312 TFLOPS dense FP16 tensor, 108 SMs (NVIDIA A100 datasheet).
A100_80G = GpuRoof("a100-sxm4-80gb", 2.039e12, 312e12, 108, 80 * 10**9)
#: H100 SXM5 80 GB: 3,350 GB/s HBM3, 989 TFLOPS dense FP16/BF16 tensor (1,979 FP8), 132 SMs
#: (NVIDIA H100 datasheet); :func:`fp8` gives its FP8 roof.
H100_80G = GpuRoof("h100-sxm5-80gb", 3.35e12, 989e12, 132, 80 * 10**9)
#: V100 SXM2 32 GB: 900 GB/s HBM2, 125 TFLOPS FP16 tensor, 80 SMs (NVIDIA V100 datasheet); the
#: GPU the shipped training profiles were measured on.
V100_32G = GpuRoof("v100-sxm2-32gb", 0.900e12, 125e12, 80, 32 * 2**30)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """The roofline's three constants: achieved fractions of the roofs, and a floor per kernel."""

    bw_frac: float
    flop_frac: float
    floor_s: float


#: Fitted on the 23 calibration points of :mod:`gpushare.sim.llm_validation` (LMDeploy, Llama-2-7B
#: FP16, one A100-80G) by ``llm_validation.fit()``; a test checks the fit still gives these.
#: ``bw_frac`` ends at the top of its range (0.998): the data cannot separate the bandwidth from
#: the per-kernel floor (13.3 us x 324 kernels = 4.3 ms of a 10.4 ms batch-1 step), so read the
#: pair as "decode costs weights / bandwidth + 4.3 ms", not as a measured bandwidth.
DEFAULT_EFFICIENCY = Efficiency(bw_frac=0.9984, flop_frac=0.5016, floor_s=13.281e-6)


@dataclass(frozen=True, slots=True)
class Batch:
    """What one iteration computes.

    ``decode`` sequences each add one token and read ``decode_ctx`` cached tokens in total;
    ``prefill`` holds, per prompt chunk, ``(new_tokens, cached_tokens_before)``; ``emit`` is how
    many sequences sample a token at the end (every decode, and each prefill that finishes its
    prompt).
    """

    decode: int
    decode_ctx: int
    prefill: tuple[tuple[int, int], ...]
    emit: int

    @property
    def tokens(self) -> int:
        """Tokens the pass runs through the layers."""
        return self.decode + sum(t for t, _ in self.prefill)


#: One kernel before merging: ``(dur_s, width_sms, memory_boundness, waves)``.
Row = tuple[float, int, float, int]


def _kernel(nbytes: float, flops: float, blocks: int, roof: GpuRoof, eff: Efficiency) -> Row:
    t_mem = nbytes / (roof.mem_bw_bytes_per_s * eff.bw_frac)
    t_flop = flops / (roof.peak_flops_per_s * eff.flop_frac)
    sms = roof.sm_count
    waves = max(1, math.ceil(blocks / sms))
    return (max(t_mem, t_flop) + eff.floor_s, sms, 1.0 if t_mem >= t_flop else 0.0, waves)


def _gemm(m: int, k: int, n: int, model: LlmModel, roof: GpuRoof, eff: Efficiency) -> Row:
    b = model.dtype_bytes
    nbytes = b * (k * n + m * k + m * n)
    blocks = math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
    return _kernel(nbytes, 2.0 * m * k * n, blocks, roof, eff)


def _elementwise(elems: float, model: LlmModel, roof: GpuRoof, eff: Efficiency) -> Row:
    return _kernel(elems * model.dtype_bytes, elems, roof.sm_count, roof, eff)


def layer_kernels(batch: Batch, model: LlmModel, roof: GpuRoof, eff: Efficiency) -> list[Row]:
    """The kernels of one layer for ``batch``, in launch order."""
    t = batch.tokens
    h, kv, f, b = model.hidden, model.kv_dim, model.ffn, model.dtype_bytes
    rows = [
        _elementwise(2 * t * h, model, roof, eff),  # RMSNorm: read, write
        _gemm(t, h, h + 2 * kv, model, roof, eff),  # QKV
        _elementwise(2 * t * (h + kv), model, roof, eff),  # rotary on Q and K (+ KV-cache write)
    ]
    if batch.decode:
        # Paged decode attention: reads every cached K and V of the batch once.
        nbytes = 2 * kv * b * batch.decode_ctx + 2 * b * batch.decode * h
        flops = 4.0 * h * batch.decode_ctx
        rows.append(_kernel(nbytes, flops, batch.decode * model.heads, roof, eff))
    if batch.prefill:
        # Flash attention over each chunk: causal within it, full over the cached prefix.
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in batch.prefill)
        nbytes = 2 * kv * b * sum(n + c for n, c in batch.prefill) + 2 * b * h * t
        blocks = sum(math.ceil(n / GEMM_TILE) for n, _ in batch.prefill) * model.heads
        rows.append(_kernel(nbytes, 4.0 * h * pairs, blocks, roof, eff))
    rows += [
        _gemm(t, h, h, model, roof, eff),  # output projection
        _elementwise(3 * t * h, model, roof, eff),  # fused residual add + RMSNorm
        _gemm(t, h, 2 * f, model, roof, eff),  # gate and up, fused
        _elementwise(3 * t * f, model, roof, eff),  # SiLU and multiply
        _gemm(t, f, h, model, roof, eff),  # down
    ]
    return rows


def iteration_rows(batch: Batch, model: LlmModel, roof: GpuRoof, eff: Efficiency) -> list[Row]:
    """Every kernel of one iteration, in launch order (before merging)."""
    layer = layer_kernels(batch, model, roof, eff)
    head = [_elementwise(2 * batch.tokens * model.hidden, model, roof, eff)]  # embedding
    tail = [
        _elementwise(2 * batch.emit * model.hidden, model, roof, eff),  # final norm
        _gemm(max(1, batch.emit), model.hidden, model.vocab, model, roof, eff),  # LM head
        _elementwise(3 * batch.emit * model.vocab, model, roof, eff),  # sampling
    ]
    return head + layer * model.layers + tail


def iteration_s(batch: Batch, model: LlmModel, roof: GpuRoof, eff: Efficiency) -> float:
    """One iteration's GPU time alone: the sum of its kernels."""
    return math.fsum(r[0] for r in iteration_rows(batch, model, roof, eff))


#: A kernel as the GPU model's streams take it: ``(dur_s, width, memory_boundness, wave_s, tail)``.
Chunk = tuple[float, int, float, float, float]


def merge(rows: list[Row], merge_s: float = MERGE_S) -> tuple[Chunk, ...]:
    """Merge consecutive kernels into chunks of at most ``merge_s`` (G11).

    A chunk's width and memory-boundness are duration-weighted; its wave length is the
    duration-weighted mean of its kernels' (a kernel of ``w`` waves: ``dur / w``); every chunk's
    last wave is full (the GEMM tiles' partial last wave is not modelled).
    """
    out: list[Chunk] = []
    acc_d = acc_w = acc_m = acc_wave = 0.0
    for d, w, m, waves in rows:
        if acc_d > 0.0 and acc_d + d > merge_s:
            out.append((acc_d, round(acc_w / acc_d), acc_m / acc_d, acc_wave / acc_d, 1.0))
            acc_d = acc_w = acc_m = acc_wave = 0.0
        acc_d += d
        acc_w += w * d
        acc_m += m * d
        acc_wave += d * d / waves
    if acc_d > 0.0:
        out.append((acc_d, round(acc_w / acc_d), acc_m / acc_d, acc_wave / acc_d, 1.0))
    return tuple(out)


def static_batch_s(
    batch: int,
    prompt: int,
    output: int,
    model: LlmModel,
    roof: GpuRoof,
    eff: Efficiency,
    stride: int = 1,
) -> tuple[float, float, float]:
    """A static batch alone: (prefill s, mean decode step s, total s).

    ``batch`` prompts of ``prompt`` tokens in one prefill iteration (which emits the first
    token), then ``output - 1`` decode iterations over all of them, the context growing by one
    each step: what TensorRT-LLM's ``gptSessionBenchmark`` times. With ``stride`` > 1 every
    ``stride``-th step is computed and stands for the ``stride`` steps from it (the fit's speed;
    a step's time is piecewise linear in the context, so the error is a fraction of a step's
    growth over ``stride`` tokens).
    """
    pre = iteration_s(Batch(0, 0, ((prompt, 0),) * batch, batch), model, roof, eff)
    total = 0.0
    n = 0
    for k in range(1, output, stride):
        weight = min(stride, output - k)
        total += weight * iteration_s(
            Batch(batch, batch * (prompt + k), (), batch), model, roof, eff
        )
        n += weight
    return pre, total / n if n else 0.0, pre + total


def fp8(model: LlmModel, roof: GpuRoof) -> tuple[LlmModel, GpuRoof]:
    """The model with FP8 weights and KV cache, and the GPU's FP8 roof (twice its FP16 FLOPs)."""
    return (
        replace(model, name=model.name + "-fp8", dtype_bytes=1),
        replace(roof, name=roof.name + "-fp8", peak_flops_per_s=2 * roof.peak_flops_per_s),
    )
