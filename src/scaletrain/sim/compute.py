"""Per-layer compute time on one GPU: GEMMs from the measured ceiling and a size roll-off, flash attention,
and memory-bound elementwise work, for one micro-batch under a given TP/CP split.

A GEMM of F FLOPs takes F / (ceiling * eff) + kernel_us, where `ceiling` is the measured large-GEMM rate of the
GPU in that precision and `eff` the software-release efficiency the calibration fits (how close a framework
release gets to the kernel ceiling inside a training step). With a measured curve in the catalog the curve's rate
at that size replaces the roll-off.

FP8 attention (`layout.fp8_attention`, with fp8) runs the attention core at the catalog's FP8 flash-attention rate
(`attention_tflops`); otherwise attention is bf16, FP8 and FP4 recipes alike.

FP4 (`layout.fp4`, NVFP4 on Blackwell, MXFP4 on CDNA 4) prices the GEMMs FP8 would cover (the transformer layers'
base projections, forward and both backward GEMMs) at the FP4 ceiling; attention, the output layer, the embedding
and LoRA adapters stay bf16, and casts, gradients and memory are as with FP8 (quantizing to FP4 reads the bf16
input and writes a smaller copy plus block scales: no more traffic than the FP8 cast priced here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.sim.catalog import GPU
from scaletrain.sim.workload import ClusterLayout, Workload

TB = 1e12

# Bytes moved by the memory-bound ops of one layer per token per hidden unit, forward (bf16 activations):
# two LayerNorms (read+write h each), two bias+residual adds (read 2h, write h each), and the MLP activation
# (read and write the ffn-wide tensor) counted separately below. Backward moves about twice that.
_ELEMENTWISE_H_BYTES = 2 * (2 + 2 + 3 + 3)
# FP8 casts: the bf16 GEMM inputs are read and written as 1-byte FP8 (3 bytes per element) once per GEMM input.
_FP8_CAST_BYTES = 3


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer and one micro-batch on one GPU."""

    fwd: float
    """Forward (GEMMs + attention + elementwise)."""
    bwd: float
    """Backward, including recomputation."""
    attn_fwd: float
    """The attention-core part of fwd (what context-parallel K/V exchange can hide under)."""
    gemm_fwd: float
    """The GEMM part of fwd (what TP communication can overlap with)."""
    gemm_bwd: float = 0.0
    """The GEMM part of bwd without recomputation (data gradients, and weight gradients of trained weights)."""
    gemm_wgrad: float = 0.0
    """Of gemm_bwd, the weight gradients of trained weights: what a zero-bubble schedule defers (`schedule` zb_h1)."""


def gemm_time(gpu: GPU, flops: float, fp8: bool, eff: float, fp4: bool = False, fp4_eff: float = 1.0) -> float:
    """Seconds for one GEMM of `flops` FLOPs (fp4: at the FP4 ceiling, for a GEMM that would otherwise run in FP8;
    `fp4_eff` is the fraction of the FP4 ceiling reached relative to FP8's, `Efficiency.fp4_eff`)."""
    if fp4 and fp8 and gpu.matmul_fp4_tflops > 0:
        # No measured FP4 curve exists yet: the kernel_us roll-off at the FP4 ceiling.
        return flops / (gpu.matmul_fp4_tflops * TB * eff * fp4_eff) + gpu.kernel_us * 1e-6
    curve = gpu.gemm_curve_fp8 if fp8 else gpu.gemm_curve_bf16
    if curve:
        rate = _interp_curve(curve, flops / 1e9) * TB
        return flops / (rate * eff)
    ceiling = (gpu.matmul_fp8_tflops if fp8 and gpu.matmul_fp8_tflops > 0 else gpu.matmul_bf16_tflops) * TB
    return flops / (ceiling * eff) + gpu.kernel_us * 1e-6


GROUPED_TILE_ROWS = 128
"""Row tile of a grouped GEMM kernel (CUTLASS's grouped GEMMs and torch._grouped_mm use 128-row tiles, DeepGEMM's
contiguous layout aligns each expert's rows to its 128-row M block): each expert's rows are padded to a multiple
of it."""

# Bytes per element of a GEMM operand in HBM. bf16: 2. FP8: 1 plus MXFP8 block scales, one 8-bit E8M0 scale per 32
# elements (OCP Microscaling Formats v1.0; Blackwell's FP8 recipes), so 1 + 1/32; Hopper's per-tensor or 128x128
# block scales carry less (1 byte, within 3%). FP4: NVFP4, 4-bit values plus one E4M3 scale per 16 elements
# (NVIDIA, "Introducing NVFP4", 2025), 0.5 + 1/16; CDNA 4's MXFP4 (one scale per 32) is 0.5 + 1/32, 6% less on the
# weights: the FP4 figure is the larger of the two.
_BF16_BYTES = 2.0
_FP8_BYTES = 1.0 + 1.0 / 32
_FP4_BYTES = 0.5 + 1.0 / 16

GROUPED_PASSES = ("fprop", "dgrad", "wgrad")
"""The three GEMMs of a linear layer: forward Y = X W, data gradient dX = dY W^T, weight gradient dW = X^T dY."""


def grouped_gemm_time(
    gpu: GPU,
    m: float,
    n: int,
    k: int,
    groups: int,
    fp8: bool,
    eff: float,
    fp4: bool = False,
    fp4_eff: float = 1.0,
    kind: str = "fprop",
    grad_bytes: float = 4.0,
) -> float:
    """Seconds for one grouped GEMM pass over `groups` experts of one weight [k, n] each, sharing `m` routed rows.

    Each expert runs its own GEMM inside one kernel (one launch, `gpu.kernel_us`, paid once). The rows are routed
    independently, so E(1 - (1 - 1/E)^m) of the E experts get any (all of them once m is a few times E) and those
    share the rows evenly, m_e each. One expert's time is the roofline of its two limits:

        time_e = max(flops_e / compute rate, bytes_e / hbm_copy_tbps)

    - flops_e = 2 * pad(m_e) * n * k, pad rounding up to the kernel's 128-row tile (`GROUPED_TILE_ROWS`): a tile
      computes all its rows whether routed rows fill it or not. The compute rate is the measured GEMM ceiling in
      that precision times the release efficiency `eff` (FP4: the FP4 ceiling times `fp4_eff` too), or, where the
      catalog has a measured curve, the curve read at one expert's padded FLOPs (no separate launch cost then: the
      curve holds it).
    - bytes_e is what the pass must move through HBM at the operands' precisions (FP8/FP4 with their block scales,
      outputs bf16): the expert's whole weight whatever m_e is, plus its rows.
        fprop  reads W [k, n] and X [m_e, k], writes Y [m_e, n] (bf16);
        dgrad  reads W and dY [m_e, n], writes dX [m_e, k] (bf16);
        wgrad  reads X and dY and accumulates dW [k, n] into the main gradient (read and write `grad_bytes` each:
               Megatron's gradient-accumulation fusion, fp32 unless gradients are kept in bf16).
      The HBM rate is the measured copy bandwidth, not scaled by `eff` (that efficiency is the GEMM kernels').

    Few rows per expert make the weight reads the limit: time is nearly flat in m_e below the crossover m_e ~ compute
    rate / (2 * hbm rate) * weight bytes per element (about 240 rows for an FP8 fprop on H100, ~1,900 for the fp32
    wgrad), and converges to FLOPs / compute rate above it. A forward over the experts' weights at small m is
    therefore a weight stream, as DeepGEMM's published H800 rates show (docs/perf-model.md, Mixture-of-Experts)."""
    if kind not in GROUPED_PASSES:
        raise ValueError(f"grouped GEMM pass {kind!r}: expected one of {', '.join(GROUPED_PASSES)}")
    groups = max(1, groups)
    if m <= 0:
        return 0.0
    # Experts that receive any of the m rows (each row lands on one of the E experts at random) share them evenly.
    touched = groups * -math.expm1(m * math.log1p(-1.0 / groups)) if groups > 1 else 1.0
    rows = m / touched
    padded = math.ceil(rows / GROUPED_TILE_ROWS) * GROUPED_TILE_ROWS
    flops = 2.0 * padded * n * k
    low = fp4 and fp8 and gpu.matmul_fp4_tflops > 0
    curve = gpu.gemm_curve_fp8 if fp8 else gpu.gemm_curve_bf16
    launch = 0.0
    if curve and not low:
        rate = _interp_curve(curve, flops / 1e9) * TB * eff
    elif low:
        # No measured FP4 curve exists yet: the ceiling and one launch.
        rate, launch = gpu.matmul_fp4_tflops * TB * eff * fp4_eff, gpu.kernel_us * 1e-6
    else:
        ceiling = gpu.matmul_fp8_tflops if fp8 and gpu.matmul_fp8_tflops > 0 else gpu.matmul_bf16_tflops
        rate, launch = ceiling * TB * eff, gpu.kernel_us * 1e-6
    # A GPU without FP8 tensor cores runs an FP8 layout's GEMMs in bf16 (`gemm_time`), operands included.
    operand = _FP4_BYTES if low else (_FP8_BYTES if fp8 and gpu.matmul_fp8_tflops > 0 else _BF16_BYTES)
    if kind == "fprop":
        moved = operand * (n * k + rows * k) + _BF16_BYTES * rows * n
    elif kind == "dgrad":
        moved = operand * (n * k + rows * n) + _BF16_BYTES * rows * k
    else:
        moved = operand * rows * (k + n) + 2 * grad_bytes * n * k
    per_expert = max(flops / rate, moved / (gpu.hbm_copy_tbps * TB))
    return touched * per_expert + launch


def _interp_curve(curve, gflop: float) -> float:
    pts = sorted(curve)
    if gflop <= pts[0][0]:
        return pts[0][1] * gflop / pts[0][0]  # below the smallest point: fixed time, rate falls linearly
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if gflop <= x1:
            return y0 + (y1 - y0) * (gflop - x0) / (x1 - x0)
    return pts[-1][1]


ATTN_HALF_RATE_KEYS = 1200.0
"""Key length at which a flash-attention kernel reaches half its long-sequence rate: rate(L) = R x L / (L + L0). Fitted
to FlashAttention-3's published H100 causal forward rates at head dim 128 (Shah et al. 2024, "FlashAttention-3",
Fig. 5: about 200, 300, 430, 540, 610 and 640 TFLOP/s at 512, 1k, 2k, 4k, 8k and 16k keys; L0 = 1,200 gives 206, 317,
434, 535, 600 and 642): short blocks leave the tensor cores waiting on the softmax and the tile prologue/epilogue."""
ATTN_CEILING_KEYS = 8192
"""Key length from which a kernel runs at the catalog's `attn_tflops`: the sequence of every Llama benchmark, so their
unsplit attention is priced at the catalog rate and shorter blocks (GPT-3's 2,048, a context-parallel block) below
it; longer ones stay at it."""


def attention_rate(gpu: GPU, keys: float, layout: ClusterLayout | None = None) -> float:
    """TFLOP/s of a flash-attention kernel over blocks of `keys` keys per query (`ATTN_HALF_RATE_KEYS`): the catalog's
    rate for the layout's attention precision (`attention_tflops`; bf16 without a layout) at ATTN_CEILING_KEYS."""
    ceiling = attention_tflops(gpu, layout) if layout is not None else gpu.attn_tflops

    def shape(n: float) -> float:
        return n / (n + ATTN_HALF_RATE_KEYS)

    # Longer blocks gain a few percent more in FA3's curve; the catalog rate stays the ceiling (rate_bounds).
    return ceiling * min(1.0, shape(max(keys, 1.0)) / shape(ATTN_CEILING_KEYS))


def moe_share(w: Workload) -> float:
    """Fraction of the layers that are Mixture-of-Experts (the per-layer times are the mean over the layers)."""
    if not w.shape.experts:
        return 1.0
    return (w.shape.layers - min(w.shape.dense_layers, w.shape.layers)) / w.shape.layers


def _mlp_width(w: Workload, t: int) -> float:
    """MLP activation width per token on one TP rank, averaged over the layers: the dense d_ff split by TP, or an MoE
    layer's top-k routed experts (whole, on the rank's sequence shard) plus its shared experts."""
    if not w.shape.experts:
        return w.shape.ffn / t
    share = moe_share(w)
    moe = (w.shape.top_k * w.shape.expert_ffn + w.shape.shared_experts * w.shape.expert_ffn) / t
    return share * moe + (1 - share) * w.shape.ffn / t


def layer_gemms(w: Workload, layout: ClusterLayout) -> list[tuple[int, int, int]]:
    """(M, N, K) of the forward GEMMs of one layer and micro-batch on one GPU (adapters included), in the order of
    the inventory's `layer` list (sim/layers.py)."""
    return w.inventory.gemm_shapes(layout.mbs * w.seq_len // layout.cp, layout.tp)


def layer_times(w: Workload, layout: ClusterLayout, gpu: GPU, gemm_eff: float, fp4_eff: float = 1.0) -> LayerTimes:
    """Forward and backward seconds of one transformer layer for one micro-batch on one GPU (`fp4_eff`: see
    `gemm_time`)."""
    t, cp, b, s = layout.tp, layout.cp, layout.mbs, w.seq_len
    tokens = b * s // cp
    gemm_f = gemm_b = gemm_w = 0.0
    for g, (m, n, k) in zip(w.inventory.layer, layer_gemms(w, layout)):
        fp8 = layout.fp8 and g.fp8
        if g.experts > 1:
            # Routed experts: one grouped GEMM per pass over this rank's experts. The layer waits for the busiest
            # expert rank, which receives moe_imbalance times the mean rows (its weights are read once whatever
            # the rows, so imbalance costs little where the experts are memory-bound); leading dense layers have
            # none, hence the MoE share.
            local = max(1, g.experts // max(1, layout.ep))
            rows = m * layout.moe_imbalance
            grad_bytes = 2.0 if layout.bf16_grads else 4.0
            passes = {
                kind: grouped_gemm_time(gpu, rows, n, k, local, fp8, gemm_eff, layout.fp4, fp4_eff, kind, grad_bytes)
                for kind in GROUPED_PASSES
                if g.trainable or kind != "wgrad"
            }
            gemm_f += passes["fprop"] * moe_share(w)
            gemm_b += (passes["dgrad"] + passes.get("wgrad", 0.0)) * moe_share(w)
            gemm_w += passes.get("wgrad", 0.0) * moe_share(w)
            continue
        one = gemm_time(gpu, 2.0 * m * n * k, fp8, gemm_eff, fp4=layout.fp4, fp4_eff=fp4_eff)
        if g.name == "router" or g.name.startswith("shared."):
            one *= moe_share(w)
        gemm_f += one
        # Backward: data gradient always; weight gradient only for trained weights (LoRA freezes the base).
        gemm_b += one * (2 if g.trainable else 1)
        gemm_w += one if g.trainable else 0.0
    if w.shape.experts and w.shape.dense_layers:
        # The leading dense layers' MLP, at their share of the mean layer.
        for g in w.inventory.dense_base:
            if g.name in ("fc1", "fc2"):
                m, n, k = g.mnk(tokens, t)
                one = gemm_time(gpu, 2.0 * m * n * k, layout.fp8 and g.fp8, gemm_eff, fp4=layout.fp4, fp4_eff=fp4_eff)
                gemm_f += one * (1 - moe_share(w))
                gemm_b += one * (1 - moe_share(w)) * (2 if g.trainable else 1)
                gemm_w += one * (1 - moe_share(w)) if g.trainable else 0.0
    # Flash attention computes the causal half of the s^2 work Megatron's FLOPs count; backward recomputes
    # the scores, about 2.5x the forward.
    # (Per token: the inventory's QK^T + AV FLOPs over the keys it attends to, sliding windows and MLA widths included.)
    att = w.inventory.attention
    keys = w.inventory.attention_tokens(s)
    attn_flops = (b * s / cp) * att.forward_flops(keys) / t * 0.5
    # Context parallelism runs attention as cp partial blocks (one per K/V chunk of keys/cp keys) plus a merge: more,
    # smaller kernels, each at the rate of its block length.
    attn_f = attn_flops / (attention_rate(gpu, keys / cp, layout) * TB * gemm_eff) + 2 * cp * gpu.kernel_us * 1e-6
    attn_b = 2.5 * attn_f
    # Elementwise traffic shrinks by t only under sequence parallelism (otherwise every TP rank holds the
    # whole sequence in the LayerNorm/residual regions).
    split = t if layout.sp else 1
    # The MLP activation reads its input and writes its output: GELU f + f, SwiGLU 2f (gate, up) + f, bf16.
    ffn = _mlp_width(w, t)
    h_bytes = _ELEMENTWISE_H_BYTES * w.shape.hidden / split + 2 * ffn * (3 if w.shape.gated else 2)
    if layout.fp8:
        h_bytes += _FP8_CAST_BYTES * (2 * w.shape.hidden + w.shape.hidden / t + ffn)
    if w.shape.experts:
        # Token permutation around the routed experts, at the MoE layers' share: dispatch gathers top-k copies of
        # each (sequence-shard) token row into expert order (read and write) and combine scatters the weighted
        # results back (read and write), bf16.
        h_bytes += moe_share(w) * 4 * 2 * w.shape.top_k * w.shape.hidden / t
    elem_f = tokens * h_bytes / (gpu.hbm_copy_tbps * TB)
    fwd = gemm_f + attn_f + elem_f
    bwd = gemm_b + attn_b + 2 * elem_f
    if layout.recompute == "full":
        bwd += fwd
    elif layout.recompute == "selective":
        bwd += attn_f
    return LayerTimes(fwd=fwd, bwd=bwd, attn_fwd=attn_f, gemm_fwd=gemm_f, gemm_bwd=gemm_b, gemm_wgrad=gemm_w)


def attention_tflops(gpu: GPU, layout: ClusterLayout) -> float:
    """The flash-attention rate `layout` runs at on `gpu`: the FP8 one (`GPU.attn_fp8_tflops`) for FP8 attention on
    an FP8 layout where the catalog has one, else bf16's. FP8 attention runs its backward in FP8 too
    (NVTE_FP8_DPA_BWD=1 in every published config that sets FP8_DPA=1), so both directions take this rate."""
    if layout.fp8_attention and layout.fp8 and gpu.attn_fp8_tflops > 0:
        return gpu.attn_fp8_tflops
    return gpu.attn_tflops


def logits_times(w: Workload, layout: ClusterLayout, gpu: GPU, gemm_eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and loss on the last pipeline stage (bf16)."""
    tokens = layout.mbs * w.seq_len // layout.cp
    head = w.inventory.logits
    one = gemm_time(gpu, 2.0 * tokens * head.k * head.n / layout.tp, False, gemm_eff)
    # Cross-entropy reads fp32 logits a few times (max, exp-sum, grad).
    ce = 3 * 4 * tokens * w.shape.vocab / layout.tp / (gpu.hbm_copy_tbps * TB)
    return one + ce, one * (2 if head.trainable else 1) + ce


def embedding_times(w: Workload, layout: ClusterLayout, gpu: GPU) -> tuple[float, float]:
    """(forward, backward) seconds of the input embedding on the first stage (a gather; memory-bound)."""
    tokens = layout.mbs * w.seq_len // layout.cp
    moved = 2 * 2 * tokens * w.shape.hidden / (layout.tp if layout.sp else 1)
    return moved / (gpu.hbm_copy_tbps * TB), 2 * moved / (gpu.hbm_copy_tbps * TB)
