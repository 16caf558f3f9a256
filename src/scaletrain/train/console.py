"""What a training run shows while it runs: a rich progress bar on a terminal, plain log lines everywhere else.

Off a terminal (Slurm, nohup, CI, a pipe) a bar would be control codes in a log file, so each logged training step
(every `train.log_interval` steps) and each evaluation prints one line instead, in the spirit of torchtitan's console
log:

    step: 10/<=30  loss: 6.4888  lr: 1.00e-03  grad_norm: 0.5512  tok/s: 21,373  memory: 0.42 GiB peak RSS  eta: 0:00:01 to step 30 (step budget)
    step: 10/<=30  eval_loss: 6.3824  target: 0.1

MFU (against the device's dense bf16 peak, as everywhere in scaletrain) appears where the peak is known: CUDA
devices in the peak table, not CPUs. Memory is the CUDA allocator's peak on a GPU, the process's peak RSS on CPU.
The planned step count is an upper bound: reaching the target stops a run sooner, so bar and lines say "≤ N".
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any


def live_view(total_steps: int, progress: bool, first_step: int = 0, **lines: Any):
    """The rich bar when `progress` is on and stdout is a terminal, else the plain-line log (`lines`: LogLines
    options)."""
    if progress and sys.stdout.isatty():
        return ProgressBar(total_steps, first_step)
    return LogLines(total_steps, first_step, **lines)


class ProgressBar:
    """rich progress bar; its total is the step budget, an upper bound that the target may cut short."""

    def __init__(self, total_steps: int, first_step: int = 0) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/≤{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA ≤"),
            TimeRemainingColumn(),
            TextColumn("[dim](target may stop it sooner)"),
            console=Console(),
            transient=True,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=first_step, loss="-", eval="-", tps="-"
        )
        self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        """Move the bar to the record's step and show its loss / eval loss."""
        fields: dict[str, Any] = {}
        if "loss" in record:
            fields.update(loss=f"{record['loss']:.3f}", tps=f"{record.get('tokens_per_s', 0):,.0f}")
        if "eval_loss" in record:
            fields["eval"] = f"{record['eval_loss']:.3f}"
        self._progress.update(self._task, completed=record.get("step", 0), **fields)

    def close(self) -> None:
        """Remove the bar from the terminal."""
        self._progress.stop()


class LogLines:
    """One plain line per logged training step and per evaluation, on stdout, flushed at once."""

    def __init__(
        self,
        total_steps: int,
        first_step: int = 0,
        total_label: str = "step budget",
        memory_label: str = "peak RSS",
        target: float | None = None,
        out=None,
    ) -> None:
        """`total_label` names what bounds the steps, `memory_label` what peak_mem_gib measures (device-dependent);
        `target` is shown on evaluation lines."""
        self.total, self.first_step, self.total_label = int(total_steps), int(first_step), total_label
        self.memory_label, self.target = memory_label, target
        self._out = out
        self._t0 = time.monotonic()  # the rate behind the ETA counts evaluations and saves in, as they recur

    def update(self, record: dict[str, Any]) -> None:
        """Print the line for one metrics record (training step or evaluation)."""
        line = self.format(record, time.monotonic() - self._t0)
        print(line, file=self._out or sys.stdout, flush=True)

    def format(self, record: dict[str, Any], elapsed_s: float) -> str:
        """The line for `record`, `elapsed_s` after the logger started (at step `first_step`)."""
        step = int(record.get("step", 0))
        head = f"step: {step}/<={self.total}"  # ASCII: a batch log may not be UTF-8
        if "eval_loss" in record:
            parts = [head, f"eval_loss: {record['eval_loss']:.4f}"]
            if self.target is not None:
                parts.append(f"target: {self.target:g}")
            return "  ".join(parts)
        parts = [head, f"loss: {record['loss']:.4f}", f"lr: {record['lr']:.2e}"]
        if record.get("grad_norm") is not None:
            parts.append(f"grad_norm: {record['grad_norm']:.4f}")
        parts.append(f"tok/s: {record.get('tokens_per_s', 0):,.0f}")
        if record.get("mfu") is not None:
            parts.append(f"mfu: {100 * record['mfu']:.2f}% of {record.get('mfu_peak', 'dense bf16 peak')}")
        if record.get("peak_mem_gib") is not None:
            parts.append(f"memory: {record['peak_mem_gib']:.2f} GiB {self.memory_label}")
        done = step - self.first_step
        if done > 0 and self.total > step:
            eta = datetime.timedelta(seconds=round(elapsed_s / done * (self.total - step)))
            parts.append(f"eta: {eta} to step {self.total} ({self.total_label})")
        return "  ".join(parts)

    def close(self) -> None:
        """Nothing to release: every line is already flushed."""
