"""No fitted set may price a GPU faster than physics: every effective GEMM and attention rate stays at or below 90% of
the datasheet dense peak (placeholder until the catalog part lands)."""

from __future__ import annotations

PEAK_FRACTION = 0.9


def max_gemm_eff(gpu, fp4_eff: float = 1.0) -> float:
    """The largest gemm_eff for which every effective rate on `gpu` stays <= PEAK_FRACTION x its dense peak."""
    caps = []
    bf16 = max([gpu.matmul_bf16_tflops] + [r for _, r in gpu.gemm_curve_bf16])
    caps.append(PEAK_FRACTION * gpu.bf16_tflops / bf16)
    caps.append(PEAK_FRACTION * gpu.bf16_tflops / gpu.attn_tflops)
    if gpu.fp8_tflops > 0:
        fp8 = max([gpu.matmul_fp8_tflops] + [r for _, r in gpu.gemm_curve_fp8])
        if fp8 > 0:
            caps.append(PEAK_FRACTION * gpu.fp8_tflops / fp8)
    if gpu.fp4_tflops > 0 and gpu.matmul_fp4_tflops > 0:
        caps.append(PEAK_FRACTION * gpu.fp4_tflops / (gpu.matmul_fp4_tflops * fp4_eff))
    return min(caps)
