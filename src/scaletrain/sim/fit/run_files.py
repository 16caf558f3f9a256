"""A run directory's files read as untrusted data: metrics.jsonl, prediction.json and config.json.

`scaletrain report` and `scaletrain sim calibrate` read run directories that anyone may have copied, edited or
crafted. Every value they use is checked here for its type and range where it is read, so a bad directory ends in
one line naming the file (and line) and the field: never a traceback, a record silently skipped, or a NaN carried
into what they write. The JSON itself goes through `config_io.load_json_bounded` (a regular file, bounded size and
nesting). Torch-free.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from scaletrain.config_io import FileFormatError, load_json_bounded, loads_bounded, read_bytes_bounded
from scaletrain.sim.run_prediction import MEASURED_KEYS, PREDICTION_FILE

MAX_STEP_S = 1e6
"""Longest plausible time of one step, or of a part of it, in seconds (~11.6 days): beyond it a value is no
measurement (1e308 overflowed the means)."""
MAX_WORLD_SIZE = 1 << 20
"""Most ranks a run may record."""
METRICS_MAX_BYTES = 1 << 30
"""metrics.jsonl of a long run is ~300 bytes a step: a gigabyte is millions of steps."""
ROUNDING_S = 1e-6
"""other_s is the step time less the other parts (train/perf.py), so float rounding can leave it this far below 0."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds(value: Any, key: str, where: str, lo: float = 0.0, positive: bool = False) -> float:
    """`value` of field `key` as seconds: a finite number in [lo, MAX_STEP_S] (> 0 with `positive`);
    FileFormatError naming `where` and the field otherwise."""
    ok = _is_number(value) and math.isfinite(value) and (value > 0 if positive else value >= lo)
    if not ok or value > MAX_STEP_S:
        low = "(0" if positive else f"[{lo:g}"
        raise FileFormatError(f"{where}: {key}={value!r} must be a number of seconds in {low}, {MAX_STEP_S:g}]")
    return float(value)


def _count(value: Any, key: str, where: str, lo: int, hi: float) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FileFormatError(f"{where}: {key}={value!r} must be an integer in [{lo}, {hi:g}]")
    return value


def _check_record(record: Any, where: str) -> None:
    """The fields of one metrics.jsonl record that `report` and `sim calibrate` use, checked in place."""
    if not isinstance(record, dict):
        raise FileFormatError(f"{where}: not a JSON object")
    if "step" in record:
        _count(record["step"], "step", where, 0, 2**62)
    if "eval_loss" in record:
        kind = "eval_loss"
    elif "loss" in record or "step_time_s" in record:
        kind = "loss"
    else:
        return  # another kind of line (a checkpoint save's): nothing of it is read
    if "step" not in record and kind == "loss":
        raise FileFormatError(f"{where}: a training record without its step")
    if kind in record:  # a step record may lack its loss (a synthetic run's), never its tokens when it has one
        # A loss may be null (strict JSON writes a non-finite one so, train/metrics.py) or NaN: a diverged run.
        if record[kind] is not None and not _is_number(record[kind]):
            raise FileFormatError(f"{where}: {kind}={record[kind]!r} must be a number or null")
        tokens: Any = record.get("tokens")
        if not (_is_number(tokens) and math.isfinite(tokens) and 0 <= tokens <= 2**62):
            raise FileFormatError(f"{where}: tokens={tokens!r} must be a number in [0, 2**62]")
    if kind == "eval_loss":
        return
    if "step_time_s" in record:
        seconds(record["step_time_s"], "step_time_s", where, positive=True)
    for key in MEASURED_KEYS:
        if key in record:
            seconds(record[key], key, where, lo=-ROUNDING_S if key == "other_s" else 0.0)
    if "world_size" in record:
        _count(record["world_size"], "world_size", where, 1, MAX_WORLD_SIZE)
    if "gpu" in record and not isinstance(record["gpu"], str):
        raise FileFormatError(f"{where}: gpu={record['gpu']!r} must be a catalog GPU name")


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(training records: those with a loss or a step time, evaluation records: those with an eval_loss) of
    run_dir/metrics.jsonl, every field `report` and `sim calibrate` use checked (`_check_record`); other lines (a checkpoint save's {"step", "checkpoint_s"}) are in neither.

    FileNotFoundError when there is no metrics.jsonl; FileFormatError naming the file and line otherwise.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run directory?)")
    train: list[dict] = []
    evals: list[dict] = []
    for lineno, line in enumerate(read_bytes_bounded(path, METRICS_MAX_BYTES).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        record = loads_bounded(line, where)
        _check_record(record, where)
        if "eval_loss" in record:
            evals.append(record)
        elif "loss" in record or "step_time_s" in record:
            train.append(record)
    return train, evals


def read_prediction(run_dir: str | Path) -> dict | None:
    """prediction.json of a run directory (None where there is none), with the fields its readers use checked:
    step_time_s and the breakdown's seconds, "error" a string, "device" an object of strings where it names one.
    FileFormatError naming the file for anything else."""
    path = Path(run_dir) / PREDICTION_FILE
    if not path.exists():
        return None
    doc = load_json_bounded(path)
    where = str(path)
    if not isinstance(doc, dict):
        raise FileFormatError(f"{where}: not a JSON object")
    if "error" in doc and not isinstance(doc["error"], str):
        raise FileFormatError(f"{where}: error={doc['error']!r} must be a string")
    if doc.get("step_time_s") is not None:
        seconds(doc["step_time_s"], "step_time_s", where, positive=True)
    breakdown = doc.get("breakdown")
    if breakdown is not None:
        if not isinstance(breakdown, dict):
            raise FileFormatError(f"{where}: breakdown={breakdown!r} must be an object of seconds")
        for key in MEASURED_KEYS:
            if breakdown.get(key) is not None:
                seconds(breakdown[key], f"breakdown.{key}", where, lo=-ROUNDING_S if key == "other_s" else 0.0)
    device = doc.get("device")
    if device is not None:
        if not isinstance(device, dict):
            raise FileFormatError(f"{where}: device={device!r} must be an object")
        for key in ("kind", "name", "catalog_key"):
            if device.get(key) is not None and not isinstance(device[key], str):
                raise FileFormatError(f"{where}: device.{key}={device[key]!r} must be a string")
    return doc


def read_config_table(run_dir: str | Path) -> dict:
    """The table of run_dir/config.json (the resolved config the run wrote): FileNotFoundError when missing,
    FileFormatError naming it when it is not a JSON object of sections (bounded in size and nesting)."""
    path = Path(run_dir) / "config.json"
    table = load_json_bounded(path)
    if not isinstance(table, dict):
        raise FileFormatError(f"{path}: not a scaletrain config.json (a JSON object of sections)")
    return table
