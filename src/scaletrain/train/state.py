"""The training loop's state: one dataclass, saved under "loop" in each checkpoint's trainer.json and read back
(with its types checked: a checkpoint is data someone else may have written) when a run resumes.

Checkpoints written before the loop moved to train/ (issue 13) hold the same state under "harness", with the MLPerf
log's length beside it; they still resume, that length becoming the MLPerf observer's saved state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.store import TRAINER, CheckpointError

__all__ = ["LoopState", "ResumePoint"]

_LEGACY_OBSERVER = "mlperf"  # bench/harness.py MLPerfObserver.name


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its path and its trainer.json."""

    path: Path | None
    info: dict


@dataclass
class LoopState:
    """Everything the loop knows about a run; `saved()` goes into each checkpoint, `restore()` reads it back."""

    step: int = 0
    evals: list[dict] = field(default_factory=list)
    """One record per evaluation: step, tokens, samples, eval_loss, train_loss, lr, time_s."""
    last: dict = field(default_factory=dict)
    """The last train_step's record."""
    t_start: int | None = None
    t_stop: int | None = None
    """When the run's time to train stopped (ms); saved in the final checkpoint only."""
    t_eval: int | None = None
    """When the last evaluation ended (ms)."""
    block_first: int | None = None
    """First step of the open block (None between blocks)."""
    status: str | None = None
    outcome: str | None = None
    reason: str | None = None
    error: str | None = None
    observers: dict[str, dict] = field(default_factory=dict)
    """Each named observer's saved state (Observer.on_checkpoint)."""
    resume: ResumePoint | None = None
    """Where this run resumed from (not saved)."""

    def saved(self) -> dict:
        """What a checkpoint records of the loop (trainer.json "loop")."""
        out: dict[str, Any] = {
            "step": self.step,
            "evals": self.evals,
            "t_start": self.t_start,
            "last": {k: float(self.last[k]) for k in ("loss", "lr") if self.last.get(k) is not None},
            "observers": self.observers,
        }
        if self.block_first is not None:
            out["block_first"] = self.block_first
        if self.t_stop is not None:  # a final checkpoint (loop.py): a resume ends the run with the same time
            out["t_stop"] = self.t_stop
        return out

    @classmethod
    def restore(cls, info: dict, path: Path | None = None) -> LoopState | None:
        """The loop state in a checkpoint's trainer.json `info` (read_trainer's), or None when it holds none (a run
        that saved no loop state, such as the llama2_70b_lora proxy base). CheckpointError when it is malformed."""
        where = Path(path) / TRAINER if path is not None else Path(TRAINER)
        loop, legacy = info.get("loop"), info.get("harness")
        if loop:
            saved = loop
        elif legacy:
            saved = {
                "step": legacy.get("steps"),
                "evals": legacy.get("evals"),
                "t_start": legacy.get("t_start"),
                "last": legacy.get("last") or {},
                "observers": {_LEGACY_OBSERVER: {"mllog_bytes": legacy.get("mllog_bytes")}},
                **({"block_first": legacy["block_first"]} if "block_first" in legacy else {}),
            }
        else:
            return None
        problem = _problem(saved, info.get("step"))
        if problem:
            raise CheckpointError(
                f"{where}: not a scaletrain trainer state ({'harness' if legacy else 'loop'} {problem})"
            )
        return cls(
            step=saved["step"],
            evals=list(saved["evals"]),
            t_start=saved["t_start"],
            last=dict(saved["last"]),
            block_first=saved.get("block_first"),
            t_stop=saved.get("t_stop"),
            observers={k: dict(v) for k, v in saved["observers"].items()},
            resume=ResumePoint(path, info),
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _problem(saved: Any, step: Any) -> str | None:
    """What is wrong with a saved loop state (types a resume relies on), or None."""
    if not isinstance(saved, dict):
        return f"is a JSON {type(saved).__name__}, not an object"
    for key in ("step", "t_start"):
        if not _is_count(saved.get(key)):
            return f"'{key}' is {saved.get(key)!r}, not a non-negative integer"
    if saved["step"] != step:
        return f"'step' {saved['step']} differs from 'step' {step}"
    if not isinstance(saved.get("evals"), list) or not all(isinstance(e, dict) for e in saved["evals"]):
        return "'evals' is not a list of objects"
    last = saved.get("last")
    if not isinstance(last, dict) or not all(isinstance(v, (int, float)) for v in last.values()):
        return "'last' is not an object of numbers"
    observers = saved.get("observers")
    if not isinstance(observers, dict) or not all(isinstance(v, dict) for v in observers.values()):
        return "'observers' is not an object of objects"
    first = saved.get("block_first")
    if first is not None and (not _is_count(first) or first > saved["step"]):
        return f"'block_first' is {first!r}, not a step at or before 'step'"
    t_stop = saved.get("t_stop")
    if t_stop is not None and (not _is_count(t_stop) or t_stop < saved["t_start"]):
        return f"'t_stop' is {t_stop!r}, not a time at or after 't_start'"
    return None
