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

from scaletrain.sim import mlperf
from scaletrain.sim.catalog import Catalog, CatalogError, load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import GENERATION, Efficiency
from scaletrain.sim.predict import eval_time, expected_convergence
from scaletrain.sim.results import PublishedResult
from scaletrain.sim.step import step_time
from scaletrain.sim.workload import Layout, load_workload

WORKLOAD_OF = {"gpt3": "gpt3", "llama2_70b_lora": "llama2_70b_lora"}
SHARED = ("tp_exposed", "dp_overlap", "overlap_slowdown", "step_overhead_s", "eval_eff")
BOUNDS = {"gemm_eff": (0.4, 1.2), "tp_exposed": (0.0, 1.0), "dp_overlap": (0.2, 1.0),
          "overlap_slowdown": (0.0, 0.6), "step_overhead_s": (0.0, 0.5), "eval_eff": (0.3, 1.2)}
PRIOR_WEIGHT = 1e-3


def row_system(row: PublishedResult) -> tuple[str, str]:
    """(node, fabric) catalog keys for a published row, read from its system and interconnect text."""
    text = f"{row.submitter} {row.system}".lower()
    icon = row.interconnect.lower()
    azure = "azure" in text or re.search(r"\bnd[_ -]?(h100|h200|gb200)", text) is not None
    node = {"h100": "nd-h100-v5" if azure else "hgx-h100", "h200": "nd-h200-v5" if azure else "hgx-h200",
            "gb200": "nd-gb200-v6" if azure else "gb200-nvl72", "b200": "dgx-b200", "a100": "dgx-a100",
            "gb300": "gb300-nvl72"}[row.gpu]
    if "roce" in icon or "ethernet" in icon or "spectrum" in icon:
        fabric = "roce"
    elif "xdr" in icon or "800" in icon:
        fabric = "ib-xdr"
    elif "hdr" in icon or "200gb" in icon.replace(" ", ""):
        fabric = "ib-hdr"
    else:
        fabric = ""
    return node, fabric


def row_layout(row: PublishedResult) -> Layout:
    """The simulator layout of a published row.

    FP8 rows are NVIDIA's MLPerf recipes, which reduce gradients in bf16 (perf-model.md: "a distributed optimizer
    with bf16 gradient reduction").
    """
    return Layout(gpus=row.gpus, tp=row.tp, pp=row.pp, vp=row.vp, cp=row.cp, mbs=row.mbs, gbs=row.gbs,
                  sp=row.tp > 1, fp8=row.fp8, bf16_grads=row.fp8)


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
        self.w = load_workload(WORKLOAD_OF[row.benchmark])
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


def prepare(rows: list[PublishedResult], cat: Catalog | None = None) -> tuple[list[_Row], list[tuple[PublishedResult, str]]]:
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


def fit(rows: list[_Row], prior: Efficiency | None = None, sweeps: int = 4, refreshes: int = 3) -> dict[str, Efficiency]:
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
                def f_shared(x, name=name):
                    trial = {k: replace(e, **{name: x}) for k, e in effs.items()}
                    return _objective(rows, trial, prior)
                x = _golden(f_shared, *BOUNDS[name], getattr(next(iter(effs.values())), name))
                effs = {k: replace(e, **{name: x}) for k, e in effs.items()}
            for key in sorted(effs):
                subset = [r for r in rows if r.set == key]
                def f_set(x, key=key):
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
        out.append(RowScore(r.row, pred, r.row.score_minutes, pred / r.row.score_minutes - 1,
                            perf_pred, perf_pub, perf_err, st.step_time_s))
    return out


def summary(scores: list[RowScore], attr: str = "error") -> dict:
    """MAPE and max |error| (in %) over the rows that have `attr`."""
    errs = [abs(getattr(s, attr)) for s in scores if getattr(s, attr) is not None]
    if not errs:
        return {"rows": 0, "mape_pct": None, "max_err_pct": None}
    return {"rows": len(errs), "mape_pct": 100 * sum(errs) / len(errs), "max_err_pct": 100 * max(errs)}


def to_json(effs: dict[str, Efficiency], scores: list[RowScore]) -> str:
    """The efficiency.json text: the fitted sets plus the fit's own error summary."""
    doc = {"sets": {k: e.to_dict() for k, e in sorted(effs.items())},
           "fit": {"objective": "squared log error of run minutes with published convergence",
                   "rows": [f"{s.row.benchmark} {s.row.round} {s.row.system} {s.row.gpus}" for s in scores],
                   "perf": summary(scores, "perf_error"), "ttt": summary(scores, "error")}}
    return json.dumps(doc, indent=2) + "\n"
