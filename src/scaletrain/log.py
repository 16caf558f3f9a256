"""The project logger: warnings and status lines through `logging`, from rank 0 unless `--log-ranks` says otherwise.

Results (tables, JSON, the lines a command exists to print) still go to stdout with print/rich; this logger is for
what a user should notice on the side: warnings (stderr, `scaletrain: warning: ...`), errors (`scaletrain: error:
...`) and status lines (stderr). Under torchrun every rank runs the same code, so without a rank filter every
warning would appear world-size times; ranks other than 0 are silent by default and prefixed `[rank N]` when shown.
Errors pass the filter on every rank: the process is about to exit, and a rank that failed alone must say why.
Torch-free on purpose: `sim/` and `config` log through it too.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger", "setup_logging", "parse_log_ranks", "ROOT"]

ROOT = "scaletrain"


def get_logger(name: str) -> logging.Logger:
    """The logger for module `name` (pass `__name__`); everything under `scaletrain.` shares one handler."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def _env_rank() -> int:
    # The launcher's rank (torchrun/Slurm) is known before torch.distributed starts, so early warnings filter too.
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def parse_log_ranks(spec: str) -> set[int] | None:
    """`--log-ranks` value -> the ranks that log: "0" (default), "0,3", "all" (None = every rank).

    Raises ValueError with the offending text for anything else, so a typo is a clear CLI error, not silence."""
    text = spec.strip().lower()
    if text == "all":
        return None
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--log-ranks {spec!r}: expected 'all' or comma-separated rank numbers like '0,3'") from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--log-ranks {spec!r}: expected 'all' or comma-separated rank numbers like '0,3'")
    return ranks


class _Format(logging.Formatter):
    def __init__(self, rank: int, world_prefix: bool) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] " if world_prefix else ""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            message = f"scaletrain: error: {message}"
        elif record.levelno >= logging.WARNING:
            message = f"scaletrain: warning: {message}"
        return self.prefix + message


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, ranks: set[int] | None) -> None:
        super().__init__()
        self.show = ranks is None or rank in ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.show or record.levelno >= logging.ERROR


def setup_logging(log_ranks: str = "0", rank: int | None = None, level: int = logging.INFO) -> logging.Logger:
    """Install the one stderr handler on the `scaletrain` logger (idempotent: a second call replaces it).

    `rank` defaults to the launcher's RANK/SLURM_PROCID. Ranks not in `log_ranks` log only errors; ranks other
    than 0 carry a `[rank N]` prefix. The stream is looked up at each call's time, so pytest's capsys sees the lines."""
    rank = _env_rank() if rank is None else rank
    ranks = parse_log_ranks(log_ranks)
    root = logging.getLogger(ROOT)
    for handler in list(root.handlers):
        if getattr(handler, "_scaletrain", False):
            root.removeHandler(handler)
    handler = _StderrHandler()
    handler._scaletrain = True  # type: ignore[attr-defined]
    handler.setFormatter(_Format(rank, world_prefix=rank != 0))
    handler.addFilter(_RankFilter(rank, ranks))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # a host application's root handlers would print every line twice
    return root


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler bound to whatever sys.stderr is now (pytest and redirect_stderr replace it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)
        self.flush()


# Installed on import so that library use (tests, notebooks) gets the same lines as the CLI; the CLI calls
# setup_logging again with --log-ranks.
setup_logging()
