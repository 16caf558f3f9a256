"""Fit the free scalars (`Efficiency`) on published results, term by term, and score predictions against them.

Every calibration row carries what its public logs measured (`terms`: steady step, evaluation and one-off seconds),
and each term of the model is fitted on its own measurement:

- **the step**: one GEMM efficiency per (software release, GPU generation), a GEMM-efficiency multiplier per
  non-reference GPU SKU (each generation's `reference_gpu` in `sim/hardware/generations.toml`), TP exposure per
  benchmark (`efficiency.PER_BENCHMARK`) and five scalars shared by all (DP overlap, overlap slowdown, FP4 efficiency,
  the constant host overhead and the cost of leaving one NVLink domain), by
  coordinate descent on the squared log error of the steady step seconds;
- **the evaluation**: forward passes at the training forward's efficiency (`eval_eff` = 1), plus a fixed part per
  benchmark and software release: the median of the measured evaluation seconds minus the forward part;
- **the one-offs**: seconds per benchmark and software release, the median of the measured one-off seconds; the
  first evaluation's extra, the median of first minus steady evaluation (`fit_run_terms`).

No gemm_eff prices a GPU above 90% of its datasheet dense peak (`rate_bounds`). A weak pull toward the priors keeps
scalars the data cannot see (e.g. DP overlap when no row is DP-bound) at physical values. A results row without
measured terms (a user's file) fits the step scalars on its run minutes instead. Rows become simulator inputs in
`rows`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from scaletrain.sim import mlperf
from scaletrain.sim.efficiency import (
    OWN_FIT,
    PER_BENCHMARK,
    Efficiency,
    cap_gemm_eff,
    nearest_set,
    pauses,
    specialise,
    with_run_terms,
)
from scaletrain.sim.fit.results import PublishedResult
from scaletrain.sim.fit.rows import _Row, host_network, prepare, row_layout, row_system
from scaletrain.sim.fit.terms import MeasuredTerms

__all__ = [
    "BOUNDS",
    "SHARED",
    "FittedSets",
    "RowScore",
    "fit",
    "fit_own",
    "fit_shared",
    "row_eff",
    "host_network",
    "prepare",
    "row_layout",
    "row_system",
]

SHARED = (
    "dp_overlap",
    "overlap_slowdown",
    "step_overhead_s",
    "fabric_sync_s",
    "fp4_eff",
)
NOT_FITTED = {"eval_eff": 1.0, "warmup_steps": 0.0, "comm_init_s": 0.0, "straggler_cv": 0.0, "sync_log2_s": 0.0}
"""Scalars the published sets hold fixed: an evaluation runs at the training forward's efficiency, and the logs'
first training segments run at the steady rate (NeMo 25.x: -0.2 s median one-off in the first segment), so start-up
is priced by the measured one-off seconds (`fit_run_terms`), not by extra step-times or communicator counts; and data
parallelism scales out almost free in them (`Efficiency.straggler_cv`, `sync_log2_s`): crossing the NVLink domain is
`fabric_sync_s`, once."""
BOUNDS = {
    "gemm_eff": (0.3, 1.2),
    "tp_exposed": (0.0, 1.0),
    "dp_overlap": (0.2, 1.0),
    "overlap_slowdown": (0.0, 0.6),
    "step_overhead_s": (0.0, 0.1),
    "eval_eff": (0.3, 1.2),
    "sync_log2_s": (0.0, 0.1),
    "fabric_sync_s": (0.0, 0.1),
    "straggler_cv": (0.0, 0.05),
    "warmup_steps": (0.0, 30.0),
    "comm_init_s": (0.0, 3.0),
    "eval_fixed_s": (0.0, 5.0),
    "fp4_eff": (0.4, 1.0),
    "eval_host_layer_s": (0.0, 0.01),
}
SKU_BOUNDS = (0.6, 1.6)
"""Bounds of a GPU SKU's gemm_eff multiplier on its generation's set (prior 1)."""
SHARED_FIT = ("gpt3", "llama2_70b_lora")
"""Benchmarks whose rows fit the shared scalars, the sets' GEMM efficiencies and the SKU multipliers (`fit`); the
rows of the others fit only their own OWN_FIT scalars on top."""
OWN_BOUNDS = {**{n: BOUNDS[n] for n in OWN_FIT if n in BOUNDS}, "gemm_mult": SKU_BOUNDS}
"""Bounds of the OWN_FIT scalars: those of the same Efficiency fields, gemm_mult those of a SKU multiplier."""
ROWS_PER_OWN_SCALAR = 4
"""Rows a benchmark outside SHARED_FIT needs per OWN_FIT scalar it fits (`fit_own`)."""
PRETRAINING = "gpt3"
"""The benchmark whose PER_BENCHMARK scalars the sets carry (for models that are no MLPerf benchmark)."""
PRIOR_WEIGHT = 1e-3


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


class FittedSets(dict):
    """Fitted Efficiency per set name ("v4.1/hopper", ...), plus the per-SKU gemm_eff multipliers (`sku_gemm`) and
    the per-benchmark scalars (`bench`) that `efficiency.specialise` applies to a row's set."""

    def __init__(self, sets=(), sku_gemm: dict | None = None, bench: dict | None = None, run_terms: dict | None = None):
        super().__init__(sets)
        self.sku_gemm: dict[str, float] = dict(sku_gemm or {})
        self.bench: dict[str, dict[str, float]] = {k: dict(v) for k, v in (bench or {}).items()}
        self.run_terms: dict = json.loads(json.dumps(run_terms or {}))
        """Per benchmark: {"software": {label: RUN_TERMS values}, "default": {"<round>[/<generation>]": label}}."""

    def copy(self) -> FittedSets:
        """A copy whose dicts can be changed without touching this one."""
        return FittedSets(self, self.sku_gemm, self.bench, self.run_terms)


def row_eff(effs: dict, r: _Row, base: Efficiency | None = None) -> Efficiency:
    """The Efficiency row `r` is priced with: its set (or `base`) specialised to its GPU and benchmark, with the
    evaluation and one-off seconds of the software its logs ran (else its round's), gemm_eff capped at the GPU's
    bound."""
    eff = effs[r.set] if base is None else base
    eff = specialise(eff, r.row.gpu, r.bench, getattr(effs, "sku_gemm", {}), getattr(effs, "bench", {}))
    run_terms = getattr(effs, "run_terms", {})
    if run_terms:
        label = r.terms.software if r.terms else None
        eff = with_run_terms(eff, run_terms, r.bench, r.row.round, r.cluster.gpu.generation, label)[1]
    return cap_gemm_eff(eff, r.cluster.gpu)


def _objective(rows: list[_Row], effs: FittedSets, prior: Efficiency) -> float:
    """Squared log error of the rows' steady step seconds (`_Row.step_log_error`), averaged per benchmark and the
    benchmarks weighted equally (95 LoRA rows must not drown 10 gpt3 rows that alone see pipelines and thousands of
    GPUs), plus a weak
    pull of every scalar toward its prior (each shared scalar once, each benchmark's scalars once, each set's
    gemm_eff once, each SKU multiplier toward 1), in units of its bound range."""
    sums: dict[str, list[float]] = {}
    cache: dict[tuple, Efficiency] = {}
    for r in rows:
        if r.runs or r.terms:
            k = (r.set, r.row.gpu, r.bench)
            e = cache.get(k)
            if e is None:
                e = cache[k] = row_eff(effs, r)
            acc = sums.setdefault(r.bench, [0.0, 0])
            acc[0] += r.step_sq_error(e)
            acc[1] += 1
    err = sum(total / n for total, n in sums.values()) / max(1, len(sums))
    if not effs:
        return err
    any_eff = next(iter(effs.values()))
    for name in SHARED:
        lo, hi = BOUNDS[name]
        err += PRIOR_WEIGHT * ((getattr(any_eff, name) - getattr(prior, name)) / (hi - lo)) ** 2
    for values in effs.bench.values():
        for name, x in values.items():
            lo, hi = BOUNDS[name]
            err += PRIOR_WEIGHT * ((x - getattr(prior, name)) / (hi - lo)) ** 2
    lo, hi = BOUNDS["gemm_eff"]
    for e in effs.values():
        err += PRIOR_WEIGHT * ((e.gemm_eff - prior.gemm_eff) / (hi - lo)) ** 2
    for m in effs.sku_gemm.values():
        err += PRIOR_WEIGHT * ((m - 1.0) / (SKU_BOUNDS[1] - SKU_BOUNDS[0])) ** 2
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


_SHARED_MEMO: dict[tuple, FittedSets] = {}


def fit(
    rows: list[_Row], prior: Efficiency | None = None, sweeps: int = 3, refreshes: int = 2, iters: int = 16
) -> FittedSets:
    """Fitted sets with their SKU multipliers and per-benchmark scalars for the prepared rows, in two stages: the
    SHARED_FIT rows fit everything (`fit_shared`), then each other benchmark's rows only its own OWN_FIT scalars on
    top (`fit_own`), so its few rows (4 for llama31_405b) cannot move what the others pinned. Without SHARED_FIT
    rows, the rows given fit everything."""
    base = [r for r in rows if r.bench in SHARED_FIT]
    if not base:
        return fit_run_terms(rows, fit_shared(rows, prior, sweeps, refreshes, iters))
    # Leave-one-out of a row of another benchmark refits the same SHARED_FIT rows each time: reuse that stage.
    ids = tuple((r.row.file, r.row.benchmark, r.row.line, r.row.system) for r in base)
    key = (ids, prior, sweeps, refreshes, iters)
    if key not in _SHARED_MEMO:
        if len(_SHARED_MEMO) > 4:
            _SHARED_MEMO.clear()
        _SHARED_MEMO[key] = fit_shared(base, prior, sweeps, refreshes, iters)
    effs = _SHARED_MEMO[key].copy()
    for bench in sorted({r.bench for r in rows if r.bench not in SHARED_FIT}):
        effs = fit_own([r for r in rows if r.bench == bench], effs, sweeps, refreshes, iters)
    return fit_run_terms(rows, effs)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def fit_run_terms(rows: list[_Row], effs: FittedSets) -> FittedSets:
    """`effs` plus the evaluation and one-off seconds of every benchmark's software releases, each fitted on its own
    measurement in the rows' public logs (rows without measured terms add nothing):

    - eval_host_layer_s and eval_fixed_s: an evaluation is its micro-batch forwards, each priced at the training
      forward's efficiency with the step scalars already fitted or at layers x eval_host_layer_s, whichever is longer,
      plus eval_fixed_s; the host time per layer minimises the squared log error of the release's evaluation times,
      the fixed part being the median residual (at least 0);
    - eval_first_extra_s: the median of (first − steady evaluation), at least 0;
    - one_off_s: the median of the measured one-off seconds of the runs that pass no recipe pause and no precision
      switch (negative medians, step-time drift, count as 0); pause_s and switch_s: the median one-off of the runs that
      do, less that.

    Medians, not means: a run's one-off can hold a 20-40 s stall that a few rows of a release see and the others do
    not. The release a prediction uses by default is the one most of a round's rows ran, per generation and overall
    ("default")."""
    effs = effs.copy()
    no_terms = FittedSets(effs, effs.sku_gemm, effs.bench)
    groups: dict[tuple[str, str], list[tuple[_Row, MeasuredTerms]]] = {}
    for r in rows:
        if r.terms is not None and r.terms.software:
            groups.setdefault((r.bench, r.terms.software), []).append((r, r.terms))
    run_terms: dict = {}
    for (bench, label), pairs in sorted(groups.items()):
        # The step scalars already fitted, without run terms (those are what this fits).
        base = [row_eff(no_terms, r, nearest_set(effs, r.set)[1]) for r, _ in pairs]

        def eval_fit(host: float, pairs=pairs, base=base) -> tuple[float, float]:
            """(squared log error, fixed seconds) of the group's evaluations at `host` s per layer, the fixed part
            the median residual."""
            fwd = [
                r.eval_forward_s(replace(e, eval_host_layer_s=host, eval_fixed_s=0.0)) for (r, _), e in zip(pairs, base)
            ]
            fixed = max(0.0, _median([t.eval_s - f for (_, t), f in zip(pairs, fwd)]))
            return sum(math.log((f + fixed) / t.eval_s) ** 2 for (_, t), f in zip(pairs, fwd)), fixed

        def eval_error(host: float, eval_fit=eval_fit) -> float:
            return eval_fit(host)[0]

        host = _golden(eval_error, *BOUNDS["eval_host_layer_s"], 0.0, 24)
        if eval_error(host) >= eval_error(0.0) * (1 - 1e-9):
            host = 0.0  # rows whose forwards are all GPU-bound cannot see a host floor: none is priced
        switched = [t for _, t in pairs if t.switch_step]
        paused = [(r, t) for r, t in pairs if pauses(bench, r.median_steps) > 0 and not t.switch_step]
        plain = [t for r, t in pairs if pauses(bench, r.median_steps) == 0 and not t.switch_step] or [
            t for _, t in pairs
        ]
        one_off = max(0.0, _median([t.one_off_s for t in plain]))
        pause = 0.0
        if paused and len(plain) < len(pairs):
            pause = max(0.0, _median([t.one_off_s / pauses(bench, r.median_steps) for r, t in paused]) - one_off)
        values = {
            "eval_fixed_s": eval_fit(host)[1],
            "eval_host_layer_s": host,
            "eval_first_extra_s": max(0.0, _median([t.first_eval_s - t.eval_s for _, t in pairs])),
            "one_off_s": one_off,
            "pause_s": pause,
            "switch_s": max(0.0, _median([t.one_off_s for t in switched]) - one_off) if switched else 0.0,
            "rows": len(pairs),
        }
        run_terms.setdefault(bench, {"software": {}, "default": {}})["software"][label] = values
    for bench, terms in run_terms.items():
        counts: dict[str, dict[str, int]] = {}
        for (b, label), pairs in groups.items():
            if b != bench:
                continue
            for r, _ in pairs:
                for key in (r.row.round, f"{r.row.round}/{r.cluster.gpu.generation}"):
                    counts.setdefault(key, {}).setdefault(label, 0)
                    counts[key][label] += 1
        terms["default"] = {key: max(sorted(c), key=c.__getitem__) for key, c in sorted(counts.items())}
    effs.run_terms = run_terms
    return effs


def fit_own(rows: list[_Row], effs: FittedSets, sweeps: int = 3, refreshes: int = 2, iters: int = 16) -> FittedSets:
    """`effs` plus one benchmark's OWN_FIT scalars fitted on its `rows`, everything else held: golden-section
    coordinate descent within OWN_BOUNDS on the squared log error of the rows' run minutes, with `_objective`'s weak
    pull toward the priors (gemm_mult 1, the others the pretraining benchmark's values: Megatron pretraining like
    it). A row whose set `effs` lacks gets the nearest one (`nearest_set`).

    Only the first len(rows) // ROWS_PER_OWN_SCALAR of OWN_FIT (at least gemm_mult) are fitted, on the rows' steady
    step seconds.
    """
    effs = effs.copy()
    bench = rows[0].bench
    names = OWN_FIT[: max(1, len(rows) // ROWS_PER_OWN_SCALAR)]
    pre, first = effs.bench.get(PRETRAINING, {}), next(iter(effs.values()))
    priors = {n: 1.0 if n == "gemm_mult" else float(pre.get(n, getattr(first, n))) for n in names}
    for r in rows:
        if r.set not in effs:
            effs[r.set] = nearest_set(effs, r.set)[1]
    values = dict(priors)

    def eff(r: _Row, vals: dict[str, float]) -> Efficiency:
        return cap_gemm_eff(specialise(effs[r.set], r.row.gpu, bench, effs.sku_gemm, {bench: vals}), r.cluster.gpu)

    def objective(vals: dict[str, float]) -> float:
        pull = sum(((x - priors[n]) / (OWN_BOUNDS[n][1] - OWN_BOUNDS[n][0])) ** 2 for n, x in vals.items())
        return sum(r.step_sq_error(eff(r, vals)) for r in rows) / len(rows) + PRIOR_WEIGHT * pull

    for _ in range(refreshes):
        for r in rows:
            r.refresh_ratio(eff(r, values))
        for _ in range(sweeps):
            for n in names:
                values[n] = _golden(lambda x, n=n: objective({**values, n: x}), *OWN_BOUNDS[n], values[n], iters)
    effs.bench[bench] = values
    return effs


def fit_shared(
    rows: list[_Row], prior: Efficiency | None = None, sweeps: int = 3, refreshes: int = 2, iters: int = 16
) -> FittedSets:
    """Fitted sets ("v4.1/hopper", ...) with their SKU multipliers and per-benchmark scalars for the prepared rows.

    Coordinate descent from the priors: each shared scalar over all rows, each benchmark's PER_BENCHMARK scalars
    over its rows, each set's gemm_eff over its rows, each non-reference GPU SKU's gemm_eff multiplier over its
    rows, by golden-section search on the scalar's bounds (`iters` steps: 0.618^16 = 5e-4 of the range); `sweeps`
    rounds per refresh of the event-simulation ratios. More sweeps or steps do not lower the objective measurably
    (the valley is flat along several scalars), so leave-one-out, which refits once per row, runs this same fit.
    """
    prior = replace(prior or Efficiency(), **NOT_FITTED)
    effs = FittedSets(
        {r.set: prior for r in rows},
        {r.row.gpu: 1.0 for r in rows if not r.reference_sku},
        {r.bench: {n: getattr(prior, n) for n in PER_BENCHMARK} for r in rows},
    )
    for _ in range(refreshes):
        # The pipeline event simulation is exact but slow to call thousands of times: fit on the closed form
        # scaled by each row's event/closed-form ratio at the current point, then refresh the ratios.
        for r in rows:
            r.refresh_ratio(row_eff(effs, r))
        for _ in range(sweeps):
            for name in SHARED:

                def f_shared(x, name=name, effs=effs):
                    trial = FittedSets({k: replace(e, **{name: x}) for k, e in effs.items()}, effs.sku_gemm, effs.bench)
                    return _objective(rows, trial, prior)

                x = _golden(f_shared, *BOUNDS[name], getattr(next(iter(effs.values())), name), iters)
                effs = FittedSets({k: replace(e, **{name: x}) for k, e in effs.items()}, effs.sku_gemm, effs.bench)
            for bench in sorted(effs.bench):
                subset = [r for r in rows if r.bench == bench]
                for name in PER_BENCHMARK:

                    def f_bench(x, bench=bench, name=name, effs=effs, subset=subset):
                        trial = effs.copy()
                        trial.bench[bench][name] = x
                        return _objective(subset, trial, prior)

                    effs.bench[bench][name] = _golden(f_bench, *BOUNDS[name], effs.bench[bench][name], iters)
            for key in sorted(effs):
                subset = [r for r in rows if r.set == key]

                def f_set(x, key=key, effs=effs, subset=subset):
                    trial = effs.copy()
                    trial[key] = replace(effs[key], gemm_eff=x)
                    return _objective(subset, trial, prior)

                effs[key] = replace(effs[key], gemm_eff=_golden(f_set, *BOUNDS["gemm_eff"], effs[key].gemm_eff, iters))
            for gpu in sorted(effs.sku_gemm):
                subset = [r for r in rows if r.row.gpu == gpu]

                def f_sku(x, gpu=gpu, effs=effs, subset=subset):
                    trial = effs.copy()
                    trial.sku_gemm[gpu] = x
                    return _objective(subset, trial, prior)

                effs.sku_gemm[gpu] = _golden(f_sku, *SKU_BOUNDS, effs.sku_gemm[gpu], iters)
    if PRETRAINING in effs.bench:
        pre = effs.bench[PRETRAINING]
        for key in effs:
            effs[key] = replace(effs[key], **pre)
    return effs


def score_rows(rows: list[_Row], effs_for) -> list[RowScore]:
    """Predicted vs published per row; `effs_for(row)` gives the Efficiency to use (event simulation on)."""
    out = []
    for r in rows:
        eff = effs_for(r)
        t = r.timing(eff, True)
        pred = r.minutes(eff, r.rcp, True, t)
        perf_pred = perf_pub = perf_err = None
        if r.runs:
            perf_pred = mlperf.olympic_mean([r.minutes(eff, c, True, t) for c in r.runs] + [math.inf] * r.failed)
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
                t[0],
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
        "sku_gemm": dict(sorted(getattr(effs, "sku_gemm", {}).items())),
        "benchmarks": {k: dict(v) for k, v in sorted(getattr(effs, "bench", {}).items())},
        "run_terms": getattr(effs, "run_terms", {}),
        "fit": {
            "objective": "steps: squared log error of the logs' steady step seconds; evaluations and one-offs: "
            "medians of the logs' seconds per benchmark and software release",
            "rows": [f"{s.row.benchmark} {s.row.round} {s.row.system} {s.row.gpus}" for s in scores],
            "perf": summary(scores, "perf_error"),
            "ttt": summary(scores, "error"),
        },
    }
    return json.dumps(doc, indent=2) + "\n"
