"""Stopping a timed run on the batch system's request (SIGTERM, SIGUSR1) so that a resume continues it exactly.

After each optimizer step the harness asks the engine for an agreed stop signal (`engine.stop_signal()`, the same
on every rank). When there is one, it saves a checkpoint of that step whose harness state records the open block
(`block_first`: the block_start is already in the log) and the last step's loss and lr, then raises `Preempted`.
Nothing marks the run as ended: no block_stop or run_stop is logged and result.json says "preempted". A resume
truncates the log to the checkpoint's offset (just after that step), trains the rest of the block without a second
block_start, and from there logs exactly what the uninterrupted run would have.

Exit status of a preempted process: 128 + the signal number (143 for SIGTERM, 138 for SIGUSR1), the shell's code
for "ended by that signal": non-zero, so torchrun and Slurm see an interrupted run, and distinct from 0 (finished),
1 (failed) and 2 (bad input).
"""

from __future__ import annotations

import signal
from typing import Any

PREEMPTED = "preempted"
"""result.json status of a run stopped by a signal: not finished, resumable (`--resume auto`)."""


class Preempted(Exception):
    """A stop signal ended the run after `step`; the checkpoint saved there resumes it."""

    def __init__(self, signum: int, step: int, checkpoint: Any) -> None:
        self.signum, self.step, self.checkpoint = int(signum), int(step), checkpoint
        self.exit_code = 128 + self.signum
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        super().__init__(
            f"{name} received: stopped after step {self.step} and saved {checkpoint}; the run is not "
            f"finished, resume it with --resume auto (exit status {self.exit_code})"
        )


def harness_state(state: dict, log, block_first: int | None = None) -> dict:
    """What a checkpoint records of the harness: steps, evaluations, run_start time and the log offset.

    `block_first` marks a save inside a block (whose block_start is already logged); the last step's loss and lr
    then go along too, since the evaluation that closes the block reports them.
    """
    log.flush()
    saved = {"steps": state["steps"], "evals": state["evals"], "t_start": state["t_start"], "mllog_bytes": log.size()}
    if block_first is not None:
        last = state.get("last") or {}
        saved.update(
            block_first=int(block_first), last={k: float(last[k]) for k in ("loss", "lr") if last.get(k) is not None}
        )
    return saved


def stop_if_signalled(engine, log, state: dict, block_first: int) -> None:
    """After a step: when the ranks agree a stop signal arrived, save this step and raise Preempted."""
    ask = getattr(engine, "stop_signal", None)
    if ask is None:
        return
    signum = ask()
    if not signum:
        return
    path = engine.save_checkpoint(harness_state(state, log, block_first))
    raise Preempted(signum, state["steps"], path)
