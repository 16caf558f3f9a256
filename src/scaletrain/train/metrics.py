"""Per-step metrics: metrics.jsonl (the run-directory contract), TensorBoard events and a rich progress bar."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from scaletrain.train.rundir import dumps_strict, truncate_metrics


class MetricsLogger:
    """Appends one JSON object per training step (and per evaluation) to metrics.jsonl and mirrors to TensorBoard.

    Contract: training lines carry at least step, loss, lr, tokens, tokens_per_s; evaluation lines carry eval_loss.
    Lines are strict JSON (a non-finite value is null and named under "non_finite"). `start_step`: the step the
    run (re)starts from; records after it, left by an attempt that crashed after its checkpoint, are dropped,
    so every step is in the file once.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, progress: bool = True, tensorboard: bool = True,
                 start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.run_dir / "metrics.jsonl", start_step)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import: only when asked for
            # purge_step: TensorBoard hides the lost attempt's events after the restart step.
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        self._progress = None
        if progress and sys.stdout.isatty():
            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(), transient=True)
            self._task = self._progress.add_task("train", total=total_steps, loss="-", eval="-", tps="-")
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        """Write one line; numbers also go to TensorBoard under their key at `step`."""
        record = {"time": round(time.time(), 3), **record}
        self._file.write(dumps_strict(record) + "\n")
        step = record.get("step", 0)
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._progress is not None:
            fields = {}
            if "loss" in record:
                fields.update(loss=f"{record['loss']:.3f}", tps=f"{record.get('tokens_per_s', 0):,.0f}")
            if "eval_loss" in record:
                fields["eval"] = f"{record['eval_loss']:.3f}"
            self._progress.update(self._task, completed=step, **fields)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
