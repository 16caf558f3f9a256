"""MLPerf Training convergence and scoring arithmetic: RCP tables, evaluation cadence, olympic means.

Turns "how many tokens/samples until the target" into steps and evaluations, which the step-time model
then turns into time-to-train. Rules per `docs/benchmarks.md`:

- gpt3: evaluate every 24,576 sequences (ceil(24576/GBS) steps); every evaluation covers the whole
  11,590,004-token validation subset (inferred count); converge unit = training tokens.
- llama2_70b_lora: evaluate every 384 sequences (ceil(384/GBS) steps) and skip the first
  floor(0.125*GBS + 2) evaluations. Skipped means not run at all (NVIDIA's NeMo configs set
  SKIP_EVALS=3 at GBS 8): evaluation k happens after k intervals, the first timed one is k = skip+1, so a
  run cannot stop before (skip+1) intervals and runs (intervals - skip) evaluations. Eval set 173 samples
  packed to 8192 tokens; converge unit = training samples.
- llama31_405b / llama31_8b: evaluate every 18,432 / 12,288 sequences over 5,760 / 1,024 sequences of 8192
  tokens, none skipped; converge unit = training samples; RCPs of their own rulesets (`rcp_version`).

Each benchmark's constants are its `scaletrain.benchmarks` entry. RCP (reference convergence point) tables
are read from the installed `mlperf-logging` package's JSON files without importing its checker (which pulls
numpy); `data/rcps_<version>.csv` are verbatim copies of the relevant fields (as CSV, with their source) for when
the package is absent or lacks the version. Which table a benchmark uses is `rcp_version`. Stdlib only.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import io
import json
import math
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from scaletrain import benchmarks
from scaletrain.benchmarks import BENCHMARKS, DEFAULT_RULESET, BenchmarkSpec

DEFAULT_RCP_VERSION = DEFAULT_RULESET
"""The RCP table gpt3 and llama2_70b_lora are predicted (and their efficiencies were fitted) with."""
# A converge value this many times the record's median is a data-entry error, not a slow run: gpt3 4.1.0
# BS 3072 lists 13,790,871,552 tokens (10x its siblings). The checker keeps it (its olympic mean drops it as
# the max but then drops one real value too); we drop it first, so BS 3072 means 1,207,959,552.
RCP_TYPO_FACTOR = 5


def bench(benchmark: str) -> BenchmarkSpec:
    """The registry entry of an official benchmark name; ValueError naming the known ones otherwise."""
    try:
        return BENCHMARKS[benchmark]
    except KeyError:
        raise ValueError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})") from None


def _check_gbs(gbs) -> int:
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs <= 0:
        raise ValueError(f"gbs must be a positive integer, got {gbs!r}")
    return gbs


def eval_interval_steps(benchmark: str, gbs: int) -> int:
    """Training steps between evaluations: ceil(sequences-per-eval / GBS)."""
    return -(-bench(benchmark).eval_every_sequences // _check_gbs(gbs))


def skipped_evals(benchmark: str, gbs: int) -> int:
    """Evaluations not run at the start of a run: floor(0.125*GBS + 2) for llama2_70b_lora, 0 for gpt3."""
    _check_gbs(gbs)
    return bench(benchmark).skipped_evals(gbs)


# ---------------------------------------------------------------- RCP tables
def _carried_versions(benchmark: str) -> list[str]:
    """Versions of the RCP tables carried in sim/data/ that hold `benchmark`, oldest first."""
    folder = resources.files("scaletrain.sim").joinpath("data")
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.startswith("rcps_") and name.endswith(".csv"):
            rows = csv.DictReader(io.StringIO(entry.read_text("utf-8")))
            if any(row["benchmark"] == benchmark for row in rows):
                found.append(name.removeprefix("rcps_").removesuffix(".csv"))
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


@functools.cache
def rcp_version(benchmark: str) -> str:
    """The RCP table version the simulator predicts `benchmark`'s convergence with.

    DEFAULT_RCP_VERSION (4.1.0) where that table has the benchmark: gpt3 was retired after it, and the shipped
    gpt3/llama2_70b_lora efficiencies were fitted with it. Otherwise the benchmark's own ruleset
    (`benchmarks.resolve_ruleset`: the newest the installed mlperf-logging ships for it, 6.0.0 for llama31_405b,
    6.1.0 for llama31_8b), else, without the package, the newest carried copy that has it.
    """
    name = bench(benchmark).name
    if _package_rcp_file(name, DEFAULT_RCP_VERSION) or DEFAULT_RCP_VERSION in _carried_versions(name):
        return DEFAULT_RCP_VERSION
    try:
        return benchmarks.resolve_ruleset(name)
    except ValueError:
        carried = _carried_versions(name)
        if not carried:
            raise ValueError(f"no RCP table for {name}: mlperf-logging lacks it and scaletrain carries none") from None
        return carried[-1]


def _package_rcp_file(benchmark: str, version: str) -> Path | None:
    # find_spec on a top-level name locates it without executing mlperf_logging/__init__ or the checker.
    spec = importlib.util.find_spec("mlperf_logging")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "rcp_checker" / f"training_{version}" / f"rcps_{benchmark}.json"
        if path.is_file():
            return path
    return None


def _load_rcp_raw(benchmark: str, version: str, use_package: bool = True) -> tuple[dict, str]:
    """(raw records as in the checker's JSON, where they came from): the package, else the bundled copy."""
    path = _package_rcp_file(benchmark, version) if use_package else None
    if path is not None:
        return json.loads(path.read_text(encoding="utf-8")), str(path)
    # The copy is CSV (benchmark,record,bs,converge,source) so the package-data glob sim/data/*.csv ships it.
    fallback = resources.files("scaletrain.sim").joinpath("data", f"rcps_{version}.csv")
    if not fallback.is_file() or version not in _carried_versions(benchmark):
        raise ValueError(
            f"no RCP table for {benchmark} version {version}: mlperf-logging lacks it and scaletrain carries "
            f"only {', '.join(_carried_versions(benchmark)) or 'none'}"
        )
    key = bench(benchmark).rcp_key
    raw = {
        row["record"]: {
            "Benchmark": row["benchmark"],
            "BS": int(row["bs"]),
            key: [int(v) for v in row["converge"].split(";")],
        }
        for row in csv.DictReader(io.StringIO(fallback.read_text("utf-8")))
        if row["benchmark"] == benchmark
    }
    return raw, f"scaletrain/sim/data/{fallback.name}"


def rcp_records(benchmark: str, version: str | None = None) -> dict[int, tuple[int, ...]]:
    """BS -> sorted converge values (tokens or samples) of the RCP table (`rcp_version` when None), typos (> 5x
    median) dropped."""
    return dict(_rcp_records(bench(benchmark).name, version or rcp_version(benchmark)))


@functools.cache
def _rcp_records(benchmark: str, version: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
    b = bench(benchmark)
    raw, _ = _load_rcp_raw(benchmark, version)
    out: dict[int, tuple[int, ...]] = {}
    for rec in raw.values():
        if rec.get("Benchmark") != benchmark:
            continue
        values = rec[b.rcp_key]
        median = statistics.median(values)
        out[int(rec["BS"])] = tuple(sorted(v for v in values if v <= RCP_TYPO_FACTOR * median))
    if not out:
        raise ValueError(f"RCP table for {benchmark} version {version} has no records")
    return tuple(sorted(out.items()))


def olympic_mean(values) -> float:
    """Mean after dropping one lowest and one highest value (MLPerf scoring and RCP means; needs >= 3)."""
    vals = sorted(float(v) for v in values)
    if len(vals) < 3:
        raise ValueError(f"olympic mean needs at least 3 values, got {len(vals)}")
    return math.fsum(vals[1:-1]) / (len(vals) - 2)


def _interp(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@functools.cache
def _rcp_means(benchmark: str, version: str, pruned: bool) -> tuple[tuple[int, float], ...]:
    means = [(bs, olympic_mean(v)) for bs, v in _rcp_records(benchmark, version)]
    if not pruned:
        return tuple(means)
    # The checker's _prune_rcps: drop every BS below the fastest-converging one, then drop any point that
    # converges slower than the line between its (surviving) neighbours.
    fastest = min(means, key=lambda bm: bm[1])[0]
    pts = [bm for bm in means if bm[0] >= fastest]
    i = 1
    while i < len(pts) - 1:
        (b0, m0), (b1, m1), (b2, m2) = pts[i - 1], pts[i], pts[i + 1]
        if m1 > _interp(b1, b0, m0, b2, m2):
            del pts[i]
            i -= 1
        i += 1
    return tuple(pts)


def rcp_mean(benchmark: str, gbs: int, version: str | None = None, pruned: bool = False) -> float:
    """Reference tokens (gpt3) or samples (lora, llama31) to converge at a global batch size (RCP table `version`,
    default `rcp_version`).

    Olympic mean of each RCP record, as mlperf_logging's rcp_checker computes it; between records it
    interpolates linearly, below the smallest BS it uses the smallest record (the checker's
    `_find_min_rcp`), above the largest it raises (the checker asks for a new RCP). `pruned=True` uses the
    checker's pruned record set (what it judges submissions against); the default keeps every record,
    because a record measured at a BS is the best estimate of how a run at that BS converges.
    """
    _check_gbs(gbs)
    version = version or rcp_version(benchmark)
    pts = _rcp_means(bench(benchmark).name, version, pruned)
    if gbs <= pts[0][0]:
        return pts[0][1]
    for (b0, m0), (b1, m1) in zip(pts, pts[1:]):
        if gbs == b1:
            return m1
        if b0 < gbs < b1:
            return _interp(gbs, b0, m0, b1, m1)
    raise ValueError(
        f"{benchmark} gbs {gbs} is above the largest RCP batch size {pts[-1][0]} "
        f"(version {version}); no reference convergence to extrapolate from"
    )


def rcp_score_factor(benchmark: str, gbs: int, run_converge, version: str | None = None) -> float:
    """Score normalisation the checker applies: RCP mean / olympic mean of the runs' converge, if > 1.

    A submission converging faster than the reference has its score scaled up (the published
    `scaling_factor`); slower ones keep factor 1. Uses the pruned records, like the checker.
    """
    factor = rcp_mean(benchmark, gbs, version, pruned=True) / olympic_mean(run_converge)
    return max(1.0, factor)


# ---------------------------------------------------------------- convergence
@dataclass(frozen=True)
class Convergence:
    """Where a run stops: steps and timed evaluations."""

    steps: int
    """Training steps until the converging evaluation."""
    evals: int
    """Evaluations actually run (timed)."""
    eval_interval_steps: int
    train_sequences: int
    """steps * gbs."""
    eval_tokens: int
    """Tokens per evaluation pass."""


def convergence(benchmark: str, gbs: int, converge: float | None = None, version: str | None = None) -> Convergence:
    """Steps and evaluations for a run that needs `converge` tokens (gpt3) or samples (lora).

    `converge=None` uses the RCP mean at `gbs`. Steps are rounded up to whole evaluation intervals: a
    run can only stop at an evaluation, and (lora) not before the first evaluation that is not skipped.
    """
    b = bench(benchmark)
    _check_gbs(gbs)
    if converge is None:
        converge = rcp_mean(benchmark, gbs, version)
    if not (isinstance(converge, (int, float)) and 0 < converge < math.inf):
        raise ValueError(f"converge must be a positive number of {b.converge_unit}, got {converge!r}")
    per_step = gbs * b.seq_len if b.converge_unit == "tokens" else gbs
    # Integer ceil when exact: 1207959552 / (2048*2048) must give 288, not 289 from float noise.
    if float(converge).is_integer():
        raw_steps = -(-int(converge) // per_step)
    else:
        raw_steps = math.ceil(converge / per_step)
    interval = eval_interval_steps(benchmark, gbs)
    skip = skipped_evals(benchmark, gbs)
    intervals = max(-(-raw_steps // interval), skip + 1)
    steps = intervals * interval
    return Convergence(
        steps=steps,
        evals=intervals - skip,
        eval_interval_steps=interval,
        train_sequences=steps * gbs,
        eval_tokens=b.eval_tokens,
    )


@dataclass(frozen=True)
class PrecisionSplit:
    """A run's training steps and timed evaluations either side of an FP4 run's precision switch (`healing_split`);
    fractional where the run is an expectation over runs."""

    steps_fp4: float
    """Steps up to and including the healing step, at the FP4 step time."""
    steps_fp8: float
    """Steps after it, at the FP8 step time."""
    evals_fp4: float
    """Evaluations that follow a step at or before the healing step."""
    evals_fp8: float
    """Evaluations after it."""


def healing_split(
    steps: float, evals: float, healing_step: int, eval_interval: int, skipped: int = 0
) -> PrecisionSplit:
    """Split a run of `steps` steps and `evals` timed evaluations at `healing_step` (0 = no switch: all FP4).

    Steps 1..healing_step run in FP4 and the rest in FP8, as the published FP4 recipes switch (HEALING_ITER) and as
    `sim/data/mlperf_terms` counts them (steps_post_switch = steps - precision_switch_step). Timed evaluation k
    (1-based) follows step (skipped + k) * eval_interval, the `skipped` first evaluations not being run, and runs in
    the precision of the step before it. The one-off cost of the switch itself is not part of this split.
    """
    if isinstance(healing_step, bool) or not isinstance(healing_step, int) or healing_step < 0:
        raise ValueError(f"healing_step must be a whole number of steps >= 0, got {healing_step!r}")
    if eval_interval < 1 or skipped < 0 or not (steps >= 0 and evals >= 0):
        raise ValueError(
            f"need steps, evals, skipped >= 0 and eval_interval >= 1, got {steps}, {evals}, {skipped}, {eval_interval}"
        )
    if healing_step == 0 or steps <= healing_step:
        return PrecisionSplit(steps_fp4=steps, steps_fp8=0.0, evals_fp4=evals, evals_fp8=0.0)
    evals_fp4 = min(evals, max(0, healing_step // eval_interval - skipped))
    return PrecisionSplit(
        steps_fp4=healing_step, steps_fp8=steps - healing_step, evals_fp4=evals_fp4, evals_fp8=evals - evals_fp4
    )


def score(benchmark: str, run_minutes) -> float:
    """Submission score in minutes: olympic mean of exactly `runs` run times (gpt3 3 = median, lora 10).

    At most one run may fail to converge; pass it as inf (or None): it counts as the slowest, so it is
    the one dropped. RCP normalisation is separate (`rcp_score_factor`).
    """
    b = bench(benchmark)
    vals = [math.inf if v is None else float(v) for v in run_minutes]
    if len(vals) != b.runs:
        raise ValueError(f"{benchmark} is scored on {b.runs} runs, got {len(vals)}")
    if any(not v > 0 for v in vals):  # also catches nan
        raise ValueError(f"run times must be positive, got {vals}")
    if sum(math.isinf(v) for v in vals) > 1:
        raise ValueError("at most one run may fail to converge")
    return olympic_mean(vals)
