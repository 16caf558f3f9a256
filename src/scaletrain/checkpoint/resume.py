"""What a resume needs besides the tensors: the MLLOG up to the checkpoint, and a word when settings changed.

A checkpoint records the byte length of the run's MLLOG when it was taken (`harness.mllog_bytes` in
trainer.json). Resuming continues that log: events after the checkpoint (the part of the run that crashed) are
dropped, and the run keeps its single run_start. Resumed in place, the run directory's own log is cut back; resumed
into another run directory, the log is copied from the run that wrote the checkpoint (the directory above its
`checkpoints/`, else the run_dir its config names); a log counts as the run's when its first `mllog_bytes` hold
the run_start stamped with the checkpoint's `t_start`. A log of another run in the run directory is never
overwritten (one-line error). When no log is found, the new log starts with a comment line saying so and the
compliance checker rejects it (no run_start): the run's result stands, its log is not a complete MLPerf log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scaletrain.checkpoint.store import CheckpointError

MLLOG = "mllog.txt"
_MARK = "# scaletrain: resumed from "
# Settings a resumed run may change but that make it a different experiment from the one saved.
_WATCHED = (("train", "global_batch_size"), ("train", "seed"), ("train", "dtype"))


def _warn(message: str) -> None:
    print(f"scaletrain: warning: {message}", file=sys.stderr, flush=True)


def warn_changed_settings(path: Path, info: dict, cfg) -> list[str]:
    """One warning line naming every watched setting that differs from the checkpoint's config; the changes."""
    saved = info.get("config", {})
    changes = []
    for section, name in _WATCHED:
        before = saved.get(section, {}).get(name) if isinstance(saved.get(section), dict) else None
        now = getattr(getattr(cfg, section), name)
        if before is not None and before != now:
            changes.append(f"{section}.{name} {before} -> {now}")
    if changes:
        _warn(f"resuming {path} with changed settings: {', '.join(changes)}")
    return changes


def _source_logs(log_path: Path, checkpoint: Path | None, info: dict) -> list[Path]:
    """Where the checkpoint's run may have logged: this run directory, the one above checkpoints/, config's."""
    out = [log_path]
    if checkpoint is not None and Path(checkpoint).parent.name == "checkpoints":
        out.append(Path(checkpoint).parent.parent / MLLOG)
    train = (info.get("config") or {}).get("train")
    run_dir = train.get("run_dir") if isinstance(train, dict) else None
    if isinstance(run_dir, str) and run_dir:
        out.append(Path(run_dir) / MLLOG)
    return out


def _is_log_of(path: Path, size: int, t_start: int) -> bool:
    """Whether the first `size` bytes of `path` are a log whose run_start is stamped `t_start` (the saved run's)."""
    import json

    from scaletrain.bench.mllog import TOKEN

    if not path.is_file() or path.stat().st_size < size:
        return False
    with open(path, "rb") as f:
        head = f.read(size).decode("utf-8", errors="replace")
    if head.startswith(_MARK):  # a log this module started without its beginning: the run continues it
        return True
    for line in head.splitlines():
        at = line.find(TOKEN)
        if at >= 0 and '"run_start"' in line:
            try:
                event = json.loads(line[at + len(TOKEN) :])
            except ValueError:
                return False
            return event.get("key") == "run_start" and event.get("time_ms") == t_start
    return False


def restore_mllog(log_path: Path, checkpoint: Path | None, info: dict) -> None:
    """Make `log_path` the MLLOG of the checkpoint's run up to the checkpoint (see the module docstring).

    `info` is the checkpoint's validated trainer.json. A log already in the run directory that belongs to another
    run is never overwritten: that is a one-line CheckpointError.
    """
    log_path = Path(log_path)
    harness = info["harness"]
    size, t_start = int(harness["mllog_bytes"]), int(harness["t_start"])
    candidates = _source_logs(log_path, checkpoint, info)
    if log_path.exists() and not _is_log_of(log_path, size, t_start):
        raise CheckpointError(
            f"{log_path}: not the MLLOG of the run that saved {checkpoint} (no run_start at "
            f"time_ms {t_start} in its first {size} bytes); resume into a new run directory"
        )
    for source in candidates:
        if not _is_log_of(source, size, t_start):
            continue
        if source == log_path:  # resumed in place
            with open(log_path, "r+b") as f:
                f.truncate(size)
            return
        with open(source, "rb") as f:
            head = f.read(size)
        tmp = log_path.with_name(log_path.name + ".tmp")
        tmp.write_bytes(head)
        os.replace(tmp, log_path)
        return
    tried = ", ".join(str(c) for c in candidates[1:]) or "none known"
    log_path.write_text(
        f"{_MARK}{checkpoint} at step {harness['steps']}; the MLLOG before it "
        f"({size} bytes; looked in: {tried}) was not found, so this log is incomplete\n"
    )
    _warn(f"resuming {checkpoint}: its run's MLLOG was not found ({tried}); {log_path} starts incomplete")
