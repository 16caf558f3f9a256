"""Published MLPerf Training results in the calibration CSV format (`sim/data/*.csv`).

Two layouts share one loader; the header decides which:

- gpt3 style: explicit `n_nodes, tp, pp, vp, mbs, fp8` columns (an optional `cp` column, else cp = 1).
- llama2_70b_lora style: a `parallelism` column such as ``"TP4 PP1 CP2, FP8"``; vp and mbs default to 1
  (or come from optional `vp`/`mbs` columns), and there is no node column.

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
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from scaletrain.benchmarks import BENCHMARKS

# Catalog keys (sim/hardware/gpus.toml). Longest first, so "gb200" wins over "b200" in "NVIDIA GB200".
GPU_KEYS = ("gb300", "gb200", "b200", "h200", "h100", "a100")
_GPU_RE = re.compile(r"(?<![a-z0-9])(" + "|".join(GPU_KEYS) + r")(?![0-9])")
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
CONVERGE_COLUMNS = ("run_tokens_to_converge", "run_samples_to_converge")
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


class _RowError(Exception):
    pass


def gpu_key(accelerator: str) -> str:
    """Catalog key for accelerator text ("NVIDIA H100-SXM5-80GB" -> "h100"); raises ValueError if unknown."""
    m = _GPU_RE.search(accelerator.lower())
    if not m:
        raise ValueError(f"unknown accelerator {accelerator!r} (known: {', '.join(sorted(GPU_KEYS))})")
    return m.group(1)


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


def _parse_row(row: dict, line: int, required: tuple[str, ...]) -> PublishedResult:
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
        gpu = gpu_key(row["accelerator"])
    except ValueError as exc:
        raise _RowError(str(exc)) from None
    gpus = _pos_int(row, "n_accel")
    gbs = _pos_int(row, "gbs")
    tp, pp, vp, cp, mbs, fp8 = _layout(row)
    nodes = (
        _pos_int(row, "n_nodes")
        if row.get("n_nodes")
        else (gpus // GPUS_PER_NODE if gpus % GPUS_PER_NODE == 0 else None)
    )
    n_runs = _pos_int(row, "n_runs")
    runs = tuple(_pos_float(t, "run_minutes") for t in _split(row["run_minutes"]))
    if len(runs) != n_runs:
        raise _RowError(f"run_minutes has {len(runs)} values but n_runs is {n_runs}")
    converge: tuple[int, ...] = ()
    for col in CONVERGE_COLUMNS:
        if row.get(col):
            parts = _split(row[col])
            if len(parts) != n_runs:
                raise _RowError(f"{col} has {len(parts)} values but n_runs is {n_runs}")
            converge = tuple(_pos_int({col: p}, col) for p in parts)
    scaling = row.get("scaling_factor") or "-"
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
        score_minutes=_pos_float(row["score_minutes"], "score_minutes"),
        run_converge=converge,
        source=row["source"],
        scaling_factor=1.0 if scaling == "-" else _pos_float(scaling, "scaling_factor"),
    )


def _read_source(path_or_text) -> tuple[str, str]:
    """(name for messages, text). A str with a newline, or naming no file but holding a comma, is CSV text."""
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str)
        and "\n" not in path_or_text
        and (os.path.exists(path_or_text) or "," not in path_or_text)
    ):
        path = Path(path_or_text)
        try:
            return str(path), path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ResultsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if isinstance(path_or_text, str):
        return "<text>", path_or_text
    raise TypeError(f"load_results wants a path or CSV text, got {type(path_or_text).__name__}")


def load_results(path_or_text, strict: bool = False) -> LoadReport:
    """Load a calibration CSV (path or text) into PublishedResult rows.

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
    layout = ("parallelism",) if "parallelism" in header else LAYOUT_COLUMNS
    required = COMMON_COLUMNS + layout
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
                    report.rows.append(_parse_row(dict(zip(header, fields_)), start, required))
                    continue
                except _RowError as exc:
                    reason = str(exc)
        if strict:
            raise ResultsError(f"{name} line {start}: {reason}")
        report.errors.append((start, reason))
    return report


@functools.cache
def _bundled(benchmark: str) -> tuple[PublishedResult, ...]:
    name = BENCHMARKS[benchmark].calibration_file
    if not name:  # a benchmark without published results to calibrate on
        return ()
    text = resources.files("scaletrain.sim").joinpath("data", name).read_text("utf-8")
    # Strict: the carried files are curated, so a bad row is a packaging bug, not data to skip.
    rows = load_results(text, strict=True).rows
    return tuple(r for r in rows if r.benchmark == benchmark)


def bundled_results(benchmark: str | None = None) -> list[PublishedResult]:
    """The calibration rows shipped in `scaletrain/sim/data/` (all benchmarks, or one)."""
    if benchmark is not None and benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    return [r for b in BENCHMARKS if benchmark in (None, b) for r in _bundled(b)]
