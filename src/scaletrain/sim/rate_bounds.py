"""The physical bound on fitted efficiency: no effective GEMM or attention rate above 90% of the datasheet peak.

A fitted set prices a GEMM at its GPU's kernel ceiling times `gemm_eff` (times the SKU's and the benchmark's fitted
multipliers, `efficiency.specialise`), and flash attention at `attn_tflops` times the same gemm_eff
(`sim/compute.py`). Nothing in the least-squares fit stops that product from passing the hardware's dense peak, where
it stops being a rate any kernel reaches and becomes a term absorbing another term's error (issue #28: GB300 FP8 at
104% of its peak under the v5.1 set). This module states the bound, computes the rates a set gives on a GPU and the
largest gemm_eff the bound allows (what `efficiency.efficiency_for` and the fit clamp to); `sim/fit/rate_table.py`
enumerates every fitted set x GPU x benchmark for `scaletrain sim validate --rates` and the tests. Torch-free.
"""

from __future__ import annotations

import math
from typing import Protocol

from scaletrain.sim.catalog import GPU, MEASURED


class Efficiency(Protocol):
    """What the bound reads of an `efficiency.Efficiency` (which imports this module to cap every set it hands out)."""

    @property
    def gemm_eff(self) -> float: ...

    @property
    def fp4_eff(self) -> float: ...


PEAK_FRACTION = 0.9
"""Largest effective rate, as a fraction of the datasheet dense peak, that any fitted set may give a GEMM or
attention inside a training step (issue #28, "Bounds and catalog": "No effective GEMM or attention rate may exceed
90% of the datasheet dense peak, for any fitted set x GPU x benchmark"). The best measured large square GEMMs
reach 72-80% of the peak (docs/perf-model.md, "Hardware": H100 795/989, B200 1745/2250, GB200 3600/5000 FP8), so
90% already leaves room above every measured kernel; a fit that wants more is pricing something else into the
GEMM rate."""

KINDS = ("gemm_bf16", "gemm_fp8", "gemm_fp4", "attention", "attention_fp8")
"""The rates bounded: GEMMs per precision and the flash-attention forward in bf16 and, where the catalog has an FP8
attention rate (`GPU.attn_fp8_tflops`), in FP8 (bounded by the FP8 peak)."""


def _ceilings(gpu: GPU) -> dict[str, tuple[float, float, str]]:
    """kind -> (the rate a gemm_eff of 1 gives, its datasheet dense peak, the ceiling's basis), mirroring
    compute.gemm_time: a measured GEMM curve replaces the ceiling (its fastest point is the rate at eff 1), FP8
    without an FP8 ceiling runs at the bf16 one, FP4 is priced only where the GPU has an FP4 ceiling."""
    out: dict[str, tuple[float, float, str]] = {}
    bf16 = max(r for _, r in gpu.gemm_curve_bf16) if gpu.gemm_curve_bf16 else gpu.matmul_bf16_tflops
    bf16_basis = MEASURED if gpu.gemm_curve_bf16 else gpu.basis("matmul_bf16")
    out["gemm_bf16"] = (bf16, gpu.bf16_tflops, bf16_basis)
    if gpu.gemm_curve_fp8:
        out["gemm_fp8"] = (max(r for _, r in gpu.gemm_curve_fp8), gpu.fp8_tflops, MEASURED)
    elif gpu.matmul_fp8_tflops > 0:
        out["gemm_fp8"] = (gpu.matmul_fp8_tflops, gpu.fp8_tflops, gpu.basis("matmul_fp8"))
    elif gpu.fp8_tflops > 0:  # FP8 tensor cores but no FP8 ceiling: compute.py prices FP8 GEMMs at the bf16 one
        out["gemm_fp8"] = (gpu.matmul_bf16_tflops, gpu.fp8_tflops, gpu.basis("matmul_bf16"))
    if gpu.matmul_fp4_tflops > 0:
        out["gemm_fp4"] = (gpu.matmul_fp4_tflops, gpu.fp4_tflops, gpu.basis("matmul_fp4"))
    out["attention"] = (gpu.attn_tflops, gpu.bf16_tflops, gpu.basis("attn"))
    if gpu.attn_fp8_tflops > 0 and gpu.fp8_tflops > 0:
        # Derived from the bf16 rate (FlashAttention-3's FP8/bf16 ratio: gpus.toml): its basis is never "measured".
        out["attention_fp8"] = (gpu.attn_fp8_tflops, gpu.fp8_tflops, "derived")
    return out


def peaks(gpu: GPU) -> dict[str, float]:
    """The datasheet dense peak (TFLOP/s) each of `effective_rates`' kinds is bounded by: bf16 for bf16 GEMMs and
    attention, the FP8 and FP4 peaks for those GEMMs."""
    return {kind: peak for kind, (_, peak, _) in _ceilings(gpu).items()}


def effective_rates(eff: Efficiency, gpu: GPU) -> dict[str, float]:
    """The fastest TFLOP/s `eff` lets a training step reach on `gpu`, per kind of KINDS the GPU prices: the GEMM
    ceiling (or measured curve's fastest point) x gemm_eff, FP4 also x fp4_eff, attention attn_tflops x gemm_eff,
    exactly as sim/compute.py prices them. `eff` is a specialised set (`efficiency_for`), so its gemm_eff already
    carries the SKU's and the benchmark's multipliers."""
    return {
        kind: ceiling * eff.gemm_eff * (eff.fp4_eff if kind == "gemm_fp4" else 1.0)
        for kind, (ceiling, _, _) in _ceilings(gpu).items()
    }


def max_gemm_eff(gpu: GPU, fp4_eff: float = 1.0) -> float:
    """The largest gemm_eff (set x SKU x benchmark multipliers together) for which every rate `effective_rates`
    gives on `gpu` stays at or below PEAK_FRACTION of its peak; infinite when the GPU prices nothing (no ceiling).
    A ceiling without a datasheet peak (a catalog entry with an FP4 ceiling but no FP4 peak) allows 0."""
    limits = [
        PEAK_FRACTION * peak / (ceiling * (fp4_eff if kind == "gemm_fp4" else 1.0))
        for kind, (ceiling, peak, _) in _ceilings(gpu).items()
        if ceiling > 0 and (kind != "gemm_fp4" or fp4_eff > 0)
    ]
    return min(limits, default=math.inf)
