"""What the training loop (loop.py) drives and who watches it: the Engine protocol, the Observer hooks, and the two
ways a run ends early by exception (NonFiniteLoss, Preempted).

Torch-free on purpose: a model-free engine (bench/scripted.py) and the command line's error handling use these
without importing torch.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from scaletrain.train.state import LoopState

__all__ = ["Engine", "Observer", "NonFiniteLoss", "Preempted", "PREEMPTED"]

PREEMPTED = "preempted"
"""result.json status and outcome of a run stopped by a signal: not finished, resumable (`--resume auto`)."""


class NonFiniteLoss(RuntimeError):
    """A training loss was NaN or Inf; the run ends with status "aborted"."""

    def __init__(self, step: int, value: float) -> None:
        self.step = int(step)
        self.value = float(value)
        super().__init__(f"non-finite training loss {self.value} at step {self.step}")


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1) ended the run after `step`; the checkpoint saved there resumes it.

    Exit status of a preempted process: 128 + the signal number (143 for SIGTERM, 138 for SIGUSR1), the shell's code
    for "ended by that signal": non-zero, so torchrun and Slurm see an interrupted run, and distinct from 0
    (finished), 1 (failed) and 2 (bad input).
    """

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


@runtime_checkable
class Engine(Protocol):
    """What the loop drives: model, optimizer, data and checkpoints of one run. Steps count from the start checkpoint
    (step 1 is the first timed step). Every method is called on every rank at the same point of the run.

    llama2_70b_lora engines also carry `eval_samples` and `train_samples`: the validation and training sequence
    counts (173 and 3901 for GovReport), which the MLPerf observer logs. They are not members here so that a gpt3
    engine without them still satisfies isinstance(engine, Engine). Likewise optional: `result_extra()`, a dict the
    loop adds to result.json (the Trainer's "predicted_vs_measured", train/perf.py), `wait_for_saves()`, which
    publishes an asynchronous save in flight before result.json is written (its failure is the run's), and
    `running()`, a context manager the loop holds around the whole run (init to finish): process-wide hooks such as
    the Trainer's collective-wait timing live exactly as long as it, whatever way the run ends.
    """

    seq_len: int
    global_batch_size: int
    eval_tokens: int
    """Validation label-token count (the MLPerf observer logs it as gpt3's eval_samples); may be set by init()."""
    step: int
    """Optimizer steps taken since the start checkpoint (after init(): the resumed checkpoint's step)."""
    resume_path: Path | None
    """The checkpoint init() loads to resume a run, or None for a fresh run."""

    def resume_state(self) -> dict | None:
        """trainer.json of `resume_path` (types checked), or None: what the loop restores its state from."""

    def init(self) -> None:
        """UNTIMED: build the model, warm up, then reset to the seed's initial state (or load `resume_path`)."""

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; at least {"loss": float, "lr": float}.

        Raises NonFiniteLoss(step, value) when the loss is NaN/Inf."""

    def evaluate(self) -> float:
        """Token-weighted mean cross-entropy over the WHOLE validation set."""

    def stop_signal(self) -> int:
        """The stop signal every rank agrees on (0: none); asked after every step."""

    def checkpoint_due(self) -> bool:
        """Whether to save now (asked after an evaluation that did not end the run; same answer on all ranks)."""

    def final_checkpoint_due(self) -> bool:
        """Whether to save the last step of a run that converged or used up its budget: checkpoints are on and that
        step is not saved yet (same answer on all ranks). Asked once, after the run's time stopped."""

    def save_checkpoint(self, loop_state: dict) -> Path:
        """Save the run at the current step with `loop_state` (LoopState.saved()) in trainer.json; its path."""

    def finish(self, result: dict) -> None:
        """Publish pending saves and close writers; `result` is what went into result.json."""


class Observer:
    """Hooks the loop calls at each point of a run; every default does nothing. Subclasses override what they need.

    Order: on_init_start, [engine.init()], on_run_start, then per block: on_block_start, on_step per step,
    on_block_end, on_eval_start, on_eval; on_checkpoint before each save; on_run_end last, also after a crash or a
    stop signal. A resumed run starts with on_init_start/on_run_start too (`state.resume` says from where) and skips
    on_block_start of a block whose start was saved in the checkpoint (`state.block_first`).
    """

    name = ""
    """Key of this observer's state in the checkpoint (LoopState.observers); empty: it saves none."""

    def on_init_start(self, state: LoopState, engine: Engine) -> None:
        """Before engine.init(), outside the run's time."""

    def on_run_start(self, state: LoopState, engine: Engine) -> None:
        """After engine.init(): the run's time starts at `state.t_start` (a resumed run keeps its saved start)."""

    def on_block_start(self, state: LoopState, first: int, stop: int) -> None:
        """Steps first+1..stop follow, then an evaluation (or the budget ends)."""

    def on_step(self, state: LoopState, out: dict) -> None:
        """After each optimizer step; `out` is train_step's record, `state.step` its number."""

    def on_block_end(self, state: LoopState, first: int, stop: int) -> None:
        """The block's steps are done (or a non-finite loss cut it short: `state.outcome` is then "diverged")."""

    def on_eval_start(self, state: LoopState) -> None:
        """Before engine.evaluate()."""

    def on_eval(self, state: LoopState, record: dict) -> None:
        """After engine.evaluate(); `record` was appended to `state.evals` (its time is `state.t_eval`)."""

    def on_checkpoint(self, state: LoopState) -> dict:
        """Before a save: what to save of this observer (handed back in `state.observers[name]` on resume)."""
        return {}

    def on_run_end(self, state: LoopState, result: dict) -> dict:
        """The run ended (finished, crashed or preempted); `result` goes to result.json with the fields returned
        here added. Called once, also when an earlier hook raised."""
        return {}
