"""The training loop: init -> blocks of steps, each closed by an evaluation -> stop -> result.json; checkpoints and
resume. The one loop of every run (`scaletrain train`, each benchmark run, the scripted engine of the tests); what
watches a run (the MLPerf log, bench/harness.py) is an Observer (protocol.py) and changes nothing here.

A block ends at the next evaluation step or the step budget (schedule.py). After an evaluation the run stops at the
first eval loss <= train.target_eval_loss (status "success", outcome "converged"), at a non-finite eval loss
("aborted", "diverged") or when the budget is used up ("aborted", "budget_exhausted"); otherwise it saves when the
engine says a checkpoint is due. A non-finite training loss ends its block early ("aborted", "diverged"); any other
exception is recorded in result.json under "error" (outcome "crashed") and re-raised. A full disk or quota anywhere
(a checkpoint, metrics, result.json itself) is outcome "disk_full" (status "aborted", exit status 2) and raised as
one DiskFullError line (diskfull.py) that also says when result.json could not be written.

The final state: a run that converged or used up its budget saves its last step when the engine checkpoints at all
(Engine.final_checkpoint_due), after `t_stop` is stamped, so the save is outside the time to train and the MLLOG's
run_stop. That checkpoint holds `t_stop`; resuming it (a kill before result.json was written) applies the stop test
to its last evaluation again and ends the run with the same result and log, or trains on if the budget or target
changed. A diverged run saves nothing at its end: its weights are not worth keeping over the earlier checkpoints.

Stop signals (SIGTERM, SIGUSR1; train/signals.py): after each step the loop asks the engine for the signal every
rank agrees on. When there is one, it saves that step, with the open block's first step (`block_first`) and the
last step's loss and lr (the evaluation that closes the block reports them), and raises Preempted: result.json says
"preempted" and the run is not over. A resume trains the rest of that block without starting it again, and from
there does exactly what the uninterrupted run would have.

Time: `t_start` is the wall clock (ms since the epoch, the clock MLLOG stamps with) when the run starts after the
untimed init; a resumed run keeps the saved one, so time to train counts the restart. Loop state is one dataclass,
LoopState (state.py), saved under "loop" in each checkpoint's trainer.json.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.config import Config
from scaletrain.diskfull import DiskFullError, disk_full, writing
from scaletrain.train.profiling import StepProfiler
from scaletrain.train.protocol import PREEMPTED, Engine, NonFiniteLoss, Observer, Preempted
from scaletrain.train.rundir import dumps_strict
from scaletrain.train.schedule import EvalSchedule
from scaletrain.train.state import LoopState, ResumePoint

__all__ = ["LoopState", "ResumePoint", "run_loop", "now_ms", "SUCCESS", "ABORTED"]

SUCCESS, ABORTED = "success", "aborted"  # result.json status (MLPerf's run_stop status values)
DISK_FULL = "disk_full"
"""result.json outcome of a run stopped by a full disk or quota (status "aborted"; exit status 2; resumable)."""
FINAL_SAVE_OUTCOMES = ("converged", "budget_exhausted")


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch (what MLLOG stamps `time_ms` with)."""
    return int(time.time() * 1e3)


def run_loop(
    cfg: Config, engine: Engine, run_dir: str | Path, observers: Sequence[Observer] = (), writer: bool = True
) -> dict:
    """Train `engine` to the target, the budget or a divergence; writes run_dir/result.json; returns the result.

    A run resumes when the engine has a checkpoint to resume (Engine.resume_path) whose trainer.json holds a loop
    state. `writer=False` (every rank but 0 of a distributed run) steps in lockstep and writes no file.
    Exceptions after the run began are recorded in result.json ("error", outcome "crashed", or "disk_full" and
    raised as DiskFullError), passed to engine.finish and re-raised; Preempted after a stop signal's save (see the
    module docstring). An engine's optional `wait_for_saves()` is called before result.json is written, and its
    optional `running()` context is held around everything from init to finish.
    """
    running = getattr(engine, "running", None)  # optional (protocol.py): process-wide hooks scoped to the run
    with running() if callable(running) else contextlib.nullcontext():
        return _run_loop(cfg, engine, run_dir, observers, writer)


def _run_loop(cfg: Config, engine: Engine, run_dir: str | Path, observers: Sequence[Observer], writer: bool) -> dict:
    run_dir = Path(run_dir)
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    _check_engine(cfg, engine)
    info = engine.resume_state()
    state = (LoopState.restore(info, engine.resume_path) if info else None) or LoopState()
    loop = _Loop(cfg, engine, list(observers), run_dir, writer)
    for obs in loop.observers:  # setup, before the run began: a failure here records nothing
        obs.on_init_start(state, engine)
    preempted = None
    try:
        try:
            loop.run(state)
        except Preempted as exc:
            preempted = exc
        # An asynchronous save still in flight (the signal's one too) is published, or fails, before result.json
        # says how the run ended.
        _wait_for_saves(engine)
    except BaseException as exc:
        full = disk_full(exc, getattr(exc, "filename", None) or run_dir)
        state.error = str(full) if full else f"{type(exc).__name__}: {exc}"
        state.outcome = DISK_FULL if full else "crashed"
        if state.t_start is not None:  # also a failed final save: the run did not end as its evaluation said
            state.status, state.reason = ABORTED, f"crashed: {state.error}"
            state.t_stop = state.t_stop or now_ms()
        if full:  # not finished whatever the loop had decided: free space and resume it
            state.status, state.reason = ABORTED, state.error
        with contextlib.suppress(Exception):  # a save in flight is published or removed: its space for result.json
            _wait_for_saves(engine)
        try:
            loop.end(state, quiet=True)
        except DiskFullError as late:  # result.json itself: one line that says so
            if full:
                raise full.also(late.path) from None
            raise exc from exc.__cause__  # the crash itself, as it was
        if full:
            raise full from None
        raise
    if preempted is not None:
        state.status, state.reason, state.outcome = PREEMPTED, str(preempted), PREEMPTED
        loop.end(state)
        raise preempted
    return loop.end(state)


def _wait_for_saves(engine: Engine) -> None:
    wait = getattr(engine, "wait_for_saves", None)  # optional (protocol.py)
    if callable(wait):
        wait()


def _check_engine(cfg: Config, engine: Engine) -> None:
    # Token and sample counts in result.json (and the MLPerf log) come from the config; an engine built with other
    # shapes would make them lie.
    for attr, want in (("seq_len", cfg.model.seq_len), ("global_batch_size", cfg.train.global_batch_size)):
        have = getattr(engine, attr, None)
        if have != want:
            raise ValueError(f"engine.{attr}={have!r} does not match the config's {want}")


class _Loop:
    def __init__(self, cfg: Config, engine: Engine, observers: list[Observer], run_dir: Path, writer: bool) -> None:
        self.cfg, self.engine, self.observers = cfg, engine, observers
        self.run_dir, self.writer = run_dir, writer
        self.schedule = EvalSchedule(cfg)
        # train.profile_steps / memory_snapshot (profiling.py); engines without rank/device are one CPU process.
        self.profiler = StepProfiler(cfg.train, run_dir, getattr(engine, "rank", 0), getattr(engine, "device", None))

    def run(self, state: LoopState) -> None:
        engine, schedule = self.engine, self.schedule
        engine.init()  # untimed: builds the model (and loads the checkpoint of a resume)
        if state.resume is not None:
            if engine.step != state.step:
                raise RuntimeError(f"checkpoint step {engine.step} does not match the loop state {state.step}")
            self._stop_at_resume(state)
        else:
            state.t_start = now_ms()
        for obs in self.observers:
            obs.on_run_start(state, engine)
        while state.status is None:
            if state.block_first is None:
                first = state.block_first = state.step
                stop = schedule.next_stop(first)
                for obs in self.observers:
                    obs.on_block_start(state, first, stop)
            else:  # resumed inside this block: its start was before the checkpoint
                first, stop = state.block_first, schedule.next_stop(state.block_first)
            try:
                while state.step < stop:
                    self._step(state)
            except NonFiniteLoss as exc:
                state.status, state.reason, state.outcome = ABORTED, str(exc) + self._resumed_from(), "diverged"
            state.block_first = None
            for obs in self.observers:
                obs.on_block_end(state, first, stop)
            if state.status is None:
                self._evaluate(state)
        if state.t_stop is None:  # else: resumed from the final checkpoint, whose stop time stands
            state.t_stop = now_ms()
        if state.outcome in FINAL_SAVE_OUTCOMES and engine.final_checkpoint_due():
            self._save(state)  # after t_stop: the save is not part of the time to train

    def _stop_at_resume(self, state: LoopState) -> None:
        """A checkpoint taken right after an evaluation (periodic or final) is stopped at again when that evaluation
        meets this config's stop test: the final checkpoint of a run killed before its result.json ends the same."""
        last = state.evals[-1] if state.evals else {}
        loss = last.get("eval_loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            if state.block_first is None and last.get("step") == state.step:
                self._stop_test(state, float(loss))
        if state.status is None:
            state.t_stop = None  # trains on (a larger budget): the stop time is the new end's
        elif state.t_stop is None:
            state.t_stop = now_ms()

    def _step(self, state: LoopState) -> None:
        with self.profiler.step(state.step + 1):
            out = self.engine.train_step()
        loss = float(out["loss"])
        if not math.isfinite(loss):  # an engine that forgot its own check
            raise NonFiniteLoss(state.step + 1, loss)
        state.step += 1
        state.last = out
        for obs in self.observers:
            obs.on_step(state, out)
        signum = self.engine.stop_signal()
        if signum:
            raise Preempted(signum, state.step, self._save(state))

    def _evaluate(self, state: LoopState) -> None:
        for obs in self.observers:
            obs.on_eval_start(state)
        eval_loss = float(self.engine.evaluate())
        state.t_eval = now_ms()
        steps, last, t_start = state.step, state.last, state.t_start or 0
        record = {
            "step": steps,
            "tokens": steps * self.schedule.tps,
            "samples": steps * self.schedule.gbs,
            "eval_loss": eval_loss,
            "train_loss": _num(last.get("loss")),
            "lr": _num(last.get("lr")),
            "time_s": (state.t_eval - t_start) / 1000.0,
        }
        state.evals.append(record)
        for obs in self.observers:
            obs.on_eval(state, record)
        if not self._stop_test(state, eval_loss) and self.engine.checkpoint_due():
            self._save(state)

    def _stop_test(self, state: LoopState, eval_loss: float) -> bool:
        """Whether the run ends at this evaluation (status, outcome and reason set), after `state.step` steps."""
        limit, target, steps = self.schedule.limit, self.schedule.target, state.step
        if not math.isfinite(eval_loss):
            state.status, state.outcome = ABORTED, "diverged"
            state.reason = f"non-finite eval loss {eval_loss} at step {steps}" + self._resumed_from()
        elif eval_loss <= target:
            state.status, state.outcome = SUCCESS, "converged"
        elif steps >= limit:
            state.status, state.outcome = ABORTED, "budget_exhausted"
            state.reason = (
                f"step budget of {limit} steps used up with eval loss {eval_loss:.4f} above the target {target}"
            )
        return state.status is not None

    def _save(self, state: LoopState) -> Path:
        for obs in self.observers:
            saved = obs.on_checkpoint(state)
            if obs.name:
                state.observers[obs.name] = saved
        return self.engine.save_checkpoint(state.saved())

    def _resumed_from(self) -> str:
        # A resumed run that diverges may have loaded damaged weights (checkpoint.verify="size" misses flipped bytes).
        path = self.engine.resume_path
        return f" (resumed from {path})" if path else ""

    def end(self, state: LoopState, quiet: bool = False) -> dict:
        """result.json: the loop's fields, then what each observer adds, written once engine.finish has closed the
        run's writers. `quiet` (after a crash): failures of observers and of engine.finish must not hide the
        original one. Otherwise a full disk in any of them (mllog.txt, metrics, TensorBoard) makes the outcome
        "disk_full" and is raised after result.json; a result.json that does not fit is raised too."""
        full: DiskFullError | None = None

        def attempt(step) -> None:
            nonlocal full
            try:
                step()
            except Exception as exc:
                if quiet:
                    return
                if not isinstance(exc, DiskFullError):
                    raise
                full = full or exc

        def close_profiler() -> None:  # a run that stopped inside train.profile_steps: write what was traced
            with writing(self.run_dir / "profile"):
                self.profiler.close()

        attempt(close_profiler)
        result = self._result(state)
        extra = getattr(self.engine, "result_extra", None)  # a Trainer's predicted_vs_measured (train/perf.py)
        if callable(extra):
            attempt(lambda: result.update(extra()))
        for obs in self.observers:
            attempt(lambda obs=obs: result.update(obs.on_run_end(state, result) or {}))
        attempt(lambda: self.engine.finish(result))
        if full is not None:
            result.update(status=ABORTED, outcome=DISK_FULL, reason=str(full), error=str(full))
        if self.writer:
            try:
                with writing(self.run_dir / "result.json"):
                    _write_json(self.run_dir / "result.json", result)
            except DiskFullError as exc:
                raise (full.also(exc.path) if full else exc) from None
        if full is not None:
            raise full
        return result

    def _result(self, state: LoopState) -> dict:
        evals, t0, t1 = state.evals, state.t_start, state.t_stop
        return {
            "status": state.status or ABORTED,
            "outcome": state.outcome or "crashed",
            "time_to_train_s": None if t0 is None or t1 is None else (t1 - t0) / 1000.0,
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "steps": state.step,
            "tokens": state.step * self.schedule.tps,
            "samples": state.step * self.schedule.gbs,
            "skipped_evals": self.schedule.skip,
            "seed": self.cfg.train.seed,
            "benchmark": self.cfg.bench.benchmark,
            "evals": evals,
            "reason": state.reason,
            "error": state.error,
            "target_eval_loss": self.cfg.train.target_eval_loss,
        }


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(dumps_strict(data, indent=2) + "\n")  # strict JSON: a NaN loss is null plus "non_finite"
        tmp.replace(path)  # atomic: a reader never sees half a result
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written result.json.tmp behind
        raise
