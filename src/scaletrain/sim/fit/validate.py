"""Out-of-sample scores of the fitted efficiencies: leave-one-out and scale-split cross-validation.

`sim validate` alone scores the calibration rows with the sets fitted on those same rows (in-sample). Here every
scored row is predicted by sets fitted without it, by exactly the procedure `sim calibrate` uses (`calibrate.fit`):

- "loo": for each row, refit on all the other rows and predict it (the shared scalars are fitted on every row,
  so the whole fit is redone from the priors, not only the row's own GEMM efficiency).
- "scale": fit once on the rows below a GPU-count threshold and predict the rows at or above it. The default
  threshold, per benchmark, is the (upper) median of the benchmark's distinct GPU counts: the upper half of the scales
  it was run at is predicted from the lower half (a median over rows would put every 8-GPU LoRA row above it).

A row whose set (release/generation) has no row left in the fit uses the nearest fitted set, as `predict` does
for a generation without its own set: the same release's other generation (Hopper first); a release with no set
left at all takes the newest release's, its own generation first.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

from scaletrain.sim.efficiency import Efficiency, nearest_set
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.terms import score_terms, terms_summary

MODES = ("loo", "scale", "round")


def own_fit_note(bench: str, rows: int) -> str:
    """What a benchmark outside SHARED_FIT with `rows` calibration rows fits of its own ("" for the others), for
    `sim validate` to print beside its errors."""
    if bench in cal.SHARED_FIT or rows <= 0:
        return ""
    names = cal.OWN_FIT[: max(1, rows // cal.ROWS_PER_OWN_SCALAR)]
    return (
        f"note: {bench}'s {rows} rows fit only {', '.join(names)} of its own, on top of the "
        f"{'/'.join(cal.SHARED_FIT)} fit"
        + (f"; {rows} rows pin little: its errors say little about a new result" if rows < 10 else "")
    )


def default_thresholds(rows: list[cal._Row]) -> dict[str, int]:
    """Per benchmark: the median of its distinct GPU counts, the upper one of the middle two when their number is
    even (rows at or above it are scored by `--cv scale`)."""
    counts: dict[str, set[int]] = {}
    for r in rows:
        counts.setdefault(r.bench, set()).add(r.row.gpus)
    out = {}
    for bench, c in counts.items():
        s = sorted(c)
        out[bench] = s[len(s) // 2]
    return out


def _round_key(name: str) -> tuple[int, ...]:
    """ "v4.1" -> (4, 1): rounds in time order."""
    return tuple(int(x) for x in name.lstrip("v").split(".") if x.isdigit())


def newest_rounds(rows: list[cal._Row]) -> dict[str, str]:
    """Per benchmark with rows from two or more rounds, its newest round (the rows `--cv round` scores)."""
    rounds: dict[str, set[str]] = {}
    for r in rows:
        rounds.setdefault(r.bench, set()).add(r.row.round)
    return {b: max(s, key=_round_key) for b, s in rounds.items() if len(s) > 1}


def _score(r: cal._Row, effs: dict[str, Efficiency]) -> tuple[str, cal.RowScore, dict | None]:
    used, eff = nearest_set(effs, r.set)
    eff = cal.row_eff(effs, r, eff)  # the SKU multiplier and benchmark scalars the fit left (1 / priors if none)
    scored = score_terms([r], lambda _: eff, {_terms_key(r): r.terms} if r.terms else {})
    return used, cal.score_rows([r], lambda _: eff)[0], (scored[0] if scored else None)


def _terms_key(r: cal._Row) -> tuple[str, str, str, int]:
    return r.row.benchmark, r.row.round, r.row.system, r.row.gpus


def _loo_one(args: tuple[list[cal._Row], int]) -> tuple[str, cal.RowScore, dict | None]:
    rows, i = args
    # A cold refit from the priors: one warm-started from the fit on every row keeps part of the left-out row's pull.
    return _score(rows[i], cal.fit(rows[:i] + rows[i + 1 :]))


def cross_validate(rows: list[cal._Row], mode: str, threshold: int | None = None, jobs: int = 1) -> dict:
    """Out-of-sample scores of prepared calibration rows.

    Returns {"mode", "thresholds" (scale: per benchmark), "rounds" (round: each benchmark's newest, the rows
    scored), "fit_rows" (rows each fit saw: LOO n-1, scale the count below the thresholds, round a count per held-out
    round), "sets" (scale: the fitted sets; round: per held-out round), "scores" [(row, set used, RowScore)],
    "in_sample" [RowScore of the same rows with sets fitted on every row], "terms" [the held-out rows' step,
    evaluation and one-off against their logs, `terms.score_terms` rows]}. `jobs` > 1 runs LOO refits in
    that many processes (the fits are independent; results do not depend on it).
    """
    if mode not in MODES:
        raise ValueError(f"--cv {mode!r}: expected one of {', '.join(MODES)}")
    if len(rows) < 2:
        raise ValueError(f"--cv {mode} needs at least 2 rows that the simulator can take, got {len(rows)}")
    out: dict = {"mode": mode, "thresholds": {}, "sets": {}}
    full = cal.fit(rows)
    if mode == "loo":
        scored = list(range(len(rows)))
        tasks = [(rows, i) for i in scored]
        if jobs > 1:
            with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
                results = list(pool.map(_loo_one, tasks))
        else:
            results = [_loo_one(t) for t in tasks]
        out["fit_rows"] = len(rows) - 1
    elif mode == "scale":
        limits = default_thresholds(rows) if threshold is None else {r.bench: threshold for r in rows}
        out["thresholds"] = limits
        train = [r for r in rows if r.row.gpus < limits[r.bench]]
        scored = [i for i, r in enumerate(rows) if r.row.gpus >= limits[r.bench]]
        if not train or not scored:
            raise ValueError(
                f"--cv scale: thresholds {limits} leave {len(train)} rows to fit and {len(scored)} to score; "
                "both must be non-empty (--cv-threshold N)"
            )
        effs = cal.fit(train)
        out["sets"] = {k: e.to_dict() for k, e in sorted(effs.items())}
        results = [_score(rows[i], effs) for i in scored]
        out["fit_rows"] = len(train)
    else:
        # Each benchmark's newest round R predicted by a fit on every row of the rounds before R (any benchmark):
        # nothing published in R is seen, and R's own release set is not fitted, so its rows take the nearest
        # fitted set, as a prediction for a new release would.
        newest = newest_rounds(rows)
        if not newest:
            raise ValueError("--cv round: no benchmark has rows from two rounds")
        out["rounds"] = newest
        out["fit_rows"] = {}
        scored, results = [], []
        for held in sorted(set(newest.values()), key=_round_key):
            train = [r for r in rows if _round_key(r.row.round) < _round_key(held)]
            effs = cal.fit(train)
            out["sets"][held] = {k: e.to_dict() for k, e in sorted(effs.items())}
            out["fit_rows"][held] = len(train)
            for i, r in enumerate(rows):
                if newest.get(r.bench) == held and r.row.round == held:
                    scored.append(i)
                    results.append(_score(r, effs))
    out["scores"] = [(rows[i].row, used, s) for i, (used, s, _) in zip(scored, results)]
    out["in_sample"] = [_score(rows[i], full)[1] for i in scored]
    # Each held-out row's step, evaluation and one-off against its logs, priced by the same held-out fit.
    out["terms"] = [t for _, _, t in results if t is not None]
    return out


def default_jobs() -> int:
    """Processes for LOO refits: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def score_dict(s: cal.RowScore) -> dict:
    """One scored row as `sim validate --json` prints it."""
    r = s.row
    return {
        "benchmark": r.benchmark,
        "round": r.round,
        "system": r.system,
        "gpu": r.gpu,
        "gpus": r.gpus,
        "line": r.line,
        "layout": {"tp": r.tp, "pp": r.pp, "vp": r.vp, "cp": r.cp, "mbs": r.mbs, "gbs": r.gbs, "fp8": r.fp8},
        "step_time_s": s.step_time_s,
        "predicted_min": s.predicted_min,
        "published_min": s.published_min,
        "error": s.error,
        "perf_predicted_min": s.perf_predicted_min,
        "perf_published_min": s.perf_published_min,
        "perf_error": s.perf_error,
    }


CV_TITLE = {"loo": "leave-one-out", "scale": "scale split", "round": "round split"}
"""How each --cv mode is named in the tables."""


def cv_summary(cv: dict) -> dict:
    """Per benchmark and "all": the cross-validated and the in-sample (same rows) error summaries."""
    groups: dict[str, list[int]] = {}
    for i, (row, _, _) in enumerate(cv["scores"]):
        groups.setdefault(row.benchmark, []).append(i)
    groups["all"] = list(range(len(cv["scores"])))
    out = {}
    for b, idx in groups.items():
        scores = [cv["scores"][i][2] for i in idx]
        ins = [cv["in_sample"][i] for i in idx]
        out[b] = {
            "ttt": cal.summary(scores),
            "perf": cal.summary(scores, "perf_error"),
            "in_sample_ttt": cal.summary(ins),
            "in_sample_perf": cal.summary(ins, "perf_error"),
        }
    return out


def cv_json(cv: dict) -> dict:
    """The `cv` object of `sim validate --cv MODE --json`."""
    rows = []
    for (_, used, s), ins in zip(cv["scores"], cv["in_sample"]):
        d = score_dict(s)
        d.update(set=used, in_sample_error=ins.error, in_sample_perf_error=ins.perf_error)
        rows.append(d)
    return {
        "mode": cv["mode"],
        "terms_summary": terms_summary(cv.get("terms", [])),
        "thresholds": cv["thresholds"],
        **({"rounds": cv["rounds"]} if "rounds" in cv else {}),
        "fit_rows": cv["fit_rows"],
        "sets": cv["sets"],
        "rows": rows,
        "summary": cv_summary(cv),
    }
