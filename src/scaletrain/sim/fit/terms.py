"""The calibration rows' public logs, broken into terms: steady step, evaluation and one-off seconds per row.

`sim/data/mlperf_terms/*.csv` (its README.md says how every column was computed) has one line per run of every
calibration row: `run_s = steps·step_s + Σ evaluations + one_off_s` exactly. This module reads them as untrusted data
(every field used is checked; a bad line is one error naming the file and line), reduces each row's decomposed runs
to their medians (`MeasuredTerms`), and scores the pricing model term by term against them (`score_terms`): the
predicted step against the measured steady step, the predicted evaluation against the steady evaluation, and the
timed warm-up against the one-off seconds. A whole-run error can hide two terms that cancel; these cannot.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["MeasuredTerms", "TermsError", "load_terms", "bundled_terms", "score_terms", "terms_summary"]

ONE_OFF_FLOOR_S = 5.0
"""One-off errors are relative to max(|measured|, this): many runs' one-off is a second or two of scatter around 0
(or slightly negative: step-time drift inside the run), where a relative error means nothing."""

_KEY_COLUMNS = ("benchmark", "round", "system", "n_accel")
_NUMBERS = ("step_s", "eval_s", "first_eval_s", "one_off_s", "samples_to_converge")


class TermsError(ValueError):
    """A terms file or line that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class MeasuredTerms:
    """One calibration row's terms: medians over its decomposed runs (seconds)."""

    benchmark: str
    round: str
    system: str
    gpus: int
    runs: int
    """Decomposed runs the medians are over."""
    step_s: float
    """Steady seconds per optimizer step."""
    eval_s: float
    """Seconds of one evaluation after the first."""
    first_eval_s: float
    """Seconds of the first evaluation."""
    one_off_s: float
    """Seconds inside the timed region that are neither steps nor evaluations (start-up, switches, stalls)."""
    samples_to_converge: float
    """Sequences trained at run_stop (gpt3: tokens / 2,048)."""
    source: str
    """The file the runs came from."""
    software: str = ""
    """The software release most of the row's runs ran (the terms file's `software` label, e.g. "NeMo 24.09")."""
    switch_step: int = 0
    """The optimizer step at which the runs change precision (LoRA FP4 healing to FP8), as their logs show it; 0 =
    no switch. step_s and eval_s are the steps and evaluations before it."""
    step_post_switch_s: float = 0.0
    """Steady seconds per step after the switch (0 without one)."""

    @property
    def key(self) -> tuple[str, str, str, int]:
        """(benchmark, round, system, GPUs): how a calibration row finds its terms."""
        return self.benchmark, self.round, self.system, self.gpus


def _number(value: str, column: str, where: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise TermsError(f"{where}: {column}={value!r} is not a number") from None
    if not math.isfinite(x):
        raise TermsError(f"{where}: {column}={value!r} is not finite")
    return x


def load_terms(paths: list[Path]) -> dict[tuple[str, str, str, int], MeasuredTerms]:
    """Each calibration row's MeasuredTerms from terms CSV files, keyed by `MeasuredTerms.key`."""
    runs: dict[tuple[str, str, str, int], list[dict[str, float]]] = {}
    sources: dict[tuple[str, str, str, int], str] = {}
    labels: dict[tuple[str, str, str, int], list[str]] = {}
    switches: dict[tuple[str, str, str, int], list[tuple[int, float]]] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TermsError(f"{path}: cannot read terms file ({exc})") from None
        reader = csv.DictReader(text.splitlines())
        missing = [c for c in (*_KEY_COLUMNS, "decomposed", *_NUMBERS) if c not in (reader.fieldnames or [])]
        if missing:
            raise TermsError(f"{path}: not a terms file, no column {', '.join(missing)}")
        for line, rec in enumerate(reader, start=2):
            where = f"{path} line {line}"
            if rec.get("decomposed") != "yes":
                continue  # a run without run_stop: the README lists them
            gpus = _number(rec["n_accel"], "n_accel", where)
            if gpus < 1 or gpus != int(gpus):
                raise TermsError(f"{where}: n_accel={rec['n_accel']!r} is not a GPU count")
            values = {c: _number(rec[c], c, where) for c in _NUMBERS}
            for c in ("step_s", "eval_s", "first_eval_s", "samples_to_converge"):
                if values[c] <= 0:
                    raise TermsError(f"{where}: {c}={rec[c]!r} must be > 0")
            key = (rec["benchmark"], rec["round"], rec["system"], int(gpus))
            runs.setdefault(key, []).append(values)
            sources.setdefault(key, str(path))
            labels.setdefault(key, []).append(rec.get("software") or "")
            switch = (rec.get("precision_switch_step") or "").strip()
            if switch:
                switches.setdefault(key, []).append(
                    (
                        int(_number(switch, "precision_switch_step", where)),
                        _number(rec.get("step_s_post_switch") or "nan", "step_s_post_switch", where),
                    )
                )

    def median(rs: list[dict[str, float]], column: str) -> float:
        return statistics.median(r[column] for r in rs)

    return {
        key: MeasuredTerms(
            benchmark=key[0],
            round=key[1],
            system=key[2],
            gpus=key[3],
            runs=len(rs),
            step_s=median(rs, "step_s"),
            eval_s=median(rs, "eval_s"),
            first_eval_s=median(rs, "first_eval_s"),
            one_off_s=median(rs, "one_off_s"),
            samples_to_converge=median(rs, "samples_to_converge"),
            source=sources[key],
            software=max(sorted(set(labels[key])), key=labels[key].count),
            switch_step=min(x for x, _ in switches[key]) if key in switches else 0,
            step_post_switch_s=statistics.median(y for _, y in switches[key]) if key in switches else 0.0,
        )
        for key, rs in runs.items()
    }


def bundled_terms() -> dict[tuple[str, str, str, int], MeasuredTerms]:
    """The terms shipped with scaletrain (sim/data/mlperf_terms/, one file per benchmark)."""
    folder = resources.files("scaletrain.sim") / "data" / "mlperf_terms"
    return load_terms(sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith("_terms.csv")))


def _relative(predicted: float, measured: float, floor: float = 0.0) -> float:
    return (predicted - measured) / max(abs(measured), floor)


def score_terms(rows, effs_for, terms: dict[tuple[str, str, str, int], MeasuredTerms]) -> list[dict]:
    """Predicted vs measured step, evaluation and one-off of every prepared calibration row (`calibrate.prepare`)
    that has terms; `effs_for(row)` gives the row's Efficiency (as `calibrate.score_rows` takes it)."""
    out = []
    for r in rows:
        m = terms.get((r.row.benchmark, r.row.round, r.row.system, r.row.gpus))
        if m is None:
            continue
        eff = effs_for(r)
        step, ev, _ = r.timing(eff, True)
        warm = r.one_off_s(eff)
        out.append(
            {
                "benchmark": r.row.benchmark,
                "round": r.row.round,
                "system": r.row.system,
                "gpus": r.row.gpus,
                "runs": m.runs,
                "step_s": {"predicted": step, "measured": m.step_s, "error": _relative(step, m.step_s)},
                "eval_s": {"predicted": ev, "measured": m.eval_s, "error": _relative(ev, m.eval_s)},
                "one_off_s": {
                    "predicted": warm,
                    "measured": m.one_off_s,
                    "error": _relative(warm, m.one_off_s, ONE_OFF_FLOOR_S),
                },
                "source": m.source,
            }
        )
    return out


def terms_summary(scored: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per benchmark (and "all"), per term: rows, mean signed error, mean |error| and max |error|, in %."""
    groups: dict[str, list[dict]] = {}
    for s in scored:
        groups.setdefault(s["benchmark"], []).append(s)
    if scored:
        groups["all"] = scored
    out: dict[str, dict[str, dict[str, float]]] = {}
    for bench, ss in groups.items():
        out[bench] = {}
        for term in ("step_s", "eval_s", "one_off_s"):
            errs = [s[term]["error"] for s in ss]
            out[bench][term] = {
                "rows": len(errs),
                "bias_pct": 100 * statistics.fmean(errs),
                "mape_pct": 100 * statistics.fmean(abs(e) for e in errs),
                "max_pct": 100 * max(abs(e) for e in errs),
            }
    return out
