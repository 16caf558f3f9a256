"""Profiling on demand in a real tiny run: the trace of the chosen steps, the same losses as without it, and a fake
W&B module that receives exactly the scalars TensorBoard got. Two 4-step runs of the tiny model, shared by the tests."""

from __future__ import annotations

import json
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train_e2e import read_jsonl, tiny_config

from scaletrain.train.run import train


class FakeWandbRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished = init, [], False

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.fixture(scope="module")
def runs(excerpt_corpus, tmp_path_factory):
    """(plain run dir, profiled run dir, the fake W&B runs): steps 2-3 profiled, W&B on, a CPU memory snapshot asked."""
    tmp = tmp_path_factory.mktemp("profiling")
    train(tiny_config(excerpt_corpus, tmp / "plain", "train.max_steps=4"))
    fake = types.ModuleType("wandb")
    fake.runs = []
    fake.init = lambda **kw: fake.runs.append(FakeWandbRun(**kw)) or fake.runs[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(__import__("sys").modules, "wandb", fake)
        extra = ["train.max_steps=4", "train.profile_steps=2-3", "train.memory_snapshot=true", "train.wandb_project=t"]
        train(tiny_config(excerpt_corpus, tmp / "profiled", *extra))
    return tmp / "plain", tmp / "profiled", fake.runs


def test_trace_holds_the_profiled_steps_only(runs):
    _, run, _ = runs
    files = sorted(p.name for p in (run / "profile").iterdir())
    assert files == ["trace_rank0_steps2-3.pt.trace.json"]  # no memory snapshot on the CPU (a warning said so)
    events = json.loads((run / "profile" / files[0]).read_text())["traceEvents"]
    steps = {
        int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events if "ProfilerStep#" in e["name"]
    }
    assert sorted(steps) == [2, 3]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" and e.get("args", {}).get("Input Dims") for e in ops)  # record_shapes
    # Every operator ran inside a profiled step: nothing of step 1, 4, the evaluation or the start-up.
    assert ops and all(any(lo <= e["ts"] <= hi for lo, hi in steps.values()) for e in ops)


def test_profiling_changes_no_result(runs):
    plain, profiled, _ = runs

    def numbers(run):
        return [
            (r["step"], r.get("loss"), r.get("grad_norm"), r.get("eval_loss"))
            for r in read_jsonl(run / "metrics.jsonl")
        ]

    assert numbers(profiled) == numbers(plain)
    assert len(numbers(plain)) == 6  # 4 steps, the evaluation at step 4 and the final save's checkpoint_s


def test_fake_wandb_gets_the_tensorboard_scalars(runs):
    _, run, fake_runs = runs
    (wb,) = fake_runs
    assert wb.finished and wb.init["project"] == "t" and wb.init["name"] == "profiled"
    assert wb.init["dir"] == str(run) and wb.init["config"]["train"]["profile_steps"] == "2-3"
    # Same (step, name, value) triples, duplicates included (the evaluation line repeats "tokens" at its step).
    got = sorted((step, key, value) for step, data in wb.logged for key, value in data.items())
    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    want = sorted((ev.step, tag, ev.value) for tag in tb.Tags()["scalars"] for ev in tb.Scalars(tag))
    assert {(4, "eval_loss"), (1, "loss"), (3, "tokens_per_s")} <= {(step, key) for step, key, _ in got}
    assert [(step, key) for step, key, _ in got] == [(step, key) for step, key, _ in want]
    for (_, _, value), (_, _, stored) in zip(got, want):
        assert value == pytest.approx(stored, rel=1e-6)  # TensorBoard stores float32
