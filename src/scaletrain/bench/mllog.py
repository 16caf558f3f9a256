"""MLLOG writer: real `:::MLLOG` lines through `mlperf_logging.mllog`, one private logger per file; and the log of a
resumed run, continued from its checkpoint (`restore_mllog`).

`mlperf_logging.mllog` is built around one process-wide logger (`mllog.config(filename=...)`) that also prints to
stdout. The benchmark runs several timed runs in one process, so each log gets its own `logging.Logger` with its own
FileHandler; nothing propagates to the root logger, so a user's logging setup can neither duplicate nor swallow lines.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from mlperf_logging.mllog import constants as C  # noqa: F401  (re-exported for callers: `from .mllog import C`)
from mlperf_logging.mllog.mllog import MLLogger

from scaletrain.checkpoint.store import CheckpointError
from scaletrain.diskfull import DiskFullError, is_no_space, writing
from scaletrain.log import get_logger

__all__ = ["MLLogWriter", "C", "now_ms", "read_mllog", "restore_mllog", "TOKEN", "MLLOG"]

TOKEN = ":::MLLOG "
MLLOG = "mllog.txt"
_MARK = "# scaletrain: resumed from "

# mllog looks (2 + stack_offset) frames up from get_caller: get_caller <- _log_helper <- MLLogger.<method> <- ...
# Its default offset of 1 names whoever called MLLogger, i.e. this wrapper. Our frames in between are
# MLLogWriter._emit and MLLogWriter.<method>, so 3 names the harness line that logged the event.
_OWN_FRAMES = 3

_ids = itertools.count()
log = get_logger(__name__)


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch: the clock mllog stamps `time_ms` with (int(time.time() * 1e3))."""
    return int(time.time() * 1e3)


class _FileHandler(logging.FileHandler):
    """A FileHandler that keeps a full disk for MLLogWriter to raise as one line; logging itself would print a
    traceback and carry on without the line."""

    failed: BaseException | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        """Keep a full disk (the writer raises it); any other error as logging does."""
        exc = sys.exc_info()[1]
        if exc is not None and is_no_space(exc, self.baseFilename):
            self.failed = exc
            return
        super().handleError(record)


class MLLogWriter:
    """Write MLLOG events to `path` (truncated on open).

    Every method returns the `time_ms` stamped on the line, so callers can compute durations on the log's own clock.
    `file`/`lineno` metadata name the code that called the method; pass `stack_offset=k` from a helper that wraps
    these methods to name the helper's caller k frames further up instead.
    """

    def __init__(self, path: str | Path | None, echo: bool = False, mode: str = "w") -> None:
        """Open `path` for MLLOG lines; `echo=True` also mirrors every line to stdout.

        `path=None` keeps the clock and the checks but writes nothing: the non-zero ranks of a distributed run.
        """
        self.path = Path(path) if path is not None else None
        # A unique name per writer: logging.getLogger caches by name, and two writers on one logger would share handlers.
        self._logger = logging.getLogger(f"scaletrain.mllog.{next(_ids)}")
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False
        self._handlers: list[logging.Handler] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with writing(self.path):
                self._handlers.append(_FileHandler(self.path, mode=mode, encoding="utf-8"))
        else:
            self._handlers.append(logging.NullHandler())
        if echo:
            self._handlers.append(logging.StreamHandler(sys.stdout))
        for handler in self._handlers:
            handler.setFormatter(logging.Formatter("%(message)s"))
            handler.setLevel(logging.INFO)
            self._logger.addHandler(handler)
        self._mllogger = MLLogger(logger=self._logger, default_stack_offset=_OWN_FRAMES)
        self.closed = False

    # ------------------------------------------------------------------ events

    def event(
        self,
        key: str,
        value: Any = None,
        metadata: dict | None = None,
        time_ms: int | None = None,
        stack_offset: int = 0,
    ) -> int:
        """Log a POINT_IN_TIME event; returns its time_ms."""
        return self._emit(self._mllogger.event, key, value, metadata, time_ms, stack_offset)

    def start(
        self,
        key: str,
        value: Any = None,
        metadata: dict | None = None,
        time_ms: int | None = None,
        stack_offset: int = 0,
    ) -> int:
        """Log an INTERVAL_START event (init_start, run_start, block_start, eval_start); returns its time_ms."""
        return self._emit(self._mllogger.start, key, value, metadata, time_ms, stack_offset)

    def end(
        self,
        key: str,
        value: Any = None,
        metadata: dict | None = None,
        time_ms: int | None = None,
        stack_offset: int = 0,
    ) -> int:
        """Log an INTERVAL_END event (init_stop, run_stop, block_stop, eval_stop); returns its time_ms."""
        return self._emit(self._mllogger.end, key, value, metadata, time_ms, stack_offset)

    def _emit(self, method, key, value, metadata, time_ms, stack_offset) -> int:
        if self.closed:
            # Logging on a handler-less logger would silently drop INFO lines; a lost event must be loud.
            raise RuntimeError(f"MLLogWriter({self.path}) is closed; cannot log {key!r}")
        stamp = now_ms() if time_ms is None else int(time_ms)
        method(key, value, metadata=metadata, time_ms=stamp, stack_offset=_OWN_FRAMES + stack_offset)
        for handler in self._handlers:
            if getattr(handler, "failed", None) is not None:
                handler.failed = None  # type: ignore[attr-defined]
                raise DiskFullError(self.path or "mllog", f"MLLOG line {key!r} lost")
        return stamp

    # ------------------------------------------------------------------ lifetime

    def size(self) -> int:
        """Bytes written to the file so far (after flush()); 0 for a writer without a file."""
        return self.path.stat().st_size if self.path is not None and self.path.exists() else 0

    def flush(self) -> None:
        """Flush buffered lines to disk."""
        with writing(self.path or "mllog"):
            for handler in self._handlers:
                handler.flush()

    def close(self) -> None:
        """Flush and close the file and detach every handler from the logger; idempotent."""
        if self.closed:
            return
        try:
            with writing(self.path or "mllog"):
                for handler in self._handlers:
                    self._logger.removeHandler(handler)
                    handler.flush()
                    handler.close()
        finally:
            for handler in self._handlers:  # after a full disk too: the logger keeps no handler and no open file
                self._logger.removeHandler(handler)
                handler.close()
            self._handlers.clear()
            self.closed = True

    def __enter__(self) -> MLLogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MLLogWriter({str(self.path)!r}{', closed' if self.closed else ''})"


def read_mllog(path: str | Path) -> list[dict]:
    """The MLLOG events of a file as dicts (namespace, time_ms, event_type, key, value, metadata), in file order.

    Like the checker, it accepts a prefix before the token (e.g. a rank tag) and ignores lines without one.
    """
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        at = line.find(TOKEN)
        if at >= 0:
            events.append(json.loads(line[at + len(TOKEN) :]))
    return events


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


def restore_mllog(
    log_path: Path, checkpoint: Path | None, info: dict, size: int | None, t_start: int, step: int
) -> None:
    """Make `log_path` the MLLOG of the checkpoint's run up to the checkpoint.

    The checkpoint recorded the byte length of its run's MLLOG when it was taken (`size`: the MLPerf observer's
    `mllog_bytes`). Resuming continues that log: events after the checkpoint (the part of the run that crashed) are
    dropped, and the run keeps its single run_start. Resumed in place, the run directory's own log is cut back;
    resumed into another run directory, the log is copied from the run that wrote the checkpoint (the directory
    above its `checkpoints/`, else the run_dir its config names); a log counts as the run's when its first `size`
    bytes hold the run_start stamped `t_start` (the checkpoint's). A log of another run in the run directory is
    never overwritten (one-line CheckpointError). When no log is found (or the run kept none: `size` None), the new
    log starts with a comment line saying so and the compliance checker rejects it (no run_start): the run's result
    stands, its log is not a complete MLPerf log. `info`: the checkpoint's validated trainer.json.
    """
    log_path = Path(log_path)
    candidates = _source_logs(log_path, checkpoint, info)
    if log_path.exists() and (size is None or not _is_log_of(log_path, size, t_start)):
        where = f"no run_start at time_ms {t_start} in its first {size} bytes" if size is not None else "it kept none"
        raise CheckpointError(
            f"{log_path}: not the MLLOG of the run that saved {checkpoint} ({where}); resume into a new run directory"
        )
    source = next((c for c in candidates if _is_log_of(c, size, t_start)), None) if size is not None else None
    if source == log_path:  # resumed in place
        with open(log_path, "r+b") as f:
            f.truncate(size)
        return
    if source is not None:
        with open(source, "rb") as f:
            head = f.read(size)
        tmp = log_path.with_name(log_path.name + ".tmp")
        tmp.write_bytes(head)
        os.replace(tmp, log_path)
        return
    tried = ", ".join(str(c) for c in candidates[1:]) or "none known"
    if size is None:  # resumed from a run trained without the MLPerf observer
        lost, why = "the run kept no MLLOG", "its run kept no MLLOG"
    else:
        lost, why = (
            f"the MLLOG before it ({size} bytes; looked in: {tried}) was not found",
            f"its run's MLLOG was not found ({tried})",
        )
    log_path.write_text(f"{_MARK}{checkpoint} at step {step}; {lost}, so this log is incomplete\n")
    log.warning("resuming %s: %s; %s starts incomplete", checkpoint, why, log_path)
