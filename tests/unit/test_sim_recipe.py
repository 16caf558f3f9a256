"""Recipe options of a priced run: the FP4 healing step (steps after it at the FP8 rate) and FP8 attention."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scaletrain import benchmarks
from scaletrain.cli.main import main
from scaletrain.sim import compute, mlperf
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.predict import predict
from scaletrain.sim.workload import ClusterLayout, load_workload, with_recipe

LORA = "llama2-70b-lora"
# NVIDIA's v5.1 GB300 FP4 LoRA shape (config_GB300_2x4x1xtp1pp1cp1_fp4.sh: 8 GPUs, CP1, MBS 1, so GBS 8).
FP4_GB300 = ClusterLayout(gpus=8, gbs=8, fp8=True, fp4=True, bf16_grads=True)


@pytest.fixture(scope="module")
def lora():
    return load_workload(LORA)


# ---------------------------------------------------------------- the split
def test_no_switch_keeps_every_step_and_evaluation_in_fp4():
    s = mlperf.healing_split(400.0, 6.0, 0, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4, s.evals_fp8) == (400.0, 0.0, 6.0, 0.0)


def test_a_run_that_stops_before_the_healing_step_never_switches():
    s = mlperf.healing_split(336, 4, 350, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4, s.evals_fp8) == (336, 0.0, 4, 0.0)


def test_the_switch_inside_a_run_splits_steps_and_evaluations():
    # GBS 8: evaluations every 48 steps, the first 3 skipped, so the timed ones follow steps 192, 240, ..., 432.
    # Steps 1-350 are FP4; the evaluations after steps 192-336 (4) are too, those after 384 and 432 (2) are FP8.
    s = mlperf.healing_split(432, 6, 350, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4, s.evals_fp8) == (350, 82, 4, 2)
    # An evaluation right after the healing step still runs at the precision of the step before it.
    s = mlperf.healing_split(400, 6, 336, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4, s.evals_fp8) == (336, 64, 4, 2)
    # Fractional (expected) runs split the same way.
    s = mlperf.healing_split(397.5, 5.28, 350, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4) == (350, 47.5, 4)
    assert s.evals_fp8 == pytest.approx(1.28)


def test_a_switch_before_the_first_evaluation_makes_every_evaluation_fp8():
    s = mlperf.healing_split(432, 6, 100, 48, 3)
    assert (s.steps_fp4, s.steps_fp8, s.evals_fp4, s.evals_fp8) == (100, 332, 0, 6)


@pytest.mark.hostile
@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_a_bad_healing_step_is_refused(step):
    with pytest.raises(ValueError, match="healing_step"):
        mlperf.healing_split(432, 6, step, 48, 3)
    assert any("fp4_healing_step" in p for p in replace(FP4_GB300, fp4_healing_step=step).problems(load_workload(LORA)))


# ---------------------------------------------------------------- predict with the switch
def test_the_lora_recipe_switches_fp4_runs_at_step_350():
    assert benchmarks.get("llama2_70b_lora").fp4_healing_step == 350
    assert with_recipe(FP4_GB300, "llama2_70b_lora").fp4_healing_step == 350
    assert with_recipe(FP4_GB300, None).fp4_healing_step == 0  # a model that is no benchmark has no recipe
    assert with_recipe(replace(FP4_GB300, fp4_healing_step=0), "llama2_70b_lora").fp4_healing_step == 0


def test_steps_after_the_healing_step_are_priced_at_the_fp8_rate(lora):
    p = predict(lora, FP4_GB300, "gb300", calibration="v5.1")
    fp8 = predict(lora, replace(FP4_GB300, fp4=False), "gb300", calibration="v5.1")
    assert p.feasible and p.healing_step == 350 and p.layout["fp4_healing_step"] == 350
    # The post-switch step is the FP8 layout's, slower than FP4's (the v5.1 logs: 1.31-2.04x).
    assert p.step_time_post_switch_s == pytest.approx(fp8.step_time_s, rel=1e-12)
    assert p.step_time_post_switch_s > p.step_time_s
    assert (
        p.eval_time_post_switch_s == pytest.approx(fp8.eval_time_s, rel=1e-12)
        and p.eval_time_post_switch_s > p.eval_time_s
    )
    assert p.steps_post_switch == pytest.approx(p.steps - 350)
    s = mlperf.healing_split(p.steps, p.evals, 350, 48, 3)
    assert p.evals_post_switch == pytest.approx(s.evals_fp8) and s.evals_fp8 > 0
    minutes = (
        p.warmup_s
        + 350 * p.step_time_s
        + p.steps_post_switch * p.step_time_post_switch_s
        + s.evals_fp4 * p.eval_time_s
        + s.evals_fp8 * p.eval_time_post_switch_s
        + (p.eval_first_s - p.eval_time_s)
    ) / 60
    assert p.time_to_train_min == pytest.approx(minutes, rel=1e-12)
    assert sum(p.phases_min.values()) == pytest.approx(p.time_to_train_min, rel=1e-12)
    assert sum(p.ttt_breakdown.values()) == pytest.approx(p.time_to_train_min, rel=1e-12)


def test_healing_step_0_is_the_all_fp4_price(lora):
    p = predict(lora, replace(FP4_GB300, fp4_healing_step=0), "gb300", calibration="v5.1")
    switched = predict(lora, FP4_GB300, "gb300", calibration="v5.1")
    assert p.healing_step == 0 and p.step_time_post_switch_s is None and p.steps_post_switch is None
    assert p.step_time_s == switched.step_time_s
    minutes = (p.warmup_s + p.steps * p.step_time_s + (p.evals - 1) * p.eval_time_s + p.eval_first_s) / 60
    assert p.time_to_train_min == pytest.approx(minutes, rel=1e-12)
    assert p.time_to_train_min < switched.time_to_train_min


# ---------------------------------------------------------------- FP8 attention
def test_fp8_attention_runs_the_attention_core_at_the_fp8_rate(lora):
    gpu = load_catalog().gpu("h100")
    fp8 = ClusterLayout(gpus=8, tp=4, gbs=8, fp8=True)
    assert compute.attention_tflops(gpu, fp8) == gpu.attn_tflops
    assert compute.attention_tflops(gpu, replace(fp8, fp8_attention=True)) == gpu.attn_fp8_tflops > gpu.attn_tflops
    # bf16 layouts keep bf16 attention whatever the flag says (and `problems` refuses the combination).
    bf16 = replace(fp8, fp8=False, fp8_attention=True)
    assert compute.attention_tflops(gpu, bf16) == gpu.attn_tflops
    assert any("fp8_attention needs fp8" in p for p in bf16.problems(lora))
    base = compute.layer_times(lora, fp8, gpu, 0.8)
    fast = compute.layer_times(lora, replace(fp8, fp8_attention=True), gpu, 0.8)
    launch = 2 * fp8.cp * gpu.kernel_us * 1e-6
    assert (fast.attn_fwd - launch) / (base.attn_fwd - launch) == pytest.approx(gpu.attn_tflops / gpu.attn_fp8_tflops)
    assert fast.gemm_fwd == base.gemm_fwd and fast.fwd < base.fwd and fast.bwd < base.bwd


def test_a_gpu_without_an_fp8_attention_rate_keeps_bf16_attention():
    gpu = load_catalog().gpu("mi355x")
    assert gpu.attn_fp8_tflops == 0
    lay = ClusterLayout(gpus=8, gbs=8, fp8=True, fp8_attention=True)
    assert compute.attention_tflops(gpu, lay) == gpu.attn_tflops


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


H100_LORA = ["predict", "--model", LORA, "--gpu", "h100", "--gpus", "8", "--tp", "4", "--gbs", "8", "--json"]


def test_predict_fp8_attention_defaults_to_the_reference_recipe(capsys):
    # The MLCommons reference trains llama2_70b_lora in bf16 with bf16 flash attention: the default is no FP8
    # attention, the same price as --no-fp8-attention; --fp8-attention is faster.
    default = json.loads(_cli(capsys, *H100_LORA, "--fp8")[1])
    off = json.loads(_cli(capsys, *H100_LORA, "--fp8", "--no-fp8-attention")[1])
    on = json.loads(_cli(capsys, *H100_LORA, "--fp8", "--fp8-attention")[1])
    assert benchmarks.get("llama2_70b_lora").fp8_attention is False
    assert "fp8_attention" not in default["layout"] and default["step_time_s"] == off["step_time_s"]
    assert on["layout"]["fp8_attention"] is True and on["step_time_s"] < off["step_time_s"]
    assert on["time_to_train_min"] < off["time_to_train_min"]
    assert set(on) == set(off)  # --json keeps its keys


@pytest.mark.hostile
@pytest.mark.parametrize(
    "extra, said",
    [
        (["--fp8-attention"], "--fp8-attention needs --fp8"),
        (["--fp4-healing-step", "100"], "--fp4-healing-step needs --fp4"),
        (["--fp4", "--fp4-healing-step", "-1"], "argument --fp4-healing-step"),
        (["--fp4", "--fp4-healing-step", "1.5"], "argument --fp4-healing-step"),
        (["--fp4", "--fp4-healing-step", "x"], "argument --fp4-healing-step"),
    ],
)
def test_bad_recipe_flags_are_one_line(capsys, extra, said):
    code, out, err = _cli(capsys, *H100_LORA, *extra)
    assert code == 2 and out == "" and said in err and err.count("\n") == 1


def test_plan_takes_the_recipe_flags(capsys):
    argv = ["plan", "--model", LORA, "--gpu", "gb300", "--gpus", "8", "--gbs", "8", "--fp4", "--top", "1", "--json"]
    base = json.loads(_cli(capsys, *argv)[1])[0]
    fast = json.loads(_cli(capsys, *argv, "--fp8-attention", "--fp4-healing-step", "0")[1])[0]
    assert base["healing_step"] == 350 and base["step_time_post_switch_s"] > base["step_time_s"]
    assert fast["healing_step"] == 0 and fast["layout"]["fp8_attention"] is True
    assert fast["time_to_train_min"] < base["time_to_train_min"]
