"""Fit the free scalars (`Efficiency`) on published results, and score predictions against them.

One GEMM efficiency per (software release, GPU generation) and five scalars shared by all releases (TP exposure,
DP overlap, overlap slowdown, step overhead, evaluation efficiency) are fitted by coordinate descent on the
squared log error of each row's run times, with the row's own published tokens/samples to converge, so the
fit sees the performance model only. A weak pull toward the priors keeps scalars the data cannot see (e.g.
DP overlap when no row is DP-bound) at physical values.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from scaletrain.sim import mlperf
from scaletrain.sim.catalog import Catalog, CatalogError, load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import GENERATION, Efficiency
from scaletrain.sim.predict import eval_time, expected_convergence
from scaletrain.sim.results import PublishedResult
from scaletrain.sim.step import step_time
from scaletrain.sim.workload import ClusterLayout, load_workload

SHARED = ("tp_exposed", "dp_overlap", "overlap_slowdown", "step_overhead_s", "eval_eff")
BOUNDS = {
    "gemm_eff": (0.4, 1.2),
    "tp_exposed": (0.0, 1.0),
    "dp_overlap": (0.2, 1.0),
    "overlap_slowdown": (0.0, 0.6),
    "step_overhead_s": (0.0, 0.5),
    "eval_eff": (0.3, 1.2),
}
PRIOR_WEIGHT = 1e-3


def row_system(row: PublishedResult) -> tuple[str, str]:
    """(node, fabric) catalog keys for a published row, read from its system and interconnect text."""
    text = f"{row.submitter} {row.system}".lower()
    icon = row.interconnect.lower()
    azure = "azure" in text or re.search(r"\bnd[_ -]?(h100|h200|gb200)", text) is not None
    node = {
        "h100": "nd-h100-v5" if azure else "hgx-h100",
        "h200": "nd-h200-v5" if azure else "hgx-h200",
        "gb200": "nd-gb200-v6" if azure else "gb200-nvl72",
        "b200": "dgx-b200",
        "a100": "dgx-a100",
        "gb300": "gb300-nvl72",
    }[row.gpu]
    if "roce" in icon or "ethernet" in icon or "spectrum" in icon:
        fabric = "roce"
    elif "xdr" in icon or "800" in icon:
        fabric = "ib-xdr"
    elif "hdr" in icon or "200gb" in icon.replace(" ", ""):
        fabric = "ib-hdr"
    else:
        fabric = ""
    return node, fabric


def row_layout(row: PublishedResult) -> ClusterLayout:
    """The simulator layout of a published row.

    FP8 rows are NVIDIA's MLPerf recipes, which reduce gradients in bf16 (docs/perf-model.md: "a distributed optimizer
    with bf16 gradient reduction").
    """
    return ClusterLayout(
        gpus=row.gpus,
        tp=row.tp,
        pp=row.pp,
        vp=row.vp,
        cp=row.cp,
        mbs=row.mbs,
        gbs=row.gbs,
        sp=row.tp > 1,
        fp8=row.fp8,
        bf16_grads=row.fp8,
    )


def set_name(row: PublishedResult) -> str:
    """Which fitted set a row belongs to: "<release>/<generation>"."""
    return f"{row.round}/{GENERATION.get(row.gpu, 'hopper')}"


@dataclass
class RowScore:
    """Predicted vs published for one row."""

    row: PublishedResult
    predicted_min: float | None
    """Time-to-train from the RCP convergence (what `predict` says before any run)."""
    published_min: float
    """The published score."""
    error: float | None
    """predicted / published - 1."""
    perf_predicted_min: float | None = None
    """Olympic mean of per-run predictions with each run's published convergence."""
    perf_published_min: float | None = None
    """Olympic mean of the published run times (no RCP normalisation)."""
    perf_error: float | None = None
    step_time_s: float | None = None
    reason: str = ""
    """Why the row could not be predicted (then the errors are None)."""


class _Row:
    """A row with everything precomputed that does not depend on the efficiencies."""

    def __init__(self, row: PublishedResult, cat: Catalog):
        self.row = row
        self.bench = row.benchmark
        self.w = load_workload(mlperf.bench(row.benchmark).reference_preset)
        self.layout = row_layout(row)
        problems = self.layout.problems(self.w)
        if problems:
            raise ValueError("layout " + "; ".join(problems))
        node, fabric = row_system(row)
        g, n, f = cat.system(row.gpu, node, fabric or None)
        self.cluster = Cluster(g, n, f, row.gpus)
        self.set = set_name(row)
        self.runs = [mlperf.convergence(self.bench, row.gbs, c) for c in row.run_converge]
        self.rcp = expected_convergence(self.bench, row.gbs)
        self.ratio = 1.0

    def step(self, eff: Efficiency, event: bool):
        return step_time(self.w, self.layout, self.cluster, eff, event=event)

    def minutes(self, eff: Efficiency, conv, event: bool = False, st=None) -> float:
        st = st or self.step(eff, event)
        step_s = st.step_time_s * (1.0 if event else self.ratio)
        ev = eval_time(self.w, self.layout, st.forward_rank_s, conv.eval_tokens, eff)
        return (conv.steps * step_s + conv.evals * ev) / 60

    def run_minutes(self, eff: Efficiency, event: bool = False) -> list[float]:
        st = self.step(eff, event)
        return [self.minutes(eff, c, event, st) for c in self.runs]


def prepare(
    rows: list[PublishedResult], cat: Catalog | None = None
) -> tuple[list[_Row], list[tuple[PublishedResult, str]]]:
    """Rows ready to fit or score, and (row, reason) for rows the simulator cannot take."""
    cat = cat or load_catalog()
    ready, bad = [], []
    for row in rows:
        try:
            ready.append(_Row(row, cat))
        except (ValueError, CatalogError, KeyError) as exc:
            bad.append((row, str(exc)))
    return ready, bad


def _objective(rows: list[_Row], effs: dict[str, Efficiency], prior: Efficiency) -> float:
    err = 0.0
    for r in rows:
        if not r.runs:
            continue
        pred = mlperf.olympic_mean(r.run_minutes(effs[r.set]))
        err += math.log(pred / r.row.olympic_minutes) ** 2
    err /= max(1, len(rows))
    for e in effs.values():
        for name in ("gemm_eff", *SHARED):
            lo, hi = BOUNDS[name]
            err += PRIOR_WEIGHT * ((getattr(e, name) - getattr(prior, name)) / (hi - lo)) ** 2
    return err


def _golden(fn, lo: float, hi: float, x0: float, iters: int = 24) -> float:
    """Minimise a 1-D function on [lo, hi] by golden-section search, never returning worse than x0."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = fn(c), fn(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = fn(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = fn(d)
    best = c if fc < fd else d
    return best if fn(best) <= fn(x0) else x0


def fit(
    rows: list[_Row], prior: Efficiency | None = None, sweeps: int = 4, refreshes: int = 3
) -> dict[str, Efficiency]:
    """Fitted Efficiency per set name ("v4.1/hopper", ...) for the prepared rows."""
    prior = prior or Efficiency()
    effs = {r.set: prior for r in rows}
    for _ in range(refreshes):
        # The pipeline event simulation is exact but slow to call thousands of times: fit on the closed form
        # scaled by each row's event/closed-form ratio at the current point, then refresh the ratios.
        for r in rows:
            e = effs[r.set]
            r.ratio = r.step(e, True).step_time_s / r.step(e, False).step_time_s
        for _ in range(sweeps):
            for name in SHARED:

                def f_shared(x, name=name, effs=effs):
                    trial = {k: replace(e, **{name: x}) for k, e in effs.items()}
                    return _objective(rows, trial, prior)

                x = _golden(f_shared, *BOUNDS[name], getattr(next(iter(effs.values())), name))
                effs = {k: replace(e, **{name: x}) for k, e in effs.items()}
            for key in sorted(effs):
                subset = [r for r in rows if r.set == key]

                def f_set(x, key=key, effs=effs, subset=subset):
                    trial = dict(effs)
                    trial[key] = replace(effs[key], gemm_eff=x)
                    return _objective(subset, trial, prior)

                effs[key] = replace(effs[key], gemm_eff=_golden(f_set, *BOUNDS["gemm_eff"], effs[key].gemm_eff))
    return effs


def score_rows(rows: list[_Row], effs_for) -> list[RowScore]:
    """Predicted vs published per row; `effs_for(row)` gives the Efficiency to use (event simulation on)."""
    out = []
    for r in rows:
        eff = effs_for(r)
        st = r.step(eff, True)
        pred = r.minutes(eff, r.rcp, True, st)
        perf_pred = perf_pub = perf_err = None
        if r.runs:
            perf_pred = mlperf.olympic_mean([r.minutes(eff, c, True, st) for c in r.runs])
            perf_pub = r.row.olympic_minutes
            perf_err = perf_pred / perf_pub - 1
        out.append(
            RowScore(
                r.row,
                pred,
                r.row.score_minutes,
                pred / r.row.score_minutes - 1,
                perf_pred,
                perf_pub,
                perf_err,
                st.step_time_s,
            )
        )
    return out


def summary(scores: list[RowScore], attr: str = "error") -> dict:
    """MAPE and max |error| (in %) over the rows that have `attr`."""
    errs = [abs(getattr(s, attr)) for s in scores if getattr(s, attr) is not None]
    if not errs:
        return {"rows": 0, "mape_pct": None, "max_err_pct": None}
    return {"rows": len(errs), "mape_pct": 100 * sum(errs) / len(errs), "max_err_pct": 100 * max(errs)}


def to_json(effs: dict[str, Efficiency], scores: list[RowScore]) -> str:
    """The efficiency.json text: the fitted sets plus the fit's own error summary."""
    doc = {
        "sets": {k: e.to_dict() for k, e in sorted(effs.items())},
        "fit": {
            "objective": "squared log error of run minutes with published convergence",
            "rows": [f"{s.row.benchmark} {s.row.round} {s.row.system} {s.row.gpus}" for s in scores],
            "perf": summary(scores, "perf_error"),
            "ttt": summary(scores, "error"),
        },
    }
    return json.dumps(doc, indent=2) + "\n"


# ---------------------------------------------------------------- measured layer timings (benchmarks/gpu_mfu.py)


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
    eff0 = base or efficiency_for(None, g0.key)[1]
    over: dict = {}
    for dtype in ("bf16", "fp8"):
        curve = _gemm_curve(doc.get("gemm", []), dtype)
        if curve:
            over[f"gemm_curve_{dtype}"] = curve
            over[f"matmul_{dtype}_tflops"] = max(r for _, r in curve)
    ceil = doc.get("ceilings", {})
    for dtype in ("bf16", "fp8"):
        if ceil.get(f"gemm_{dtype}_tflops"):
            over[f"matmul_{dtype}_tflops"] = float(ceil[f"gemm_{dtype}_tflops"])
    if ceil.get("copy_gbps"):
        over["hbm_copy_tbps"] = float(ceil["copy_gbps"]) / 1000
    attn = [
        2 * 2 * a["mbs"] * a["seq_len"] ** 2 * a["heads"] * a["head_dim"] * 0.5 / a["fwd_s"]
        for a in doc.get("attention", [])
        if a.get("fwd_s")
    ]
    if attn:
        over["attn_tflops"] = sorted(attn)[len(attn) // 2] / 1e12
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
    return "\n".join(lines) + "\n"
