"""Published MLPerf Training results in the calibration CSV format (`sim/data/*.csv`).

Two layouts share one loader; the header decides which:

- gpt3 style: explicit `n_nodes, tp, pp, vp, mbs, fp8` columns (an optional `cp` column, else cp = 1).
- llama2_70b_lora style: a `parallelism` column such as ``"TP4 PP1 CP2, FP8"``; vp and mbs default to 1
  (or come from optional `vp`/`mbs` columns), and there is no node column.

- v5 style (`mlperf_v5_*`, the MLPerf v5.0/v5.1 sets): explicit `tp, pp, vp, cp, mbs, fp8, fp4` columns from the
  submitters' launch configs where an empty field means unknown; `score_minutes` is the olympic mean of the runs
  (what the machine did) and `official_score_minutes` the published score (x the RCP `scaling_factor`); a run that
  did not converge is marked with its status ("(no_stop)") and counts as the slowest, dropped, run.

Unknown layout fields (v5 style): pp, vp and mbs default to 1 (no llama2_70b_lora submission at <= 72 GPUs
pipelines, and the NeMo/AMD recipes use micro-batch 1) and fp8 to true (every submission whose config was matched
trains in FP8 or FP4); the row's `assumed` names the defaulted fields. Without tp or cp the layout is a guess that
would steer the fit, so such rows are skipped (`LoadReport.unknown_layout`; never an error under `strict`).

When a row gives no node count, nodes = gpus / 8: every system in the calibration files is an 8-GPU
HGX/DGX node (None if gpus is not a multiple of 8). Layout divisibility is deliberately not checked here:
the simulator owns that rule. Stdlib only, like the rest of `scaletrain.sim`.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from scaletrain.benchmarks import BENCHMARKS
from scaletrain.sim.catalog import Catalog, default_catalog

_ROUND_RE = re.compile(r"^v?(\d+)\.(\d+)$")
_PAR_RE = re.compile(r"^TP(\d+)\s+PP(\d+)(?:\s+CP(\d+))?(?:\s+VP(\d+))?\s*(?:,\s*(FP8|BF16))?$", re.IGNORECASE)

COMMON_COLUMNS = (
    "benchmark",
    "round",
    "submitter",
    "system",
    "accelerator",
    "n_accel",
    "gbs",
    "n_runs",
    "run_minutes",
    "score_minutes",
    "source",
)
LAYOUT_COLUMNS = ("tp", "pp", "vp", "mbs", "fp8")  # gpt3 style; llama style needs `parallelism` instead
V5_COLUMNS = ("tp", "pp", "vp", "cp", "mbs", "fp8", "fp4", "official_score_minutes")  # with run_samples_or_tokens...
CONVERGE_COLUMNS = ("run_tokens_to_converge", "run_samples_to_converge", "run_samples_or_tokens_to_converge")
V5_DEFAULTS = {"pp": 1, "vp": 1, "mbs": 1, "fp8": True}
"""What an empty (unknown) v5 layout field is taken to be; tp and cp have no default (the row is skipped)."""
GPUS_PER_NODE = 8


class ResultsError(ValueError):
    """A results file (or, under strict loading, one of its rows) cannot be used; the message names where."""


@dataclass(frozen=True)
class PublishedResult:
    """One published result: system, parallel layout and per-run times / convergence."""

    line: int
    """1-based line in the file (header = line 1), for error messages."""
    benchmark: str
    round: str
    """Normalised "vX.Y"."""
    submitter: str
    system: str
    gpu: str
    """Catalog key derived from `accelerator`."""
    accelerator: str
    gpus: int
    nodes: int | None
    interconnect: str
    gbs: int
    tp: int
    pp: int
    vp: int
    cp: int
    mbs: int
    fp8: bool
    run_minutes: tuple[float, ...]
    score_minutes: float
    run_converge: tuple[int, ...]
    """Tokens (gpt3) or samples (lora) to converge, per run; empty when the file does not say."""
    source: str
    scaling_factor: float = 1.0
    """RCP normalisation the published score carries (lora `scaling_factor` column; "-" = 1)."""
    file: str = ""
    """The CSV file it was read from, for messages ("" for the shipped calibration rows)."""
    fp4: bool = False
    """FP4 GEMMs where FP8 would apply (v5.1 NVFP4 submissions; fp8 is then true too: the rest is the FP8 recipe)."""
    assumed: tuple[str, ...] = ()
    """Layout fields the file left empty that got their documented default (`V5_DEFAULTS`)."""

    @property
    def olympic_minutes(self) -> float:
        """Olympic mean of the run times: wall clock before any RCP normalisation."""
        from scaletrain.sim.mlperf import olympic_mean  # local: mlperf is the scoring authority

        return olympic_mean(self.run_minutes)

    @property
    def dp(self) -> int:
        """Data-parallel size implied by the layout (floor; divisibility is the simulator's check)."""
        return self.gpus // (self.tp * self.pp * self.cp)


@dataclass
class LoadReport:
    """Rows that loaded, and (line, reason) for each row that was skipped."""

    rows: list[PublishedResult] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    unknown_layout: list[tuple[int, str]] = field(default_factory=list)
    """(line, reason) of rows skipped because the file does not know their layout (also in `errors`)."""


class _RowError(Exception):
    pass


class _UnknownLayout(_RowError):
    """The row is well formed but its layout is not known: skipped, never a strict-mode error."""


def gpu_key(accelerator: str, cat: Catalog | None = None) -> str:
    """Catalog key for accelerator text ("NVIDIA H100-SXM5-80GB" -> "h100"), by the catalog's name patterns
    (`Catalog.gpu_for_device`; default: the shipped catalog); raises ValueError if unknown."""
    cat = cat or default_catalog()
    gpu = cat.gpu_for_device(accelerator)
    if gpu is None:
        raise ValueError(f"unknown accelerator {accelerator!r} (known: {', '.join(sorted(cat.gpus))})")
    return gpu.key


def _pos_int(row: dict, col: str) -> int:
    text = row[col]
    try:
        value = int(text)
    except ValueError:
        raise _RowError(f"{col} {text!r} is not an integer") from None
    if value <= 0:
        raise _RowError(f"{col} must be positive, got {value}")
    return value


def _pos_float(text: str, col: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _RowError(f"{col} {text!r} is not a number") from None
    if not value > 0 or value == float("inf"):  # also rejects nan
        raise _RowError(f"{col} must be a positive finite number, got {text!r}")
    return value


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(";")]


def _v5_layout(row: dict) -> tuple[int, int, int, int, int, bool, bool, tuple[str, ...]]:
    """(tp, pp, vp, cp, mbs, fp8, fp4, assumed) from v5 columns, where empty (or "null": the llama31_8b file writes
    the vp of unpipelined configs so) means unknown."""
    row = {k: "" if k in ("tp", "pp", "vp", "cp", "mbs", "fp8", "fp4") and v == "null" else v for k, v in row.items()}
    unknown = [c for c in ("tp", "cp") if not row.get(c)]
    if unknown:
        raise _UnknownLayout(f"layout unknown ({', '.join(unknown)} empty: no submitter config matched)")
    assumed = tuple(c for c in V5_DEFAULTS if not row.get(c) and not (c == "vp" and row.get("pp") == "1"))
    ints = {c: _pos_int(row, c) if row.get(c) else int(V5_DEFAULTS.get(c, 1)) for c in ("tp", "pp", "vp", "cp", "mbs")}
    flags = {}
    for c in ("fp8", "fp4"):
        text = (row.get(c) or "").lower()
        if text not in ("", "true", "false"):
            raise _RowError(f"{c} {row[c]!r} is not True/False/empty")
        flags[c] = text == "true"
    fp8 = flags["fp8"] or flags["fp4"] or "fp8" in assumed
    return ints["tp"], ints["pp"], ints["vp"], ints["cp"], ints["mbs"], fp8, flags["fp4"], assumed


def _run_minutes(text: str) -> float:
    """One run's minutes; a run marked with a status ("(no_stop)") did not converge: inf, the dropped slowest."""
    if text.startswith("(") and text.endswith(")"):
        return float("inf")
    return _pos_float(text, "run_minutes")


def _layout(row: dict) -> tuple[int, int, int, int, int, bool]:
    """(tp, pp, vp, cp, mbs, fp8) from explicit columns or the `parallelism` text."""
    if "parallelism" in row and row["parallelism"] is not None:
        m = _PAR_RE.match(row["parallelism"].strip())
        if not m:
            raise _RowError(f"parallelism {row['parallelism']!r} is not like 'TP4 PP1 CP2, FP8'")
        tp, pp, cp, vp = (int(g) if g else 1 for g in m.group(1, 2, 3, 4))
        if min(tp, pp, cp, vp) <= 0:
            raise _RowError(f"parallelism {row['parallelism']!r} has a zero degree")
        fp8 = (m.group(5) or "").upper() == "FP8"
        mbs = _pos_int(row, "mbs") if row.get("mbs") else 1
        vp = _pos_int(row, "vp") if row.get("vp") else vp
        return tp, pp, vp, cp, mbs, fp8
    fp8_text = row["fp8"].strip().lower()
    if fp8_text not in ("yes", "no"):
        raise _RowError(f"fp8 {row['fp8']!r} is not yes/no")
    cp = _pos_int(row, "cp") if row.get("cp") else 1
    return (_pos_int(row, "tp"), _pos_int(row, "pp"), _pos_int(row, "vp"), cp, _pos_int(row, "mbs"), fp8_text == "yes")


def _parse_row(row: dict, line: int, required: tuple[str, ...], cat: Catalog | None) -> PublishedResult:
    for col in required:
        if not (row.get(col) or "").strip():
            raise _RowError(f"empty required field {col!r}")
    row = {k: (v.strip() if isinstance(v, str) else v) for k, v in row.items()}
    benchmark = row["benchmark"]
    if benchmark not in BENCHMARKS:
        raise _RowError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    m = _ROUND_RE.match(row["round"])
    if not m:
        raise _RowError(f"round {row['round']!r} is not like '4.1' or 'v4.1'")
    try:
        gpu = gpu_key(row["accelerator"], cat)
    except ValueError as exc:
        raise _RowError(str(exc)) from None
    gpus = _pos_int(row, "n_accel")
    gbs = _pos_int(row, "gbs")
    fp4 = False
    assumed: tuple[str, ...] = ()
    if "official_score_minutes" in row:
        tp, pp, vp, cp, mbs, fp8, fp4, assumed = _v5_layout(row)
    else:
        tp, pp, vp, cp, mbs, fp8 = _layout(row)
    nodes = (
        _pos_int(row, "n_nodes")
        if row.get("n_nodes")
        else (gpus // GPUS_PER_NODE if gpus % GPUS_PER_NODE == 0 else None)
    )
    n_runs = _pos_int(row, "n_runs")
    runs = tuple(_run_minutes(t) for t in _split(row["run_minutes"]))
    if len(runs) != n_runs:
        raise _RowError(f"run_minutes has {len(runs)} values but n_runs is {n_runs}")
    if sum(r == float("inf") for r in runs) > 1:
        raise _RowError("more than one run did not converge: no olympic mean")
    converge: tuple[int, ...] = ()
    for col in CONVERGE_COLUMNS:
        if row.get(col):
            parts = _split(row[col])
            if len(parts) != n_runs:
                raise _RowError(f"{col} has {len(parts)} values but n_runs is {n_runs}")
            # A run that did not converge has no count (0 here; its minutes are inf).
            converge = tuple(0 if m == float("inf") else _pos_int({col: p}, col) for p, m in zip(parts, runs))
    scaling = row.get("scaling_factor") or "-"
    score = row["official_score_minutes"] if "official_score_minutes" in row else row["score_minutes"]
    return PublishedResult(
        line=line,
        benchmark=benchmark,
        round=f"v{m.group(1)}.{m.group(2)}",
        submitter=row["submitter"],
        system=row["system"],
        gpu=gpu,
        accelerator=row["accelerator"],
        gpus=gpus,
        nodes=nodes,
        interconnect=row.get("interconnect") or "",
        gbs=gbs,
        tp=tp,
        pp=pp,
        vp=vp,
        cp=cp,
        mbs=mbs,
        fp8=fp8,
        run_minutes=runs,
        score_minutes=_pos_float(score, "score_minutes"),
        run_converge=converge,
        source=row["source"],
        scaling_factor=1.0 if scaling == "-" else _pos_float(scaling, "scaling_factor"),
        fp4=fp4,
        assumed=assumed,
    )


def _read_source(path_or_text) -> tuple[str, str]:
    """(name for messages, text). A str with a newline, or naming no file but holding a comma, is CSV text."""
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str)
        and "\n" not in path_or_text
        and (os.path.exists(path_or_text) or "," not in path_or_text)
    ):
        path = Path(path_or_text)
        if path.exists() and not path.is_file():  # a directory fails to open; a FIFO would block
            raise ResultsError(f"{path}: cannot read (not a regular file)")
        try:
            return str(path), path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ResultsError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ResultsError(f"{path}: cannot read (not a UTF-8 text file: byte {exc.start})") from None
    if isinstance(path_or_text, str):
        return "<text>", path_or_text
    raise TypeError(f"load_results wants a path or CSV text, got {type(path_or_text).__name__}")


def load_results(path_or_text, strict: bool = False, catalog: Catalog | None = None) -> LoadReport:
    """Load a calibration CSV (path or text) into PublishedResult rows, naming each row's GPU by `catalog`'s name
    patterns (default: the shipped catalog).

    Missing required columns fail the whole file (ResultsError naming file and columns). A bad row is
    skipped and recorded in `errors` as (line, reason); with `strict` the first one raises
    ResultsError("FILE line N: reason") instead.
    """
    name, text = _read_source(path_or_text)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise ResultsError(f"{name}: empty file, no header") from None
    except csv.Error as exc:
        raise ResultsError(f"{name} line 1: {exc}") from None
    if "parallelism" in header:
        layout: tuple[str, ...] = ("parallelism",)
    elif "official_score_minutes" in header:
        layout = V5_COLUMNS + ("run_samples_or_tokens_to_converge",)
    else:
        layout = LAYOUT_COLUMNS
    required = COMMON_COLUMNS + layout
    # v5 layout fields may be empty (unknown); everywhere else every required field must be filled.
    nonempty = COMMON_COLUMNS + (("official_score_minutes",) if "official_score_minutes" in layout else layout)
    missing = [c for c in required if c not in header]
    if missing:
        hint = " (or a 'parallelism' column for the layout)" if set(missing) & set(LAYOUT_COLUMNS) else ""
        raise ResultsError(f"{name}: missing required column(s) {', '.join(missing)}{hint}")

    report = LoadReport()
    prev_end = reader.line_num
    while True:
        start = prev_end + 1  # a quoted field may span lines: report where the record starts
        try:
            fields_ = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            fields_, reason = None, f"unreadable CSV ({exc})"
        prev_end = reader.line_num
        if fields_ is not None:
            if not fields_ or all(not f.strip() for f in fields_):
                continue  # blank line
            if len(fields_) != len(header):
                reason = f"expected {len(header)} fields, got {len(fields_)}"
            else:
                try:
                    report.rows.append(_parse_row(dict(zip(header, fields_)), start, nonempty, catalog))
                    continue
                except _UnknownLayout as exc:
                    report.unknown_layout.append((start, str(exc)))
                    report.errors.append((start, str(exc)))
                    continue
                except _RowError as exc:
                    reason = str(exc)
        if strict:
            raise ResultsError(f"{name} line {start}: {reason}")
        report.errors.append((start, reason))
    return report


@functools.cache
def _bundled(benchmark: str) -> tuple[tuple[PublishedResult, ...], tuple[tuple[str, str], ...]]:
    """(rows, (where, why) of rows skipped for an unknown layout) of the files carried for `benchmark`."""
    spec = BENCHMARKS[benchmark]
    rows: list[PublishedResult] = []
    skipped: list[tuple[str, str]] = []
    for i, name in enumerate(n for n in (spec.calibration_file, *spec.extra_calibration_files) if n):
        text = resources.files("scaletrain.sim").joinpath("data", name).read_text("utf-8")
        # Strict: the carried files are curated, so a bad row is a packaging bug, not data to skip. Rows whose
        # layout the file does not know are the exception: they stay in the file as published, and are counted.
        report = load_results(text, strict=True)
        where = f"scaletrain/sim/data/{name}" if i else ""
        rows += [replace(r, file=where) if where else r for r in report.rows if r.benchmark == benchmark]
        skipped += [(f"{where or name} line {line}", why) for line, why in report.unknown_layout]
    return tuple(rows), tuple(skipped)


def bundled_results(benchmark: str | None = None) -> list[PublishedResult]:
    """The calibration rows shipped in `scaletrain/sim/data/` (all benchmarks, or one)."""
    if benchmark is not None and benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    return [r for b in BENCHMARKS if benchmark in (None, b) for r in _bundled(b)[0]]


def bundled_skipped(benchmark: str | None = None) -> list[tuple[str, str]]:
    """(where, why) of the shipped rows left out because their layout is unknown (see the module docstring)."""
    return [w for b in BENCHMARKS if benchmark in (None, b) for w in _bundled(b)[1]]
