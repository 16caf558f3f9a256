"""Per-step metrics: metrics.jsonl (the run-directory contract), TensorBoard events and the live view (console.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scaletrain.train.console import live_view
from scaletrain.train.rundir import dumps_strict, truncate_metrics


class MetricsLogger:
    """Appends one JSON object per training step (and per evaluation) to metrics.jsonl and mirrors to TensorBoard.

    Contract: training lines carry at least step, loss, lr, tokens, tokens_per_s; evaluation lines carry eval_loss.
    Lines are strict JSON (a non-finite value is null and named under "non_finite"). `first_step`: the step the
    run (re)starts from; records after it, left by an attempt that crashed after its checkpoint, are dropped,
    so every step is in the file once.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        progress: bool = True,
        tensorboard: bool = True,
        first_step: int = 0,
        **view: Any,
    ):
        """`total_steps`: the planned steps (an upper bound); `first_step`: where a resumed run starts; `view`:
        options of the plain-line log (console.LogLines)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.run_dir / "metrics.jsonl", first_step)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import: only when asked for

            # purge_step: TensorBoard hides the lost attempt's events after the restart step.
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=first_step + 1)
        self._view = live_view(total_steps, progress, first_step, **view)

    def log(self, record: dict[str, Any]) -> None:
        """Write one line; numbers also go to TensorBoard under their key at `step`."""
        record = {"time": round(time.time(), 3), **record}
        self._file.write(dumps_strict(record) + "\n")
        step = record.get("step", 0)
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._view is not None and ("loss" in record or "eval_loss" in record):  # not a checkpoint_s line
            self._view.update(record)

    @property
    def closed(self) -> bool:
        """Whether close() was called (a checkpoint saved after the run ends logs no line)."""
        return self._file.closed

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._view is not None:
            self._view.close()
            self._view = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
