"""What a training run shows while it runs: a rich progress bar on a terminal, plain log lines everywhere else.

Off a terminal (Slurm, nohup, CI, a pipe) a bar would be control codes in a log file, so each logged training step
(every `train.log_interval` steps) and each evaluation prints one line instead, in the spirit of torchtitan's console
log:

    step: 10/<=30  loss: 6.4888  lr: 1.00e-03  grad_norm: 0.5512  tok/s: 21,373  memory: 0.42 GiB peak RSS  eta: <=0:00:01 to step 30 (step budget)
    step: 10/<=30  eval_loss: 6.3824  target: 0.1

MFU (against the device's dense bf16 peak, as everywhere in scaletrain) appears where the peak is known: CUDA
devices in the peak table, not CPUs. Memory is the CUDA allocator's peak on a GPU, the process's peak RSS on CPU.
The planned step count is an upper bound: reaching the target stops a run sooner, so bar and lines say "≤ N", and
the time to it is a bound, "eta: <=T". Once two evaluations show the loss falling, a line also estimates when the
target is reached (`target_eta`); a run that reaches its target early (the MLPerf proxies converge at a fifth to a
third of their budget) is then not left reading an ETA several times too long.
"""

from __future__ import annotations

import datetime
import math
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
        self._evals: list[tuple[int, float]] = []  # (step, eval_loss) of the evaluations seen, for target_eta

    def update(self, record: dict[str, Any]) -> None:
        """Print the line for one metrics record (training step or evaluation)."""
        line = self.format(record, time.monotonic() - self._t0)
        print(line, file=self._out or sys.stdout, flush=True)

    def format(self, record: dict[str, Any], elapsed_s: float) -> str:
        """The line for `record`, `elapsed_s` after the logger started (at step `first_step`)."""
        step = int(record.get("step", 0))
        head = f"step: {step}/<={self.total}"  # ASCII: a batch log may not be UTF-8
        if "eval_loss" in record:
            if record["eval_loss"] is not None and (not self._evals or self._evals[-1][0] < step):
                self._evals.append((step, float(record["eval_loss"])))
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
            per_step = elapsed_s / done
            bound = f"<={_duration(per_step * (self.total - step))} to step {self.total} ({self.total_label})"
            target = target_eta(self._evals, self.target, step, self.total)
            if target is None:
                parts.append(f"eta: {bound}")
            else:
                parts.append(f"eta: ~{_duration(per_step * (target - step))} to the target (step ~{target}), {bound}")
        return "  ".join(parts)

    def close(self) -> None:
        """Nothing to release: every line is already flushed."""


def _duration(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=round(max(0.0, seconds)))


def target_eta(evals: list[tuple[int, float]], target: float | None, step: int, total: int) -> int | None:
    """The step of the evaluation at which the eval-loss trend reaches `target`, or None when there is no trend
    (fewer than two evaluations, a loss that did not fall, the target already met) or it reaches the target only at
    or past step `total`, the bound.

    The trend is the last two evaluations, (s1, l1) and (s2, l2), extended as a straight line in log(step),
    loss = l2 - b ln(s/s2): training loss curves flatten as they go, so this reaches the target later than a straight
    line in steps would, the side to err on. A run checks its target at evaluations only, so the answer is rounded up
    to the next one, at the spacing of the last two.
    """
    if target is None or len(evals) < 2:
        return None
    (s1, l1), (s2, l2) = evals[-2], evals[-1]
    if not (0 < s1 < s2 and l1 > l2 > target) or not all(map(math.isfinite, (l1, l2))):
        return None
    slope = (l1 - l2) / math.log(s2 / s1)
    reach = s2 * math.exp(min((l2 - target) / slope, 50.0))  # capped: exp would overflow long before it matters
    at_eval = s2 + math.ceil((reach - s2) / (s2 - s1) - 1e-9) * (s2 - s1)  # 1e-9: exp(ln 2) is not exactly 2
    at_eval = max(at_eval, s2 + (s2 - s1) * math.ceil(max(0, step - s2) / (s2 - s1)))  # not before the next one
    return int(at_eval) if at_eval < total else None
