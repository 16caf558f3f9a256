"""The simulator's subcommands (predict, plan, sim validate / plot / calibrate): arguments in, table or JSON out.

`scaletrain.cli.main` only wires these to argparse. Nothing here imports torch: a trainer config is read through the
trainer's own layout adapter (`parallel/sim_layout.py`, torch-free), as `train --dry-run` reads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from scaletrain import benchmarks
from scaletrain.cli import pretrain_report
from scaletrain.cli.calibrate_modes import calibrate_from_runs, calibrate_layer_timings
from scaletrain.cli.cost_args import add_prices_parser
from scaletrain.cli.job_args import (
    catalog_flag,
    check_recipe_flags,
    check_split,
    job_flags,
    layout_flags,
    layout_from_args,
    split_flags,
    split_from_args,
)
from scaletrain.cli.run_lines import plan_run_lines, print_run_lines
from scaletrain.cli.validate_report import print_rates, print_terms, print_validation
from scaletrain.config_bounds import DEGREE_MAX, TOP_MAX, int_flag
from scaletrain.log import get_logger
from scaletrain.parallel.sim_layout import sim_inputs
from scaletrain.sim.catalog import Catalog, load_catalog
from scaletrain.sim.efficiency import efficiency_for, load_efficiencies
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.rate_table import largest_by_kind, rate_table
from scaletrain.sim.fit.results import bundled_results, bundled_skipped, load_results
from scaletrain.sim.fit.terms import bundled_terms, score_terms, terms_summary
from scaletrain.sim.fit.validate import cross_validate, cv_json, default_jobs, score_dict
from scaletrain.sim.predict import Prediction, benchmark_of, predict
from scaletrain.sim.rate_bounds import PEAK_FRACTION
from scaletrain.sim.workload import load_config, load_workload

log = get_logger(__name__)

SAMPLES_MAX = 10**12
"""Largest --samples: a million times gpt3's RCP (about 600,000 sequences), far past any run anyone would price."""


def _fmt_min(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def print_prediction(p: Prediction, out=None) -> None:
    """Human-readable prediction with its breakdown."""
    lay = p.layout
    print(f"{p.model} on {p.gpus:,} x {p.gpu} ({p.node}, {p.fabric}), calibration {p.calibration}", file=out)
    print(
        f"  layout TP{lay['tp']} PP{lay['pp']} VP{lay['vp']} CP{lay['cp']} DP{lay['dp']}"
        f"{' EP' + str(lay['ep']) if lay.get('ep', 1) > 1 else ''} mbs{lay['mbs']} "
        f"GBS{lay['gbs']} ({lay['microbatches']} micro-batches, {lay['schedule']}), "
        f"{'fp4' if lay.get('fp4') else 'fp8' if lay['fp8'] else 'bf16'}"
        f"{' (FP8 attention)' if lay.get('fp8_attention') else ''}, recompute {lay['recompute']}, zero {lay['zero']}",
        file=out,
    )
    if not p.feasible:
        print("  NOT FEASIBLE: " + "; ".join(p.reasons), file=out)
        if math.isnan(p.step_time_s):
            return
    print(
        f"  step {p.step_time_s:.3f} s | {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU | "
        f"{p.model_tflops_per_gpu:,.0f} model TFLOP/s/GPU | MFU {100 * p.mfu:.1f}% "
        f"(of the dense bf16 peak {p.mfu_peak_tflops:g}) | memory {p.memory_gib_per_gpu:.1f} GiB/GPU",
        file=out,
    )
    parts = " ".join(f"{k} {1000 * v:.0f}ms" for k, v in p.breakdown.items() if v > 0.0005)
    print(f"  step breakdown: {parts}", file=out)
    mem = " ".join(f"{k} {v}" for k, v in p.memory.items() if k not in ("total", "in_flight"))
    print(f"  memory (GiB): {mem}, {p.memory.get('in_flight', 0):g} micro-batches in flight", file=out)
    if p.time_to_train_min is not None and p.step_time_post_switch_s is not None:
        # An FP4 run past its healing step: the steps and evaluations after it at the FP8 times.
        pre_steps = (p.steps or 0) - (p.steps_post_switch or 0)
        pre_evals = (p.evals or 0) - (p.evals_post_switch or 0)
        print(
            f"  time to train {p.time_to_train_min:.2f} min = {pre_steps:g} FP4 steps x {p.step_time_s:.3f} s "
            f"+ {p.steps_post_switch:g} FP8 steps x {p.step_time_post_switch_s:.3f} s (after the healing step "
            f"{p.healing_step}) + {pre_evals:g} evaluations x {p.eval_time_s:.2f} s + {p.evals_post_switch:g} FP8 "
            f"evaluations x {p.eval_time_post_switch_s:.2f} s{_first_extra(p)} + one-off {p.warmup_s or 0:.1f} s",
            file=out,
        )
    elif p.time_to_train_min is not None:
        print(
            f"  time to train {p.time_to_train_min:.2f} min = {p.steps:g} steps x {p.step_time_s:.3f} s "
            f"+ {p.evals:g} evaluations x {p.eval_time_s:.2f} s{_first_extra(p)} + one-off {p.warmup_s or 0:.1f} s",
            file=out,
        )


def _first_extra(p) -> str:
    """ " (the first +X s)" where the first evaluation takes longer than the others."""
    extra = (p.eval_first_s or 0.0) - (p.eval_time_s or 0.0)
    return f" (the first +{extra:.2f} s)" if extra >= 0.005 else ""


def _converge(model: str, samples: int | None) -> float | None:
    """`--samples N` in the benchmark's convergence unit (gpt3 converges in tokens: N sequences of its length);
    None (the RCP mean) without the flag."""
    if samples is None:
        return None
    name = benchmark_of(model)
    if name is None:
        raise ValueError(f"--samples needs an MLPerf benchmark's model (one of {', '.join(benchmarks.names())})")
    spec = benchmarks.get(name)
    return float(samples * spec.seq_len if spec.converge_unit == "tokens" else samples)


def cmd_predict(args) -> int:
    """Predict step time, throughput, MFU, memory and MLPerf time-to-train for one layout on one cluster."""
    if args.from_config:
        # The layout as `scaletrain train --dry-run --world-size N` would run it: parallel.* and train.* fields of
        # the config (FILE over the --model preset, then --set), at N ranks.
        config_file = args.from_config if isinstance(args.from_config, str) else None
        w, layout = sim_inputs(load_config(args.model, tuple(args.set), config_file), args.gpus)
    else:
        w, layout = load_workload(args.model, tuple(args.set)), layout_from_args(args)
        check_split(w, layout)
    if args.tokens is not None:
        return pretrain_report.predict_tokens(args, w, layout, print_prediction)
    p = predict(
        w,
        layout,
        args.gpu,
        args.node,
        args.fabric,
        args.calibration,
        converge=_converge(w.name, args.samples),
        catalog=load_catalog(args.catalog),
    )
    if args.json:
        print(json.dumps(p.to_dict(), indent=2))
    else:
        print_prediction(p)
    return 0 if p.feasible else 1


def cmd_plan(args) -> int:
    """Search layouts (TP, PP, VP, CP, DP, EP, micro-batch, GBS, recompute, FP8) under the memory limit; print the
    best."""
    from scaletrain.sim.plan import plan

    check_recipe_flags(args, fp8=True)  # plan's FP8 layouts take --fp8-attention; --fp4-healing-step needs --fp4
    w = load_workload(args.model, tuple(args.set))
    split = split_from_args(args)
    if sum(split["pp_stage_layers"]) not in (0, w.shape.layers):
        raise ValueError(
            f"--pp-stage-layers: the stage layer list sums to {sum(split['pp_stage_layers'])} blocks, but {w.name} "
            f"has {w.shape.layers}"
        )
    cat = load_catalog(args.catalog)
    gbs: int | None = args.gbs
    run_options: dict = {}
    if args.tokens is not None:
        # A token budget: the search at the run's (largest) batch by throughput, its best priced as whole runs.
        w, gbs, run_options = pretrain_report.plan_inputs(args, w)
    res = plan(
        w,
        args.gpu,
        args.gpus,
        args.node,
        args.fabric,
        args.calibration,
        top=args.top,
        gbs=gbs,
        catalog=cat,
        fp4=args.fp4,
        as_trained=args.as_trained,
        moe_imbalance=args.moe_imbalance,
        fp8_attention=args.fp8_attention,
        fp4_healing_step=args.fp4_healing_step,
        **split,
        **run_options,
    )

    def lines(p: Prediction) -> dict:
        return plan_run_lines(args.model, args.set, p.layout, p.gpu, cat.node(p.node).gpus_per_node, sim_inputs)

    if args.tokens is not None:
        return pretrain_report.plan_tokens(args, w, res, print_prediction, lines, print_run_lines)
    runs = [lines(p) for p in res.best]
    if args.json:
        print(json.dumps([{**p.to_dict(), **run} for p, run in zip(res.best, runs)], indent=2))
        return 0 if res.best else 1
    if not pretrain_report.print_search(res):
        return 1
    for i, (p, run) in enumerate(zip(res.best, runs), 1):
        print(f"#{i}", end=" ")
        print_prediction(p)
        print_run_lines(run)
    return 0


def _results(paths: list[str], cat: Catalog):
    """Rows of every file (default: the shipped calibration rows) and (where, why) for what was skipped.

    A file that cannot be read at all (missing, wrong columns) is skipped as a whole; the others still count.
    """
    if not paths:
        # Shipped rows the files do not give a layout for are named, not silently dropped.
        return bundled_results(), bundled_skipped()
    from scaletrain.sim.fit.results import ResultsError

    rows, errors = [], []
    for path in paths:
        if not Path(path).exists():
            errors.append((path, "no such file"))
            continue
        try:
            rep = load_results(Path(path), catalog=cat)
        except ResultsError as exc:
            errors.append((path, str(exc)))
            continue
        rows += [replace(r, file=path) for r in rep.rows]
        errors += [(f"{path} line {line}", why) for line, why in rep.errors]
    if not rows:  # nothing to score or fit is bad input, not an empty table
        where, why = errors[0] if errors else (", ".join(paths), "no rows")
        raise ValueError(f"{where}: {why}" if not why.startswith(where) else why)
    return rows, errors


def _where(r) -> str:
    return f"{r.file or r.benchmark + ' calibration'} line {r.line} ({r.system})"


def _row_eff(r, cat: Catalog):
    # A row whose logs name their software is priced with that release's evaluation and one-off seconds.
    software = r.terms.software if r.terms else None
    try:
        return efficiency_for(r.row.round, r.row.gpu, r.bench, cat, software)[1]
    except ValueError:
        # A round newer than the calibration: its newest set.
        return efficiency_for(None, r.row.gpu, r.bench, cat, software)[1]


def cmd_validate(args) -> int:
    """Predicted vs published time-to-train for every row of results CSVs (default: the calibration rows); with
    --rates, the fitted sets' effective GEMM and attention rates against the datasheet peaks instead."""
    cat = load_catalog(args.catalog)
    if args.rates:
        return _validate_rates(args, cat)
    rows, errors = _results(args.results, cat)
    ready, bad = cal.prepare(rows, cat)
    errors += [(_where(r), why) for r, why in bad]
    scores = cal.score_rows(ready, lambda r: _row_eff(r, cat))
    cv = None
    if args.cv:
        cv = cross_validate(ready, args.cv, args.cv_threshold, args.jobs or default_jobs())
    by_bench: dict[str, list] = {}
    for s in scores:
        by_bench.setdefault(s.row.benchmark, []).append(s)
    summary = {b: {"ttt": cal.summary(v), "perf": cal.summary(v, "perf_error")} for b, v in by_bench.items()}
    summary["all"] = {"ttt": cal.summary(scores), "perf": cal.summary(scores, "perf_error")}
    terms: dict | None = None
    if args.terms:
        scored = score_terms(ready, lambda r: _row_eff(r, cat), bundled_terms())
        terms = {"rows": scored, "summary": terms_summary(scored)}
    if args.json:
        print(
            json.dumps(
                {
                    "rows": [score_dict(s) for s in scores],
                    "summary": summary,
                    "skipped": [{"where": w, "reason": why} for w, why in errors],
                    **({"cv": cv_json(cv)} if cv else {}),
                    **({"terms": terms} if terms is not None else {}),
                },
                indent=2,
            )
        )
        return 0 if scores else 1
    print_validation(scores, summary, by_bench, errors, cv)
    if terms is not None:
        print_terms(terms["summary"], len(ready) - len(terms["rows"]))
    return 0 if scores else 1


def _validate_rates(args, cat: Catalog) -> int:
    """`sim validate --rates`: every fitted set x GPU x benchmark's effective rates as % of the datasheet peak
    (`sim/rate_bounds.py`); 1 when one passes the bound, so a script can check a fit with it."""
    given = [flag for flag, on in (("--results", args.results), ("--cv", args.cv), ("--terms", args.terms)) if on]
    if given:
        raise ValueError(f"sim validate --rates checks the fitted sets, not results rows: drop {', '.join(given)}")
    rows = sorted(rate_table(load_efficiencies(), cat), key=lambda r: -r.pct)
    over = sum(r.pct > 100 * PEAK_FRACTION for r in rows)
    if args.json:
        print(
            json.dumps(
                {
                    "peak_fraction": PEAK_FRACTION,
                    "rates": len(rows),
                    "above_bound": over,
                    "largest": {k: r.to_dict() for k, r in largest_by_kind(rows).items()},
                    "rows": [r.to_dict() for r in rows],
                },
                indent=2,
            )
        )
    else:
        print_rates(rows)
    return 1 if over else 0


def _first_nonfinite(doc, where: str = "") -> tuple[str, float] | None:
    """(path, value) of the first NaN or infinite number in JSON-like `doc`, else None."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return where or "the top level", doc
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, (list, tuple)) else ()
    for key, value in items:
        found = _first_nonfinite(value, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def cmd_calibrate(args) -> int:
    """Fit the efficiency scalars: on published results (--published, default the calibration rows), on
    scaletrain's own measured runs (RUN_DIR...), or on one GPU's per-layer timings (--layer-timings, also giving
    a catalog override with the measured GEMM curve), and write them where predictions pick them up."""
    cat = load_catalog(args.catalog)
    if getattr(args, "layer_timings", None):
        doc = calibrate_layer_timings(args, cat)
    elif args.run_dirs:
        doc = calibrate_from_runs(args, sim_inputs, cat)
    elif args.held_out:
        raise ValueError("--held-out RUN_DIR: give the runs to fit on too (sim calibrate RUN_DIR... --held-out ...)")
    else:
        rows, errors = _results(args.published or [], cat)
        for where, why in errors:
            log.warning(f"skipped {where}: {why}")
        ready, bad = cal.prepare(rows, cat)
        for r, why in bad:
            log.warning(f"skipped {_where(r)}: {why}")
        effs = cal.fit(ready)
        scores = cal.score_rows(ready, lambda r: cal.row_eff(effs, r))
        doc = json.loads(cal.to_json(effs, scores))
        s = doc["fit"]
        print(
            f"fitted {len(effs)} sets on {len(ready)} rows: time-to-train MAPE {s['ttt']['mape_pct']:.2f}% "
            f"(max {s['ttt']['max_err_pct']:.2f}%), with published convergence {s['perf']['mape_pct']:.2f}%"
        )
    nonfinite = _first_nonfinite(doc)
    if nonfinite:  # a consumer of the file would read a bare NaN as a number, or fail on it: write none
        raise ValueError(f"sim calibrate: the fit gave {nonfinite[1]} at {nonfinite[0]}; nothing written")
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}; use it with SCALETRAIN_EFFICIENCY={args.out}")
    else:
        print(text)
    return 0


def cmd_plot(args) -> int:
    """PNG of predicted time-to-train vs GPU count per GPU type, with the published points."""
    from scaletrain.cli.plot import plot_scaling

    out, differ, notes = plot_scaling(
        args.model, args.out, gpus=args.gpu_list, calibration=args.calibration, results=args.results
    )
    print(f"wrote {out}")
    if notes:
        print(
            f"{differ} published points (x in the plot) ran another layout than the curve's best planned one at "
            "their GPU count; the gap to them is not the model's error on their layout (`sim validate` prices each "
            "in its own):"
        )
        for line in notes:
            print(f"  {line}")
    return 0


def add_parsers(sub):
    """Attach predict, plan and sim (validate, calibrate, plot, prices) to the `scaletrain` subparsers; returns the
    `sim` subparsers (`cli/goodput.py` adds its commands there)."""
    _add_predict(sub)
    _add_plan(sub)
    p = sub.add_parser("sim", help="validate, plot and calibrate the performance model")
    ssub = p.add_subparsers(dest="sim_command", required=True)
    _add_validate(ssub)
    _add_calibrate(ssub)
    _add_plot(ssub)
    add_prices_parser(ssub)
    return ssub


def _add_predict(sub) -> None:
    p = sub.add_parser(
        "predict", help="predict step time, memory and time-to-train on a cluster", description=cmd_predict.__doc__
    )
    job_flags(p)
    layout_flags(p)
    split_flags(p)
    p.add_argument(
        "--from-config",
        nargs="?",
        const=True,
        default=None,
        metavar="FILE",
        help="take the layout from the trainer config: FILE (a run's config.json or a TOML, as `train --config` "
        "reads it; optional) over the --model preset, then --set / --parallel.* / --train.* fields, as `scaletrain "
        "train --dry-run --world-size N` would run it (FSDP/HSDP = ZeRO-3, DDP = ZeRO-0); layout flags are ignored",
    )
    p.add_argument(
        "--samples",
        type=int_flag(1, SAMPLES_MAX),
        default=None,
        metavar="N",
        help="sequences the run trains before it converges (default: the benchmark's RCP mean at the batch size); "
        "the run stops at the first evaluation at or after them, so a published run can be predicted with its own "
        "convergence",
    )
    p.set_defaults(func=cmd_predict)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="search parallel layouts for a cluster", description=cmd_plan.__doc__)
    job_flags(p)
    split_flags(p, plan=True)
    p.add_argument(
        "--top",
        type=int_flag(1, TOP_MAX),
        default=5,
        metavar="N",
        help=f"how many of the best layouts to show (default 5, at most {TOP_MAX})",
    )
    p.add_argument(
        "--as-trained",
        action="store_true",
        help="price what `scaletrain train` runs (FSDP2 = ZeRO-3 over dp·cp at every pipeline depth, fp32 gradient "
        "reduction) instead of Megatron's MLPerf recipe (distributed optimizer, bf16 gradients under FP8)",
    )
    p.add_argument(
        "--rank-by",
        default="time",
        choices=pretrain_report.RANK_BY,
        help="with --tokens: order the best layouts by the run's expected days with failures (time, default), its "
        "cost (cost) or its facility energy (energy)",
    )
    p.set_defaults(func=cmd_plan)


def _add_validate(ssub) -> None:
    v = ssub.add_parser("validate", help="predicted vs published results", description=cmd_validate.__doc__)
    v.add_argument(
        "--results",
        action="append",
        default=[],
        metavar="CSV",
        help="results CSV in the calibration format (repeatable; default: the shipped calibration rows)",
    )
    catalog_flag(v)
    v.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    v.add_argument(
        "--cv",
        choices=("loo", "scale", "round"),
        help="also score out of sample, refitting with `sim calibrate`'s procedure on the rows given: loo = each "
        "row predicted by a fit on all the others; scale = rows at or above --cv-threshold GPUs predicted by a fit "
        "on the rows below; round = each benchmark's newest round predicted by a fit on the earlier ones (the "
        "in-sample error of the same rows, refitted on all of them, is shown alongside)",
    )
    v.add_argument(
        "--cv-threshold",
        type=int_flag(1, DEGREE_MAX),
        metavar="N",
        help="--cv scale: GPU count from which rows are scored (default, per benchmark: the median of its distinct "
        "GPU counts, the upper of the middle two when even)",
    )
    v.add_argument(
        "--jobs",
        type=int_flag(1, 1024),
        default=None,
        metavar="N",
        help="--cv loo: refits run at a time in separate processes (default: the CPUs available)",
    )
    v.add_argument(
        "--terms",
        action="store_true",
        help="also score each term against the rows' public logs (sim/data/mlperf_terms): the predicted step, "
        "evaluation and timed warm-up against the measured steady step, steady evaluation and one-off seconds",
    )
    v.add_argument(
        "--rates",
        action="store_true",
        help="instead of scoring rows, check the fitted sets against the hardware: every set x GPU x benchmark's "
        "effective GEMM (bf16, FP8, FP4) and attention rate as a percentage of the datasheet dense peak, the largest "
        "per kind and the largest overall (exit 1 when one is above 90%%, the bound of sim/rate_bounds.py)",
    )
    v.set_defaults(func=cmd_validate)


def _add_calibrate(ssub) -> None:
    c = ssub.add_parser("calibrate", help="fit efficiency scalars", description=cmd_calibrate.__doc__)
    c.add_argument(
        "run_dirs",
        nargs="*",
        help="scaletrain run directories to fit on (their config.json, prediction.json and measured step "
        "breakdown in metrics.jsonl; CPU or GPU)",
    )
    c.add_argument(
        "--held-out",
        action="append",
        metavar="RUN_DIR",
        help="also predict this run with the fitted terms and report its error (repeatable; not fitted on)",
    )
    c.add_argument("--published", action="append", metavar="CSV", help="results CSV to fit on (default: shipped)")
    c.add_argument(
        "--gpu",
        metavar="GPU",
        help="catalog GPU the runs used (default: the device their prediction.json records)",
    )
    c.add_argument(
        "--calibration", metavar="SET", help="the set whose other scalars the runs' fit starts from (default newest)"
    )
    catalog_flag(c)
    c.add_argument("--out", metavar="JSON", help="write the fitted sets here (point $SCALETRAIN_EFFICIENCY at it)")
    c.add_argument(
        "--layer-timings",
        metavar="JSON",
        help="fit one GPU to per-layer timings from benchmarks/gpu_mfu.py (its gpu_mfu.json or "
        "*.layer_timings.json): the measured GEMMs become gemm_curve_bf16/gemm_curve_fp8 "
        "[[GFLOP, TFLOP/s], ...], with the GEMM, attention and copy ceilings, in a catalog "
        "override TOML (--catalog-out); gemm_eff fitted to the measured blocks and the per-step "
        "overhead to the measured single-GPU steps go to the efficiency set measured/<generation> "
        "(--out). Predict with both: --catalog TOML --calibration measured, "
        "SCALETRAIN_EFFICIENCY=JSON",
    )
    c.add_argument(
        "--catalog-out",
        metavar="TOML",
        help="with --layer-timings: where the catalog override goes (default: --out with .toml)",
    )
    c.set_defaults(func=cmd_calibrate)


def _add_plot(ssub) -> None:
    pl = ssub.add_parser("plot", help="time-to-train vs GPU count PNG", description=cmd_plot.__doc__)
    pl.add_argument(
        "--model",
        default="gpt3-175b",
        metavar="NAME",
        help="the benchmark's model (default gpt3-175b): "
        + benchmarks.choices_text(b.reference_preset for b in benchmarks.BENCHMARKS.values()),
    )
    pl.add_argument(
        "--out", default="sim_scaling.png", metavar="PNG", help="where the plot goes (default sim_scaling.png)"
    )
    pl.add_argument(
        "--gpu",
        dest="gpu_list",
        action="append",
        metavar="GPU",
        help="a GPU to draw, repeatable (default: every GPU the published results ran on)",
    )
    pl.add_argument("--calibration", metavar="SET", help="the efficiency set to predict with (default newest)")
    pl.add_argument(
        "--results",
        action="append",
        default=[],
        metavar="CSV",
        help="a results CSV of further published points to draw (repeatable)",
    )
    pl.set_defaults(func=cmd_plot)
