"""`scaletrain sim validate`'s text output: predicted against published time-to-train per row, the summaries per
benchmark, the rows skipped and, with --cv, the out-of-sample table (`sim/fit/validate.py` computes them)."""

from __future__ import annotations

from scaletrain.sim.fit.rate_table import RateRow, largest_by_kind
from scaletrain.sim.fit.terms import ONE_OFF_FLOOR_S, terms_summary
from scaletrain.sim.fit.validate import CV_TITLE, cv_summary, own_fit_note
from scaletrain.sim.rate_bounds import PEAK_FRACTION


def print_validation(scores: list, summary: dict, by_bench: dict, errors: list, cv: dict | None) -> None:
    """The in-sample table (one line per scored row), the summary line per benchmark (and "all"), each benchmark's
    own-fit note, the skipped rows, then the cross-validation table when `cv` was run."""
    print(
        f"{'benchmark':16} {'round':5} {'gpu':5} {'GPUs':>6} {'layout':22} {'step s':>7} {'pred min':>9} "
        f"{'published':>9} {'error':>7} {'perf err':>8}"
    )
    for s in scores:
        r = s.row
        lay = f"TP{r.tp} PP{r.pp} VP{r.vp} CP{r.cp} GBS{r.gbs}"
        perf = "-" if s.perf_error is None else f"{100 * s.perf_error:+.1f}%"
        err = "-" if s.error is None else f"{100 * s.error:+6.1f}%"
        print(
            f"{r.benchmark:16} {r.round:5} {r.gpu:5} {r.gpus:6d} {lay:22} {s.step_time_s:7.3f} "
            f"{s.predicted_min:9.2f} {s.published_min:9.2f} {err:>7} {perf:>8}"
        )
    for b, v in summary.items():
        t, p = v["ttt"], v["perf"]
        print(
            f"{b}: {t['rows']} rows, time-to-train MAPE {t['mape_pct']:.2f}% max {t['max_err_pct']:.2f}%"
            + (
                f"; with the published convergence MAPE {p['mape_pct']:.2f}% max {p['max_err_pct']:.2f}%"
                if p["rows"]
                else ""
            )
        )
    for b, bench_scores in by_bench.items():
        note = own_fit_note(b, len(bench_scores))
        if note:
            print(note)
    for where, why in errors:
        print(f"skipped {where}: {why}")
    if cv:
        print_cv(cv)


def print_cv(cv: dict) -> None:
    """The cross-validation table and per-benchmark summary lines."""
    title = CV_TITLE[cv["mode"]]
    if cv["mode"] == "loo":
        how = "each row predicted by sets refitted on the other rows"
    elif cv["mode"] == "round":
        how = (
            "each benchmark's newest round predicted by sets fitted on every row of the rounds before it: "
            + ", ".join(f"{b} {r} from {cv['fit_rows'][r]} rows" for b, r in cv["rounds"].items())
        )
    else:
        how = (
            "rows at or above "
            + ", ".join(f"{b} {n} GPUs" for b, n in cv["thresholds"].items())
            + f" predicted by sets fitted on the {cv['fit_rows']} rows below"
        )
    print(f"\n{title} ({how}):")
    print(
        f"{'benchmark':16} {'round':5} {'gpu':5} {'GPUs':>6} {'set used':15} {'pred min':>9} {'published':>9} "
        f"{'cv error':>8} {'cv perf':>8} {'in-sample':>9}"
    )
    for (r, used, s), ins in zip(cv["scores"], cv["in_sample"]):
        perf = "-" if s.perf_error is None else f"{100 * s.perf_error:+.1f}%"
        print(
            f"{r.benchmark:16} {r.round:5} {r.gpu:5} {r.gpus:6d} {used:15} {s.predicted_min:9.2f} "
            f"{s.published_min:9.2f} {100 * s.error:+7.1f}% {perf:>8} {100 * ins.error:+8.1f}%"
        )
    for b, v in cv_summary(cv).items():
        t, p, it = v["ttt"], v["perf"], v["in_sample_ttt"]
        print(
            f"{b}: {t['rows']} rows, {title} time-to-train MAPE {t['mape_pct']:.2f}% max {t['max_err_pct']:.2f}%"
            + (
                f"; with the published convergence MAPE {p['mape_pct']:.2f}% max {p['max_err_pct']:.2f}%"
                if p["rows"]
                else ""
            )
            + f"; in-sample {it['mape_pct']:.2f}% max {it['max_err_pct']:.2f}%"
        )
    if cv.get("terms"):
        print(f"\n{title}, term by term (the same held-out fits):", end="")
        print_terms(terms_summary(cv["terms"]), 0, header=False)


def print_terms(summary: dict, unmatched: int, header: bool = True) -> None:
    """`--terms`: per benchmark and term, the rows scored and the bias, mean and max of predicted / measured - 1."""
    if header:
        print("\nterms against the public logs (sim/data/mlperf_terms, medians over each row's runs):", end="")
    print(
        f" error = predicted / measured - 1, the one-off's relative to max(|measured|, {ONE_OFF_FLOOR_S:g} s); "
        "predicted one-off = the release's one-off seconds plus its recipe's pauses"
    )
    print(f"{'benchmark':16} {'term':10} {'rows':>5} {'bias':>8} {'mean|err|':>10} {'max|err|':>9}")
    names = {"step_s": "step", "eval_s": "evaluation", "one_off_s": "one-off"}
    for bench, per_term in summary.items():
        for term, s in per_term.items():
            print(
                f"{bench:16} {names[term]:10} {s['rows']:5d} {s['bias_pct']:+7.1f}% {s['mape_pct']:9.1f}% "
                f"{s['max_pct']:8.1f}%"
            )
    if unmatched:
        print(f"{unmatched} scored rows have no terms (not a calibration row)")


def _benchmarks_text(rows: list[RateRow], every: set) -> str:
    if {r.benchmark for r in rows} == every:
        return "every model"
    return ", ".join(r.benchmark or "other models" for r in rows)


def print_rates(rows: list[RateRow], top: int = 10) -> None:
    """`sim validate --rates`: the largest effective rate of each kind as a % of its datasheet peak, then the `top`
    largest rates (benchmarks with the same rate on one line) and how many pass the bound."""
    bound = 100 * PEAK_FRACTION
    print(
        f"effective GEMM and attention rates of every fitted set x GPU x benchmark ({len(rows):,} rates), as % of "
        f"the datasheet dense peak; bound {bound:g}%"
    )
    print("largest per kind:")
    for kind, r in largest_by_kind(rows).items():
        print(
            f"  {kind:13} {r.pct:6.1f}%  {r.tflops:7,.0f} of {r.peak_tflops:7,.0f} TFLOP/s  {r.gpu} under {r.set} "
            f"({r.basis} ceiling)"
        )
    # Benchmarks a set prices alike (no own multiplier) share one line.
    groups: dict[tuple, list[RateRow]] = {}
    for r in sorted(rows, key=lambda r: -r.pct):
        groups.setdefault((r.set, r.gpu, r.kind, round(r.tflops, 3)), []).append(r)
    every = {r.benchmark for r in rows}
    over = sum(r.pct > bound for r in rows)
    print(f"{over:,} of {len(rows):,} rates above {bound:g}%; the largest:")
    for group in list(groups.values())[:top]:
        r = group[0]
        print(
            f"  {r.pct:6.1f}%  {r.kind:13} {r.gpu:8} {r.set:28} {r.tflops:7,.0f} of {r.peak_tflops:7,.0f} TFLOP/s "
            f"({r.basis})  {_benchmarks_text(group, every)}"
        )
