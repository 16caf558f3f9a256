"""The physical bound on fitted efficiency: no effective GEMM or attention rate above 90% of the datasheet peak.

A fitted set prices a GEMM at its GPU's kernel ceiling times `gemm_eff` (times the SKU's and the benchmark's fitted
multipliers, `efficiency.specialise`), and flash attention at `attn_tflops` times the same gemm_eff
(`sim/compute.py`). Nothing in the least-squares fit stops that product from passing the hardware's dense peak, where
it stops being a rate any kernel reaches and becomes a term absorbing another term's error (issue #28: GB300 FP8 at
104% of its peak under the v5.1 set). This module states the bound, computes the rates a set gives on a GPU, the
largest gemm_eff the bound allows (what the fit clamps to), and the table of every fitted set x GPU x benchmark
that `scaletrain sim validate --rates` prints and the tests check. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scaletrain import benchmarks
from scaletrain.sim.catalog import GPU, MEASURED, Catalog
from scaletrain.sim.efficiency import Efficiency, _release_key, _set_for, specialise

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


@dataclass(frozen=True)
class RateRow:
    """One effective rate of one fitted set on one GPU for one benchmark."""

    set: str
    """The set that prices it, as `efficiency_for` names it ("v5.1/blackwell", "v4.1/blackwell (for v4.0)")."""
    gpu: str
    """Catalog GPU key."""
    benchmark: str | None
    """MLPerf benchmark whose fitted scalars specialise the set; None for a model that is no benchmark."""
    kind: str
    """One of KINDS."""
    tflops: float
    """Effective TFLOP/s (`effective_rates`)."""
    peak_tflops: float
    """The datasheet dense peak it is bounded by (`peaks`)."""
    pct: float
    """tflops as a percentage of peak_tflops (infinite for a rate without a peak)."""
    basis: str
    """Whether the ceiling under the rate is "measured" or "derived" (`GPU.ceiling_basis`)."""

    def to_dict(self) -> dict:
        """Plain dict (pct rounded to 0.01; a rate without a peak has pct None)."""
        d = asdict(self)
        d["pct"] = round(self.pct, 2) if math.isfinite(self.pct) else None
        return d


def rate_table(doc: dict, catalog: Catalog) -> list[RateRow]:
    """Every effective rate of efficiency document `doc` (`efficiency.load_efficiencies()`'s form): for every
    release it has sets for, every catalog GPU (each priced by its generation's set, or the set that stands in for
    it: `efficiency_for`'s lookup), and every MLPerf benchmark (proxies aside) plus None, the rates of
    `effective_rates` with their peaks. A release whose sets cannot price a GPU (a "measured" set fitted on other
    hardware) has no rows for it."""
    sets = doc.get("sets", {})
    releases = sorted({k.split("/")[0] for k in sets}, key=_release_key)
    names: list[str | None] = [b for b in benchmarks.names() if not benchmarks.is_proxy(b)]
    names.append(None)
    rows = []
    for release in releases:
        for gpu in catalog.gpus.values():
            try:
                name, base = _set_for(sets, release, gpu.key, gpu.generation)
            except ValueError:
                continue
            for bench in names:
                eff = specialise(base, gpu.key, bench, doc.get("sku_gemm", {}), doc.get("benchmarks", {}))
                rates = effective_rates(eff, gpu)
                for kind, (_, peak, basis) in _ceilings(gpu).items():
                    pct = 100 * rates[kind] / peak if peak > 0 else math.inf
                    rows.append(RateRow(name, gpu.key, bench, kind, rates[kind], peak, pct, basis))
    return rows


def largest_by_kind(rows: list[RateRow]) -> dict[str, RateRow]:
    """The row with the largest pct of each kind present in `rows`, in KINDS order."""
    best: dict[str, RateRow] = {}
    for r in rows:
        if r.kind not in best or r.pct > best[r.kind].pct:
            best[r.kind] = r
    return {k: best[k] for k in KINDS if k in best}
