"""Fit the simulator's efficiency terms to scaletrain's own measured runs, and score it on runs it did not see.

Each run (`runs.MeasuredRun`) carries its measured step breakdown; the step model's terms are compared with the
measured parts they describe (`runs.predicted`), so each efficiency term is fitted on the part it governs:

- **per-step overhead** (`step_overhead_s`): the median over the runs of the measured data wait plus other host
  time per step (what the step model's constant host overhead stands for);
- **GEMM efficiency per shape class** (`gemm_eff`, `gemm_classes`): each class of GEMM sizes its own value, fitted
  on the busy forward/backward time (fwd_bwd_s - comm_exposed_s) of the class's runs, in squared log error;
- **exposed communication** (`comm_eff`: the fraction of the modelled collective bandwidth reached; `tp_exposed`:
  the share of tensor-parallel collectives not hidden; `dp_overlap`: the share of the data-parallel overlap window
  that hides gradient traffic): fitted on the measured comm_exposed_s of the runs, as the absolute error relative to
  each run's step, with a weak pull toward the priors (`PRIOR_PULL`).

Only runs whose ranks all do the same work (no pipeline stages) constrain the parts: rank 0 of a pipeline waits for
the later stages, so its breakdown is not the step's; a pipeline run (and a run from before the breakdown existed)
enters through its step time. A DDP run's gradient all-reduce is waited for where the trainer cannot time it, so it
enters through its forward/backward time (busy compute and communication together). A term is fitted only when the runs constrain it: moving it across its range must move
some run's prediction by at least SENSITIVITY of that run's step; otherwise it keeps its prior and the fit says why.
Coordinate descent (golden section per term) repeats, since the DP overlap moves the compute slowdown. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scaletrain.sim.catalog import Catalog
from scaletrain.sim.efficiency import Efficiency, efficiency_for
from scaletrain.sim.fit.calibrate import _golden
from scaletrain.sim.fit.runs import MeasuredRun, predicted, price
from scaletrain.sim.gemm_classes import apply, class_index, class_label
from scaletrain.sim.host_device import CPU_EFFICIENCY, CPU_KEY

SENSITIVITY = 0.02
"""A term is constrained when moving it across its bounds moves some run's predicted part by this fraction of the
run's measured step time."""
FITTED_COMM_TERMS = {
    "comm_eff": (0.02, 2.0, "collective"),
    "tp_exposed": (0.0, 1.0, "tensor-parallel"),
    "dp_overlap": (0.0, 1.0, "data-parallel (FSDP)"),
}
"""Communication terms: (lower bound, upper bound, the traffic they govern). The collectives' bandwidth efficiency
scales every collective; the two fractions say how much of the TP and DP traffic is exposed."""
PRIOR_PULL = 1e-3
"""Weight of a weak pull of each communication term toward its prior (per squared unit): where two terms trade off
(a slower fabric or less overlap), the data settle their product and the pull keeps each near its physical prior."""
GEMM_BOUNDS = (0.02, 3.0)
"""gemm_eff range: above 1 where a device beats its start-up GEMM measurement inside the step (warmer caches)."""
SWEEPS = 4
IDENTIFIABLE = 0.25
"""A communication term is fitted only when the part of its effect on the runs that no earlier term's explains is at
least this fraction of its whole effect (one TP run cannot tell the TP exposure from the collectives' bandwidth)."""


@dataclass
class GroupFit:
    """The fit of one efficiency group (a GPU generation, or "cpu")."""

    eff: Efficiency
    """The fitted set; its gemm_eff is the single value that fits all the runs (for callers without classes)."""
    classes: list[dict] = field(default_factory=list)
    """[{"label", "gflop", "gemm_eff", "runs"}]: the GEMM efficiency of each shape class the runs fall in."""
    terms: dict = field(default_factory=dict)
    """{term: {"value", "fitted": bool, "how"}}: what was fitted on what, and why a term was not."""

    def eff_for(self, run: MeasuredRun) -> tuple[Efficiency, bool]:
        """(Efficiency for `run`: its shape class's gemm_eff, extrapolated beyond the fitted classes?)."""
        return apply(self.eff, self.classes, run.gemm_gflop)


def _part_error(run: MeasuredRun, eff: Efficiency, part: str) -> float:
    """Squared error of one run's part: log ratio for step and compute, absolute / step for communication."""
    pred, meas = predicted(price(run, eff)), run.measured()
    if part == "comm":
        return ((pred["comm"] - meas["comm"]) / run.step_time_s) ** 2
    return math.log(max(pred[part], 1e-12) / max(meas[part], 1e-12)) ** 2


def _compute_part(run: MeasuredRun) -> str:
    """The part a run's GEMM efficiency is fitted on: busy compute where its breakdown is the step's (forward and
    backward where its communication is not all measured), else the step."""
    if not (run.parts and run.symmetric):
        return "step"
    return "compute" if run.comm_observable else "busy"


def _comm_runs(runs: list[MeasuredRun]) -> list[MeasuredRun]:
    return [r for r in runs if r.parts and r.symmetric and r.comm_observable and r.world_size > 1]


def _sensitive(runs: list[MeasuredRun], eff: Efficiency, name: str, lo: float, hi: float, part: str) -> bool:
    for r in runs:
        a = predicted(price(r, replace(eff, **{name: lo})))[part]
        b = predicted(price(r, replace(eff, **{name: hi})))[part]
        if abs(a - b) >= SENSITIVITY * r.step_time_s:
            return True
    return False


def fit_group(runs: list[MeasuredRun], base: Efficiency) -> GroupFit:
    """Fit the terms the runs constrain, starting from `base` (see the module doc)."""
    eff, terms = base, {}
    with_parts = [r for r in runs if r.parts]
    if with_parts:
        overhead = sorted(r.measured()["other"] for r in with_parts)[len(with_parts) // 2]
        eff = replace(eff, step_overhead_s=overhead)
        terms["step_overhead_s"] = {
            "value": overhead,
            "fitted": True,
            "how": f"median data wait + other host time of {len(with_parts)} run(s)",
        }
    by_class: dict[int, list[MeasuredRun]] = {}
    for r in runs:
        by_class.setdefault(class_index(r.gemm_gflop), []).append(r)
    values = dict.fromkeys(by_class, eff.gemm_eff)
    comm_runs = _comm_runs(runs)
    comm_terms = []
    for name, (lo, hi, kind) in FITTED_COMM_TERMS.items():
        if comm_runs and _sensitive(comm_runs, eff, name, lo, hi, "comm"):
            comm_terms.append(name)
        else:
            terms[name] = {
                "value": getattr(eff, name),
                "fitted": False,
                "how": f"kept the prior: no run's exposed communication depends on it (needs a run with "
                f"{kind} traffic whose waits are all measured: not DDP, not pipelined)",
            }
    eff, values = _descend(runs, comm_runs, by_class, base, eff, values, comm_terms)
    kept = _identifiable(comm_runs, eff, comm_terms)
    if kept != comm_terms:
        for name in comm_terms:
            if name not in kept:
                earlier = [k for k in kept if comm_terms.index(k) < comm_terms.index(name)]
                why = f"these runs cannot tell it from {', '.join(earlier)}" if earlier else "no effect at the fit"
                terms[name] = {"value": getattr(base, name), "fitted": False, "how": f"kept the prior: {why}"}
                eff = replace(eff, **{name: getattr(base, name)})
        eff, values = _descend(runs, comm_runs, by_class, base, eff, values, kept)
    for name in kept:
        terms[name] = {
            "value": getattr(eff, name),
            "fitted": True,
            "how": f"exposed communication of {len(comm_runs)} run(s)",
        }
    if not with_parts:
        eff = _fit_overhead_on_steps(runs, eff, values, terms)

    def pooled(v):
        e = replace(eff, gemm_eff=v)
        return sum(_part_error(r, e, _compute_part(r)) for r in runs)

    eff = replace(eff, gemm_eff=_golden(pooled, *GEMM_BOUNDS, eff.gemm_eff, iters=40))
    classes = [
        {
            "label": class_label(idx),
            "gflop": math.exp(sum(math.log(r.gemm_gflop) for r in members) / len(members)),
            "gemm_eff": values[idx],
            "runs": [r.name for r in members],
        }
        for idx, members in sorted(by_class.items())
    ]
    terms["gemm_eff"] = {
        "value": eff.gemm_eff,
        "fitted": True,
        "how": f"one value for all {len(runs)} run(s), for callers without the {len(classes)} shape class(es) above",
    }
    return GroupFit(eff, classes, terms)


def _descend(runs, comm_runs, by_class, base, eff, values, comm_terms):
    """Coordinate descent: each shape class's gemm_eff on its runs' compute, then each communication term on the
    communicating runs' exposed communication; SWEEPS times (the DP overlap moves the compute slowdown)."""
    values = dict(values)
    for _ in range(SWEEPS):
        for idx, members in by_class.items():

            def err(v, members=members, eff=eff):
                e = replace(eff, gemm_eff=v)
                return sum(_part_error(r, e, _compute_part(r)) for r in members)

            values[idx] = _golden(err, *GEMM_BOUNDS, values[idx], iters=40)
        for name in comm_terms:

            def cerr(v, name=name, eff=eff):
                total = PRIOR_PULL * (v - getattr(base, name)) ** 2
                for r in comm_runs:
                    e = replace(eff, **{name: v}, gemm_eff=values[class_index(r.gemm_gflop)])
                    total += _part_error(r, e, "comm")
                return total

            lo, hi, _ = FITTED_COMM_TERMS[name]
            eff = replace(eff, **{name: _golden(cerr, lo, hi, getattr(eff, name), iters=40)})
    return eff, values


def _identifiable(comm_runs: list[MeasuredRun], eff: Efficiency, names: list[str]) -> list[str]:
    """The terms of `names` (in FITTED_COMM_TERMS order) whose effect on the runs' exposed communication is not, to within
    IDENTIFIABLE, a combination of the earlier ones' (Gram-Schmidt on the columns of the runs' Jacobian at `eff`)."""
    basis: list[list[float]] = []
    kept = []
    for name in names:
        lo, hi, _ = FITTED_COMM_TERMS[name]
        v, h = getattr(eff, name), 0.05 * (hi - lo)
        a, b = max(lo, v - h), min(hi, v + h)
        col = [
            (
                predicted(price(r, replace(eff, **{name: b})))["comm"]
                - predicted(price(r, replace(eff, **{name: a})))["comm"]
            )
            / r.step_time_s
            for r in comm_runs
        ]
        norm = math.sqrt(sum(x * x for x in col))
        rest = list(col)
        for q in basis:
            dot = sum(x * y for x, y in zip(rest, q))
            rest = [x - dot * y for x, y in zip(rest, q)]
        left = math.sqrt(sum(x * x for x in rest))
        if norm > 0 and left >= IDENTIFIABLE * norm:
            basis.append([x / left for x in rest])
            kept.append(name)
    return kept


def _fit_overhead_on_steps(runs: list[MeasuredRun], eff: Efficiency, values: dict, terms: dict) -> Efficiency:
    """Runs without a breakdown: the per-step overhead from their step times, where gemm_eff alone cannot match them
    (the prior fitted at MLPerf scale can exceed a small run's whole step)."""

    def err(v):
        e = replace(eff, step_overhead_s=v)
        return sum(_part_error(r, replace(e, gemm_eff=values[class_index(r.gemm_gflop)]), "step") for r in runs)

    if math.sqrt(err(eff.step_overhead_s) / len(runs)) < 0.01:
        terms["step_overhead_s"] = {
            "value": eff.step_overhead_s,
            "fitted": False,
            "how": "kept: gemm_eff alone matches the step times (no breakdown recorded)",
        }
        return eff
    v = _golden(err, 0.0, eff.step_overhead_s, eff.step_overhead_s, iters=40)
    eff = replace(eff, step_overhead_s=v)
    for idx in values:
        members = [r for r in runs if class_index(r.gemm_gflop) == idx]

        def gerr(g, members=members):
            return sum(_part_error(r, replace(eff, gemm_eff=g), "step") for r in members)

        values[idx] = _golden(gerr, *GEMM_BOUNDS, values[idx], iters=40)
    terms["step_overhead_s"] = {"value": v, "fitted": True, "how": f"step times of {len(runs)} run(s) (no breakdown)"}
    return eff


def score(fit: GroupFit, runs: list[MeasuredRun]) -> list[dict]:
    """Per run: measured vs predicted parts with the fitted terms, the step's error and the run's own prior forecast."""
    rows = []
    for r in runs:
        eff, extrapolated = fit.eff_for(r)
        pred, meas = predicted(price(r, eff)), r.measured()
        rows.append(
            {
                "run": r.path,
                "name": r.name,
                "layout": r.layout.describe(),
                "world_size": r.world_size,
                "gemm_gflop": r.gemm_gflop,
                "extrapolated": extrapolated,
                "measured": meas,
                "predicted": {k: pred[k] for k in meas},
                "prior_step_s": r.prior_step_s,
                "error_pct": 100.0 * (pred["step"] / r.step_time_s - 1.0),
            }
        )
    return rows


def error_summary(rows: list[dict]) -> dict:
    """{"mean_abs_pct", "max_abs_pct", "runs"} of the step errors of `score` rows, and "prior_mean_abs_pct",
    "prior_max_abs_pct" of the runs' own prediction.json forecasts where every row has one (else null)."""
    errs = [abs(r["error_pct"]) for r in rows]
    priors = [abs(100.0 * (r["prior_step_s"] / r["measured"]["step"] - 1.0)) for r in rows if r["prior_step_s"]]
    whole = bool(rows) and len(priors) == len(rows)
    return {
        "mean_abs_pct": sum(errs) / len(errs) if errs else None,
        "max_abs_pct": max(errs, default=None),
        "runs": len(errs),
        "prior_mean_abs_pct": sum(priors) / len(priors) if whole else None,
        "prior_max_abs_pct": max(priors) if whole else None,
    }


def calibrate_runs(
    runs: list[MeasuredRun], held_out: list[MeasuredRun], release: str | None, catalog: Catalog | None = None
) -> dict:
    """Fit every efficiency group the runs fall in ("measured/<generation>" or "measured/cpu"), starting from the
    `release`'s set for the group (the priors for a CPU), and score the fit on its runs and on `held_out` runs it
    never saw. The document `sim calibrate --out` writes: {"sets", "gemm_classes", "terms", "runs", "held_out",
    "held_out_error"}; ValueError for a held-out run of a group no run was fitted in. `catalog`: the one the runs'
    GPUs were read from (default: the shipped one)."""
    groups: dict[str, list[MeasuredRun]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    doc: dict = {"sets": {}, "gemm_classes": {}, "terms": {}, "runs": [], "held_out": []}
    fits = {}
    for group, members in groups.items():
        base = CPU_EFFICIENCY if group == CPU_KEY else efficiency_for(release, members[0].gpu, catalog=catalog)[1]
        fits[group] = fit = fit_group(members, base)
        name = f"measured/{group}"
        doc["sets"][name] = fit.eff.to_dict()
        doc["gemm_classes"][name] = fit.classes
        doc["terms"][name] = fit.terms
        doc["runs"] += score(fit, members)
    for r in held_out:
        if r.group not in fits:
            raise ValueError(f"held-out run {r.path} ran on {r.gpu}, on which no run was fitted")
        doc["held_out"] += score(fits[r.group], [r])
    doc["fit_error"] = error_summary(doc["runs"])
    doc["held_out_error"] = error_summary(doc["held_out"])
    return doc


def report_lines(doc: dict) -> list[str]:
    """`calibrate_runs`'s document as `sim calibrate` prints it: each set's terms, then the fit and held-out runs."""
    lines = []
    for name, terms in doc["terms"].items():
        fitted = sorted({run for c in doc["gemm_classes"][name] for run in c["runs"]})
        lines.append(f"{name}: fitted on {len(fitted)} run(s)")
        for c in doc["gemm_classes"][name]:
            lines.append(f"  gemm_eff {c['gemm_eff']:.3f} for GEMMs of {c['label']} ({', '.join(c['runs'])})")
        for term, t in terms.items():
            lines.append(f"  {term} {t['value']:.4g} ({'fitted' if t['fitted'] else 'not fitted'}: {t['how']})")
    for title, rows, summary in (
        ("fit", doc["runs"], doc["fit_error"]),
        ("held out", doc["held_out"], doc["held_out_error"]),
    ):
        if not rows:
            continue
        lines.append(
            f"{title}: {'run':<12} {'layout':<22} {'measured s':>10} {'prior s':>8} {'predicted s':>11} {'error':>7}"
        )
        for r in rows:
            prior = f"{r['prior_step_s']:.4f}" if r["prior_step_s"] else "-"
            extra = " (shape class extrapolated)" if r["extrapolated"] else ""
            lines.append(
                f"{'':<{len(title) + 2}}{r['name']:<12} {_short_layout(r['layout']):<22} "
                f"{r['measured']['step']:>10.4f} {prior:>8} {r['predicted']['step']:>11.4f} "
                f"{r['error_pct']:>+6.1f}%{extra}"
            )
        own = ""
        if summary["prior_mean_abs_pct"] is not None:
            own = (
                f" (their own prediction.json: {summary['prior_mean_abs_pct']:.1f}%, max "
                f"{summary['prior_max_abs_pct']:.1f}%)"
            )
        lines.append(
            f"{title}: mean |error| {summary['mean_abs_pct']:.1f}%, max {summary['max_abs_pct']:.1f}% over "
            f"{summary['runs']} run(s){own}"
        )
    return lines


def _short_layout(desc: str) -> str:
    """ "TP2 PP1 VP1 CP1 DP2 mbs8 GBS16" -> "TP2 DP2 mbs8 GBS16": the degrees that are not 1."""
    return " ".join(t for t in desc.split() if not (t[:2] in ("TP", "PP", "VP", "CP", "DP", "EP") and t[2:] == "1"))
