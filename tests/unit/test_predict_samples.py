"""`predict --samples N`: a run predicted with its own convergence instead of the RCP mean."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli.main import main

RECORD = ["--model", "llama2-70b-lora", "--gpu", "h200", "--gpus", "512", "--node", "nd-h200-v5", "--gbs", "64"]
RECORD += ["--tp", "4", "--cp", "2", "--fp8", "--calibration", "v4.1", "--json"]


def _predict(capsys, *argv: str) -> dict:
    assert main(["predict", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_samples_set_the_steps_and_evaluations(capsys):
    default = _predict(capsys, *RECORD)
    own = _predict(capsys, *RECORD, "--samples", "7440")
    # 7,440 samples at GBS 64 = 116.25 steps; LoRA evaluates every 384 samples (6 steps) after skipping the first
    # 3,072 samples' evaluations, so the run stops at the evaluation after step 117: step 120, the 10th timed one.
    assert (own["steps"], own["evals"]) == (120, 10)
    assert own["steps"] != default["steps"] and own["step_time_s"] == default["step_time_s"]
    evals_s = (own["evals"] - 1) * own["eval_time_s"] + own["eval_first_s"]
    minutes = (own["warmup_s"] + own["steps"] * own["step_time_s"] + evals_s) / 60
    assert own["time_to_train_min"] == pytest.approx(minutes, rel=1e-12)
    assert set(own) == set(default)  # the same keys: --json is an interface


def test_gpt3_samples_are_sequences_of_its_length(capsys):
    # The v3.0 512-GPU runs converged at 1,207,959,552 tokens = 589,824 sequences of 2,048: 288 steps at GBS 2048.
    argv = ["--model", "gpt3-175b", "--gpu", "h100", "--gpus", "512", "--gbs", "2048", "--tp", "4", "--pp", "8"]
    p = _predict(capsys, *argv, "--vp", "12", "--fp8", "--calibration", "v3.0", "--samples", "589824", "--json")
    assert p["steps"] == 288


@pytest.mark.hostile
def test_samples_need_a_benchmark_model(capsys):
    assert main(["predict", "--model", "llama2-70b", "--gpus", "64", "--gbs", "64", "--samples", "100"]) == 2
    err = capsys.readouterr().err
    assert "--samples needs an MLPerf benchmark's model" in err and err.count("\n") == 1


@pytest.mark.hostile
@pytest.mark.parametrize("value", ["0", "-5", "1e3", "nan"])
def test_a_bad_sample_count_is_one_line(capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["predict", "--model", "gpt3-175b", "--gpus", "512", "--samples", value])
    assert e.value.code == 2
    assert "argument --samples" in capsys.readouterr().err
