"""Per-step metrics: metrics.jsonl (the run-directory contract), TensorBoard events (and W&B: sinks.py) and the live
view (console.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.diskfull import writing
from scaletrain.train.console import live_view
from scaletrain.train.rundir import dumps_strict, truncate_metrics
from scaletrain.train.sinks import ScalarSink, TensorBoardSink, scalars_of


class MetricsLogger:
    """Appends one JSON object per training step (and per evaluation) to metrics.jsonl and mirrors its numbers to
    TensorBoard and any other scalar sink (sinks.py: W&B).

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
        sinks: Sequence[ScalarSink] = (),
        **view: Any,
    ):
        """`total_steps`: the planned steps (an upper bound); `first_step`: where a resumed run starts; `sinks`:
        scalar sinks besides TensorBoard (sinks.optional_sinks); `view`: options of the plain-line log
        (console.LogLines)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        with writing(self.path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            truncate_metrics(self.path, first_step)
            self._file = open(self.path, "a", buffering=1)
        self._sinks: list[ScalarSink] = [TensorBoardSink(self.run_dir, first_step)] if tensorboard else []
        self._sinks += sinks
        self._view = live_view(total_steps, progress, first_step, **view)

    def log(self, record: dict[str, Any]) -> None:
        """Write one line; numbers also go to every scalar sink (TensorBoard, W&B) under their key at `step`."""
        record = {"time": round(time.time(), 3), **record}
        with writing(self.path):  # line-buffered: a full disk shows here, at the line that did not fit
            self._file.write(dumps_strict(record) + "\n")
        step = record.get("step", 0)
        if self._sinks:
            scalars = scalars_of(record)
            for sink in self._sinks:
                sink.add_scalars(scalars, step)
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
        sinks, self._sinks = self._sinks, []
        try:
            for sink in sinks:
                sink.close()
        finally:
            if not self._file.closed:
                with writing(self.path):
                    self._file.close()
