"""Fit the simulator to one GPU's measured layer timings (the JSON `benchmarks/gpu_mfu.py` writes): its GEMM curves and
ceilings become catalog overrides, and gemm_eff / step_overhead_s are fitted so simulated blocks and steps match."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from scaletrain.sim.catalog import CEILINGS, MEASURED, Catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.fit.calibrate import _golden
from scaletrain.sim.step import step_time
from scaletrain.sim.workload import ClusterLayout


def _gemm_curve(points: list[dict], dtype: str) -> tuple:
    """[(GFLOP, TFLOP/s), ...] of the measured GEMMs of one dtype, sorted; shapes of equal work merged (median)."""
    by_size: dict[float, list[float]] = {}
    for p in points:
        if p.get("dtype") != dtype or not p.get("seconds"):
            continue
        flops = 2.0 * p["m"] * p["n"] * p["k"]
        by_size.setdefault(round(flops / 1e9, 3), []).append(flops / p["seconds"] / 1e12)
    return tuple((g, sorted(r)[len(r) // 2]) for g, r in sorted(by_size.items()))


def _shape(entry: dict):
    from scaletrain.sim.workload import load_workload

    w = load_workload(entry["model"], tuple(entry.get("set", ())))
    return w, ClusterLayout(
        gpus=1, mbs=int(entry["mbs"]), gbs=int(entry["mbs"]), sp=False, fp8=bool(entry.get("fp8")), zero=0
    )


def measured_gpu_fields(timings: dict) -> dict:
    """The catalog GPU fields a layer-timings document measures: the GEMM curves and ceilings
    (gemm_curve_<dtype>, matmul_<dtype>_tflops), attn_tflops (the median causal forward rate, counted as compute.py
    does) and hbm_copy_tbps; only those it has."""
    over: dict = {}
    for dtype in ("bf16", "fp8"):
        curve = _gemm_curve(timings.get("gemm", []), dtype)
        if curve:
            over[f"gemm_curve_{dtype}"] = curve
            over[f"matmul_{dtype}_tflops"] = max(r for _, r in curve)
    ceil = timings.get("ceilings", {})
    for dtype in ("bf16", "fp8"):
        if ceil.get(f"gemm_{dtype}_tflops"):
            over[f"matmul_{dtype}_tflops"] = float(ceil[f"gemm_{dtype}_tflops"])
    if ceil.get("copy_gbps"):
        over["hbm_copy_tbps"] = float(ceil["copy_gbps"]) / 1000
    attn = [
        2 * 2 * a["mbs"] * a["seq_len"] ** 2 * a["heads"] * a["head_dim"] * 0.5 / a["fwd_s"]
        for a in timings.get("attention", [])
        if a.get("fwd_s")
    ]
    if attn:
        over["attn_tflops"] = sorted(attn)[len(attn) // 2] / 1e12
    return over


def fit_layer_timings(doc: dict, cat: Catalog, gpu: str | None = None, base=None) -> dict:
    """Fit the simulator to one GPU's measured layer timings (the JSON benchmarks/gpu_mfu.py writes).

    The measured GEMMs become gemm_curve_bf16/gemm_curve_fp8 (kernel rates by size, as the compute model prices
    GEMMs), the attention entries attn_tflops (causal forward FLOPs over forward time, counted as compute.py
    does), the copy ceiling hbm_copy_tbps; then gemm_eff is fitted so the simulated block forward+backward
    matches the measured blocks, and step_overhead_s so whole single-GPU steps match (when "steps" are given).
    Returns {"gpu", "catalog" (GPU fields to override), "efficiency" (Efficiency), "report"}.
    """
    from scaletrain.sim import compute
    from scaletrain.sim.efficiency import efficiency_for

    doc = doc.get("layer_timings", doc)  # the whole gpu_mfu.json works too
    key = gpu or doc.get("gpu")
    if not key:
        raise ValueError("the timings name no catalog GPU (measured on CPU?); pass --gpu to say which to fit")
    g0 = cat.gpu(key)
    eff0 = base or efficiency_for(None, g0.key, catalog=cat)[1]
    over = measured_gpu_fields(doc)
    g = replace(g0, **over)
    measured_blocks = [b for b in doc.get("blocks", []) if b.get("fwd_s")]
    blocks = [(*_shape(b), b["fwd_s"] + b["bwd_s"]) for b in measured_blocks]

    def block_err(e):
        return sum(
            math.log((lambda t: t.fwd + t.bwd)(compute.layer_times(w, lay, g, e.gemm_eff)) / m) ** 2
            for w, lay, m in blocks
        )

    eff = eff0
    if blocks:
        eff = replace(
            eff, gemm_eff=_golden(lambda v: block_err(replace(eff, gemm_eff=v)), 0.05, 3.0, eff.gemm_eff, iters=40)
        )
    _, node, fabric = cat.system(g0.key)
    cluster = Cluster(g, node, fabric, 1)
    steps = [(*_shape(s), s["step_s"]) for s in doc.get("steps", []) if s.get("step_s")]

    def step_err(e):
        return sum(math.log(step_time(w, lay, cluster, e).step_time_s / m) ** 2 for w, lay, m in steps)

    if steps:
        eff = replace(
            eff,
            step_overhead_s=_golden(
                lambda v: step_err(replace(eff, step_overhead_s=v)),
                0.0,
                max(eff0.step_overhead_s, 0.5),
                eff.step_overhead_s,
                iters=40,
            ),
        )
    report = {
        "blocks": [
            {
                "model": b["model"],
                "set": b.get("set", []),
                "mbs": b["mbs"],
                "fp8": bool(b.get("fp8")),
                "measured_s": m,
                "shipped_s": (lambda t: t.fwd + t.bwd)(compute.layer_times(w, lay, g0, eff0.gemm_eff)),
                "fitted_s": (lambda t: t.fwd + t.bwd)(compute.layer_times(w, lay, g, eff.gemm_eff)),
            }
            for b, (w, lay, m) in zip(measured_blocks, blocks)
        ],
        "gemm_eff": eff.gemm_eff,
        "step_overhead_s": eff.step_overhead_s,
        "rms_log_error_blocks": math.sqrt(block_err(eff) / len(blocks)) if blocks else None,
        "rms_log_error_steps": math.sqrt(step_err(eff) / len(steps)) if steps else None,
    }
    return {"gpu": g0.key, "catalog": over, "efficiency": eff, "report": report}


def apply_gpu_override(cat: Catalog, key: str, fields_: dict) -> Catalog:
    """The catalog with GPU `key`'s fields replaced (what loading catalog_toml's output with --catalog does)."""
    changes: dict[str, Any] = {k: tuple(map(tuple, v)) if k.startswith("gemm_curve") else v for k, v in fields_.items()}
    cat.gpus[key] = replace(cat.gpu(key), **changes)
    return cat


def catalog_toml(key: str, fields_: dict, source: str) -> str:
    """A catalog override file ([gpus.<key>] with only the measured fields) for --catalog / $SCALETRAIN_CATALOG."""
    lines = [
        f"# Measured on one {key} by benchmarks/gpu_mfu.py ({source}); overrides the shipped entry's fields.",
        f"[gpus.{key}]",
    ]
    for name, value in fields_.items():
        if isinstance(value, (tuple, list)):
            value = "[" + ", ".join(f"[{a:.6g}, {b:.6g}]" for a, b in value) + "]"
        else:
            value = f"{value:.6g}"
        lines.append(f"{name} = {value}")
    # Every ceiling written here was measured on this GPU: say so, or the catalog counts it as derived.
    measured = [c for c in CEILINGS if f"{c}_tflops" in fields_]
    if measured:
        lines.append("ceiling_basis = {" + ", ".join(f'{c} = "{MEASURED}"' for c in measured) + "}")
    return "\n".join(lines) + "\n"
