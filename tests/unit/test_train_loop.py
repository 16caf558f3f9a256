"""The training loop on its own: hook order, result without observers, stop signals, and the saved loop state."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest

from scaletrain.bench.scripted import ScriptedEngine
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.config import resolve
from scaletrain.train.loop import run_loop
from scaletrain.train.protocol import Engine, Observer, Preempted
from scaletrain.train.state import LoopState


def _cfg(*overrides):
    # 32 steps per evaluation at GBS 32; the scripted losses below assume this target.
    return resolve("gpt3-proxy", overrides=["train.target_eval_loss=5.6", *overrides])


class Recorder(Observer):
    name = "rec"

    def __init__(self):
        self.calls = []

    def on_init_start(self, state, engine):
        self.calls.append(("init_start", state.resume is not None))

    def on_run_start(self, state, engine):
        self.calls.append(("run_start", state.step))

    def on_block_start(self, state, first, stop):
        self.calls.append(("block_start", first, stop))

    def on_step(self, state, out):
        self.calls.append(("step", state.step))

    def on_block_end(self, state, first, stop):
        self.calls.append(("block_end", first, stop))

    def on_eval_start(self, state):
        self.calls.append(("eval_start", state.step))

    def on_eval(self, state, record):
        self.calls.append(("eval", record["step"], record["eval_loss"]))

    def on_checkpoint(self, state):
        return {"saved_at": state.step}

    def on_run_end(self, state, result):
        self.calls.append(("run_end", result["outcome"]))
        return {"recorded": len(self.calls)}


class Saving(ScriptedEngine):
    """Saves into memory; SIGTERM after `signal_at`; resumes from `resume` (a trainer.json)."""

    def __init__(self, cfg, signal_at=None, resume=None, **kw):
        super().__init__(cfg, **kw)
        self.signal_at, self.resume, self.saved = signal_at, resume, []

    def resume_state(self):
        return self.resume

    def init(self):
        super().init()
        if self.resume:
            self.step = self.resume["step"]
            self.n_evals = len(self.resume["loop"]["evals"])

    def stop_signal(self):
        return int(signal.SIGTERM) if self.step == self.signal_at else 0

    def save_checkpoint(self, loop_state):
        self.saved.append({"step": self.step, "config": {}, "loop": json.loads(json.dumps(loop_state))})
        return f"ckpt_{self.step}"


def test_hooks_in_order_and_a_result_without_observer_fields(tmp_path):
    cfg = _cfg()
    engine, rec = ScriptedEngine(cfg, eval_losses=[6.0, 5.5], eval_tokens=4096), Recorder()
    assert isinstance(engine, Engine)
    result = run_loop(cfg, engine, tmp_path, [rec])
    assert result["outcome"] == "converged" and result["steps"] == 64 and result["recorded"] == 2 + 2 * 36 + 1
    block = lambda a, b: [("block_start", a, b), *[("step", s) for s in range(a + 1, b + 1)], ("block_end", a, b)]
    assert rec.calls == [
        ("init_start", False),
        ("run_start", 0),
        *block(0, 32),
        ("eval_start", 32),
        ("eval", 32, 6.0),
        *block(32, 64),
        ("eval_start", 64),
        ("eval", 64, 5.5),
        ("run_end", "converged"),
    ]
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk == result and "mllog" not in result and "rule_violations" not in result
    assert not (tmp_path / "mllog.txt").exists() and result["time_to_train_s"] >= 0


def test_a_signal_saves_mid_block_and_the_resume_finishes_that_block(tmp_path):
    cfg = _cfg()
    ref = run_loop(cfg, ScriptedEngine(cfg, eval_losses=[6.0, 5.5], eval_tokens=4096), tmp_path / "ref")
    stopped, rec = Saving(cfg, signal_at=40, eval_losses=[6.0, 5.5], eval_tokens=4096), Recorder()
    with pytest.raises(Preempted) as info:
        run_loop(cfg, stopped, tmp_path / "run", [rec])
    assert info.value.step == 40 and info.value.exit_code == 128 + signal.SIGTERM
    assert rec.calls[-1] == ("run_end", "preempted") and stopped.finished["status"] == "preempted"
    saved = stopped.saved[-1]["loop"]
    assert saved["block_first"] == 32 and saved["step"] == 40 and saved["observers"] == {"rec": {"saved_at": 40}}
    assert set(saved["last"]) == {"loss", "lr"} and [e["step"] for e in saved["evals"]] == [32]

    resumed, rec = Saving(cfg, resume=stopped.saved[-1], eval_losses=[6.0, 5.5], eval_tokens=4096), Recorder()
    result = run_loop(cfg, resumed, tmp_path / "run", [rec])
    # No second block_start for the open block; it ends where the uninterrupted run's did.
    assert rec.calls[:2] == [("init_start", True), ("run_start", 40)] and rec.calls[2] == ("step", 41)
    assert ("block_end", 32, 64) in rec.calls and not any(c[0] == "block_start" for c in rec.calls)
    keys = ("step", "eval_loss", "train_loss", "lr")
    assert [[e[k] for k in keys] for e in result["evals"]] == [[e[k] for k in keys] for e in ref["evals"]]
    assert result["steps"] == ref["steps"] == 64 and result["outcome"] == "converged"


def test_a_checkpoint_of_the_old_harness_format_still_resumes():
    harness = {
        "steps": 40,
        "evals": [{"step": 32}],
        "t_start": 1000,
        "mllog_bytes": 777,
        "block_first": 32,
        "last": {"loss": 3.0, "lr": 1e-3},
    }
    state = LoopState.restore({"step": 40, "config": {}, "harness": harness})
    assert (state.step, state.t_start, state.block_first, state.last) == (40, 1000, 32, {"loss": 3.0, "lr": 1e-3})
    assert state.observers == {"mlperf": {"mllog_bytes": 777}} and state.resume.info["harness"] is harness
    assert LoopState.restore({"step": 3, "config": {}, "harness": {}}) is None  # e.g. a proxy base: weights only
    assert LoopState.restore({"step": 3, "config": {}, "loop": {}}) is None
    again = LoopState.restore({"step": 40, "config": {}, "loop": state.saved()})
    assert again.saved() == state.saved()


@pytest.mark.parametrize(
    "loop, problem",
    [
        ({"step": 5, "evals": [], "t_start": 1, "last": {}, "observers": {}}, "differs from 'step' 4"),
        ({"step": 4, "evals": {}, "t_start": 1, "last": {}, "observers": {}}, "'evals'"),
        ({"step": 4, "evals": [], "t_start": -1, "last": {}, "observers": {}}, "'t_start'"),
        ({"step": 4, "evals": [], "t_start": 1, "last": {"loss": "x"}, "observers": {}}, "'last'"),
        ({"step": 4, "evals": [], "t_start": 1, "last": {}, "observers": []}, "'observers'"),
        ({"step": 4, "evals": [], "t_start": 1, "last": {}, "observers": {}, "block_first": 9}, "'block_first'"),
    ],
    ids=["step", "evals", "t_start", "last", "observers", "block_first"],
)
def test_a_malformed_loop_state_is_a_one_line_checkpoint_error(tmp_path, loop, problem):
    with pytest.raises(CheckpointError) as err:
        LoopState.restore({"step": 4, "config": {}, "loop": loop}, tmp_path)
    assert problem in str(err.value) and str(tmp_path / "trainer.json") in str(err.value) and "\n" not in str(err.value)


class FinalSaving(Saving):
    """Checkpoints on: the final step is saved unless already saved (as the Trainer does); each save takes `save_s`."""

    def __init__(self, cfg, save_s=0.0, fail=False, **kw):
        super().__init__(cfg, **kw)
        self.save_s, self.fail, self.save_ms = save_s, fail, []

    def final_checkpoint_due(self):
        last = self.saved[-1]["step"] if self.saved else (self.resume or {}).get("step")
        return last != self.step

    def save_checkpoint(self, loop_state):
        self.save_ms.append(time.time() * 1000)
        time.sleep(self.save_s)
        if self.fail:
            raise CheckpointError(f"checkpoint save at step {self.step} failed: ENOSPC (No space left on device)")
        return super().save_checkpoint(loop_state)


@pytest.mark.parametrize(
    "how, overrides, kw, saved_steps",
    [
        ("converged", [], {"eval_losses": [6.0, 5.5]}, [64]),
        ("budget_exhausted", ["train.max_steps=40"], {"eval_losses": [6.0]}, [40]),
        ("diverged", [], {"eval_losses": [6.0, math.nan]}, []),  # its weights are not worth a checkpoint
        ("preempted", [], {"eval_losses": [6.0, 5.5], "signal_at": 40}, [40]),  # the signal's save, not a second one
    ],
)
def test_the_final_step_is_saved_once_when_the_run_ends_on_its_own(tmp_path, how, overrides, kw, saved_steps):
    cfg = _cfg(*overrides)
    engine = FinalSaving(cfg, eval_tokens=4096, **kw)
    try:
        result = run_loop(cfg, engine, tmp_path)
    except Preempted:
        result = engine.finished
    assert result["outcome"] == how
    assert [s["step"] for s in engine.saved] == saved_steps
    if how in ("converged", "budget_exhausted"):
        final = engine.saved[-1]["loop"]
        assert final["step"] == result["steps"] and final["evals"] == result["evals"] and "block_first" not in final
        assert final["t_stop"] - final["t_start"] == pytest.approx(result["time_to_train_s"] * 1000)


def test_the_final_save_is_outside_the_mlperf_time_to_train(tmp_path):
    from scaletrain.bench.harness import run_once

    cfg = _cfg()
    engine = FinalSaving(cfg, save_s=0.5, eval_losses=[6.0, 5.5], eval_tokens=4096)
    result = run_once(cfg, engine, tmp_path)
    assert result["status"] == "success" and [s["step"] for s in engine.saved] == [64]
    assert result["time_to_train_s"] < 0.5  # the scripted steps are instant; the save's 0.5 s is not counted
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in (tmp_path / "mllog.txt").read_text().splitlines()]
    stop = [e for e in events if e["key"] == "run_stop"]
    assert len(stop) == 1 and stop[0]["time_ms"] <= engine.save_ms[0]  # run_stop is stamped before the save begins
    assert engine.saved[0]["loop"]["t_stop"] == stop[0]["time_ms"]
    # The checkpoint's log length ends after the last evaluation, before run_stop: a resume logs run_stop again.
    size = engine.saved[0]["loop"]["observers"]["mlperf"]["mllog_bytes"]
    head = (tmp_path / "mllog.txt").read_bytes()[:size].decode()
    assert '"eval_stop"' in head.splitlines()[-1] and '"run_stop"' not in head


def test_resuming_the_final_checkpoint_ends_the_run_the_same_and_a_larger_budget_trains_on(tmp_path):
    cfg = _cfg()
    first = FinalSaving(cfg, eval_losses=[6.0, 5.5], eval_tokens=4096)
    ref = run_loop(cfg, first, tmp_path / "a")
    again = FinalSaving(cfg, resume=first.saved[-1], eval_losses=[6.0, 5.5], eval_tokens=4096)
    result = run_loop(cfg, again, tmp_path / "b")  # e.g. killed after the final save, before result.json
    assert again.calls == ["init", "finish"] and again.saved == []  # nothing trained, evaluated or saved again
    for key in ("status", "outcome", "steps", "evals", "time_to_train_s", "reason"):
        assert result[key] == ref[key], key
    lower = _cfg("train.target_eval_loss=5.0")  # a lower target: the run goes on from its final checkpoint
    more = FinalSaving(lower, resume=first.saved[-1], eval_losses=[6.0, 5.5, 4.9], eval_tokens=4096)
    result = run_loop(lower, more, tmp_path / "c")
    assert result["outcome"] == "converged" and result["steps"] == 96 and [s["step"] for s in more.saved] == [96]


def test_a_failed_final_save_is_a_crash_recorded_in_the_result(tmp_path):
    cfg = _cfg()
    engine = FinalSaving(cfg, fail=True, eval_losses=[6.0, 5.5], eval_tokens=4096)
    with pytest.raises(CheckpointError, match="ENOSPC"):
        run_loop(cfg, engine, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "aborted" and result["outcome"] == "crashed" and "ENOSPC" in result["error"]
    assert result["time_to_train_s"] is not None and result["steps"] == 64


@pytest.mark.hostile
@pytest.mark.parametrize(
    "t_stop", ["soon", -1, 0.5, True, 0, [5]], ids=["str", "negative", "float", "bool", "before-start", "list"]
)
def test_a_malformed_final_stop_time_is_a_one_line_checkpoint_error(tmp_path, t_stop):
    loop = {"step": 4, "evals": [], "t_start": 100, "last": {}, "observers": {}, "t_stop": t_stop}
    with pytest.raises(CheckpointError) as err:
        LoopState.restore({"step": 4, "config": {}, "loop": loop}, tmp_path)
    assert "'t_stop'" in str(err.value) and "\n" not in str(err.value)
