"""Pretraining runs to a token budget (`sim.pretrain`, `predict/plan --tokens`): token counts, batch ramps, the
run's days, throughput and MFU from the same step `predict` prices, and the MLPerf output left as it was."""

import json
import math
from dataclasses import replace

import pytest

from scaletrain.cli.main import main
from scaletrain.sim.predict import predict
from scaletrain.sim.pretrain import (
    RampStage,
    layout_of,
    parse_ramp,
    price_pretraining,
    stage_tokens,
)
from scaletrain.sim.workload import ClusterLayout, load_workload

GPT3 = ClusterLayout(gpus=1024, tp=4, pp=8, vp=12, gbs=1024, fp8=True, bf16_grads=True)


@pytest.mark.parametrize("text", ["-5", "nan", "inf", "1e20", "12X", "", "T", "0"])
def test_a_bad_token_count_is_one_line_naming_the_flag(capsys, text):
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--model", "llama31-8b", "--gpus", "64", "--gbs", "512", "--tokens", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--tokens" in err[-1] and sum("error" in line for line in err) == 1


def test_ramp_stages_and_their_tokens():
    ramp = parse_ramp("3072@0, 9216@200B ,15360@469B")
    assert ramp == (RampStage(3072, 0.0), RampStage(9216, 2e11), RampStage(15360, 4.69e11))
    assert stage_tokens(14.8e12, ramp) == pytest.approx([2e11, 2.69e11, 14.8e12 - 4.69e11])
    # A budget that ends inside the ramp trains nothing in the later stages.
    assert stage_tokens(1e11, ramp) == pytest.approx([1e11, 0.0, 0.0])


@pytest.mark.parametrize("text", ["3072@1B,15360@469B", "3072@0,15360@0", "x@0", "3072", "0@0", "3072@0,15360@-1B"])
def test_a_bad_ramp_is_one_line(text):
    with pytest.raises(ValueError, match="--gbs-ramp") as exc:
        parse_ramp(text)
    assert "\n" not in str(exc.value)


def test_the_run_is_its_steps_at_the_step_predict_prices():
    w = load_workload("gpt3-175b")
    step = predict(w, GPT3, "h100").step_time_s
    main_pred, run = price_pretraining(w, GPT3, 300e9, "h100")
    steps = math.ceil(300e9 / (1024 * 2048))  # whole steps: the last one fills the budget up
    assert main_pred.step_time_s == pytest.approx(step)
    assert run.steps == steps
    assert run.train_s == pytest.approx(steps * step)
    assert run.days == pytest.approx(steps * step / 86400)
    assert run.tokens_per_s == pytest.approx(1024 * 2048 / step)
    assert run.mfu == pytest.approx(main_pred.mfu)  # one stage: the run's MFU is the step's
    # No MLPerf run in a pretraining prediction; the step and its breakdown are the MLPerf prediction's.
    assert main_pred.time_to_train_min is None and main_pred.steps is None
    assert run.step_breakdown == pytest.approx(predict(w, GPT3, "h100").breakdown)


def test_a_ramp_prices_each_stage_at_its_own_batch():
    w = load_workload("gpt3-175b")
    ramp = (RampStage(512, 0.0), RampStage(1024, 50e9))
    _, run = price_pretraining(w, GPT3, 300e9, "h100", ramp=ramp)
    small = predict(w, replace(GPT3, gbs=512), "h100").step_time_s
    big = predict(w, GPT3, "h100").step_time_s
    expect = math.ceil(50e9 / (512 * 2048)) * small + math.ceil(250e9 / (1024 * 2048)) * big
    assert run.train_s == pytest.approx(expect)
    assert [s.gbs for s in run.stages] == [512, 1024]
    # The smaller batch runs fewer micro-batches through the same pipeline: a bigger bubble, a lower MFU.
    assert run.stages[0].mfu < run.stages[1].mfu
    assert run.stages[0].mfu < run.mfu < run.stages[1].mfu


def test_a_ramp_stage_the_layout_cannot_run_makes_the_run_infeasible():
    w = load_workload("gpt3-175b")
    # 128 sequences over dp = 32 is 4 micro-batches, fewer than the 8 pipeline stages.
    _, run = price_pretraining(w, GPT3, 300e9, "h100", ramp=(RampStage(128, 0.0), RampStage(1024, 1e9)))
    assert not run.feasible and run.days is None
    assert any(r.startswith("GBS 128: ") for r in run.reasons)


def test_layout_of_gives_back_the_layout_predict_priced():
    w = load_workload("llama31-405b")
    for gpu, lay in (
        ("h100", ClusterLayout(gpus=8192, tp=8, pp=8, vp=8, gbs=1024, fp8=True, bf16_grads=True)),
        ("h100", ClusterLayout(gpus=8192, tp=8, pp=16, gbs=1024, pp_first_layers=3, pp_last_layers=11)),
        ("b200", ClusterLayout(gpus=512, tp=4, cp=2, gbs=64, fp8=True, fp4=True, fp4_healing_step=100)),
    ):
        p = predict(w, lay, gpu, mlperf_run=False)
        again = predict(w, layout_of(p), gpu, mlperf_run=False)
        assert not p.reasons or p.reasons[0].startswith("needs")  # priced (only memory may refuse it)
        assert again.layout == p.layout and again.step_time_s == p.step_time_s


def test_predict_tokens_json_adds_keys_only(capsys):
    base = ["predict", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "4", "--pp", "8", "--vp", "12"]
    base += ["--gbs", "1024", "--fp8", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--tokens", "300B"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(plain) <= set(doc) and set(doc) - set(plain) == {"pretraining"}
    assert doc["step_time_s"] == plain["step_time_s"] and doc["time_to_train_min"] is None
    run = doc["pretraining"]
    assert run["tokens"] == 3e11 and run["days"] == pytest.approx(run["train_s"] / 86400)
    assert run["steps"] == math.ceil(3e11 / (1024 * 2048))


def test_predict_tokens_text_and_seq(capsys):
    argv = ["predict", "--model", "llama31-8b", "--gpus", "64", "--tp", "1", "--gbs", "512", "--tokens", "1T"]
    assert main([*argv, "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "pretraining 1T tokens of 4,096:" in out and "days without failures" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--seq", "4096"], "--seq and --gbs-ramp need --tokens"),
        (["--tokens", "1T", "--gbs-ramp", "256@0,512@1B"], "give --gbs or --gbs-ramp, not both"),
        (["--pue", "1.2"], "--pue needs --tokens"),
        (["--async-checkpoint", "--relaunch-min", "3"], "--async-checkpoint, --relaunch-min need --tokens"),
    ],
)
def test_token_flag_errors_are_one_line(capsys, extra, message):
    argv = ["predict", "--model", "llama31-8b", "--gpus", "64", "--gbs", "512", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_tokens_ranks_by_the_run(capsys):
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gbs", "1024", "--tokens", "300B", "--top", "3"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    days = [d["pretraining"]["days"] for d in doc]
    assert len(doc) == 3 and days == sorted(days) and all(d["time_to_train_min"] is None for d in doc)
    assert main(argv[:-6] + ["--tokens", "300B"]) == 2  # no batch: the search keeps the batch it is given
    assert "needs --gbs or --gbs-ramp" in capsys.readouterr().err
