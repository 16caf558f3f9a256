"""Issue 28: each term fitted on its own measurement (evaluation and one-off seconds per software release, the
recipe's pauses), the attention block-length roll-off and the evaluation's host floor."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from scaletrain.sim import compute
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.efficiency import Efficiency, efficiency_for, pauses, with_run_terms
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.results import bundled_results
from scaletrain.sim.predict import eval_forward_s, predict
from scaletrain.sim.workload import ClusterLayout, load_workload


@pytest.fixture(scope="module")
def rows():
    ready, _ = cal.prepare([r for r in bundled_results() if r.benchmark in ("llama31_8b", "llama2_70b_lora")])
    return ready


@pytest.fixture(scope="module")
def fitted(rows):
    sets = cal.FittedSets({r.set: replace(Efficiency(), **cal.NOT_FITTED) for r in rows})
    return cal.fit_run_terms(rows, sets)


def test_one_off_is_the_median_of_the_release_logs(rows, fitted):
    group = [r for r in rows if r.bench == "llama2_70b_lora" and r.terms.software == "NeMo 24.09"]
    assert len(group) > 5
    got = fitted.run_terms["llama2_70b_lora"]["software"]["NeMo 24.09"]
    assert got["one_off_s"] == pytest.approx(max(0.0, statistics.median(r.terms.one_off_s for r in group)))
    assert got["eval_first_extra_s"] == pytest.approx(
        max(0.0, statistics.median(r.terms.first_eval_s - r.terms.eval_s for r in group))
    )
    assert got["rows"] == len(group)


def test_the_recipe_pause_is_split_from_the_start_up(rows, fitted):
    # llama31_8b's runs past step 10,000 pay ~40 s of garbage collection; the others pay ~0 at start-up.
    got = fitted.run_terms["llama31_8b"]["software"]["NeMo 25.09"]
    assert 30 < got["pause_s"] < 50
    assert got["one_off_s"] < 5
    assert pauses("llama31_8b", 9_999) == 0 and pauses("llama31_8b", 10_752) == 1
    assert pauses("llama2_70b_lora", 50_000) == 0


def test_each_round_defaults_to_the_software_most_of_its_rows_ran(fitted):
    default = fitted.run_terms["llama2_70b_lora"]["default"]
    assert default["v4.1"] == "NeMo 24.09"
    label, eff = with_run_terms(Efficiency(), fitted.run_terms, "llama2_70b_lora", "v4.1", "hopper")
    assert label == "NeMo 24.09"
    assert eff.one_off_s == fitted.run_terms["llama2_70b_lora"]["software"][label]["one_off_s"]
    # An asked-for label wins; an unknown one falls back to the round's.
    other, _ = with_run_terms(Efficiency(), fitted.run_terms, "llama2_70b_lora", "v4.1", "hopper", "NeMo 25.09")
    assert other == "NeMo 25.09"
    assert with_run_terms(Efficiency(), fitted.run_terms, "llama2_70b_lora", "v4.1", "hopper", "nope")[0] == label
    # A model that is no benchmark has no run terms.
    assert with_run_terms(Efficiency(), fitted.run_terms, None, "v4.1", "hopper") == (None, Efficiency())


def test_predict_json_adds_one_off_and_first_evaluation():
    w = load_workload("llama2-70b-lora")
    lay = ClusterLayout(gpus=8, tp=1, cp=1, mbs=1, gbs=8, fp8=True, sp=False)
    p = predict(w, lay, "h100", calibration="v4.1").to_dict()
    assert p["one_off_s"] > 0 and p["eval_first_s"] >= p["eval_time_s"]
    total = p["warmup_s"] + p["steps"] * p["step_time_s"] + (p["evals"] - 1) * p["eval_time_s"] + p["eval_first_s"]
    assert p["time_to_train_min"] == pytest.approx(total / 60)


def test_attention_rate_rolls_off_with_the_block_length():
    gpu = load_catalog().gpu("h100")
    assert compute.attention_rate(gpu, compute.ATTN_CEILING_KEYS) == pytest.approx(gpu.attn_tflops)
    assert compute.attention_rate(gpu, 1024) < 0.6 * gpu.attn_tflops
    # A context-parallel rank runs the same FLOPs in blocks of seq/cp keys: slower per FLOP.
    w = load_workload("llama2-70b-lora")
    one = compute.layer_times(w, ClusterLayout(gpus=1, mbs=1, gbs=1), gpu, 0.8)
    cp4 = compute.layer_times(w, ClusterLayout(gpus=4, cp=4, mbs=1, gbs=1), gpu, 0.8)
    assert 4 * cp4.attn_fwd > 1.2 * one.attn_fwd


def test_an_evaluation_forward_is_at_least_its_host_launch_time():
    w = load_workload("llama2-70b-lora")
    lay = ClusterLayout(gpus=16, pp=2, mbs=1, gbs=8)
    eff = replace(Efficiency(), eval_host_layer_s=0.004)
    assert eval_forward_s(w, lay, 0.01, eff) == pytest.approx(40 * 0.004)
    assert eval_forward_s(w, lay, 1.0, eff) == pytest.approx(1.0)
    assert math.isclose(eval_forward_s(w, lay, 0.01, Efficiency()), 0.01)


def test_data_parallel_scale_out_is_almost_free_as_in_the_logs():
    # NVIDIA's H100 TP4 CP2 LoRA logs: 0.541 s per step at 64 GPUs, 0.545 s at 1,024 (issue 28); the shipped sets
    # must not grow the step with the GPU count (no straggler or per-doubling synchronisation term).
    w = load_workload("llama2-70b-lora")
    steps = [
        predict(w, ClusterLayout(gpus=n, tp=4, cp=2, mbs=1, gbs=n // 8, fp8=True, bf16_grads=True), "h100").step_time_s
        for n in (64, 1024)
    ]
    assert steps[1] / steps[0] - 1 < 0.02
    eff = efficiency_for(None, "h100", "llama2_70b_lora")[1]
    assert eff.straggler_cv == 0 and eff.sync_log2_s == 0 and eff.fabric_sync_s > 0


def test_tp_exposure_grows_when_the_gemms_are_too_short_to_hide_it():
    from scaletrain.sim import step as step_mod
    from scaletrain.sim.comm import Cluster

    cat = load_catalog()
    g, n, f = cat.system("h100")
    w = load_workload("llama2-70b-lora")
    eff = replace(Efficiency(), tp_exposed=0.3)

    def exposed_fraction(mbs: int, cp: int) -> float:
        lay = ClusterLayout(gpus=8 * cp, tp=8, cp=cp, mbs=mbs, gbs=mbs, sp=True)
        cl = Cluster(g, n, f, lay.gpus)
        _, _, exposed = step_mod.stage_costs(w, lay, cl, eff)
        comm = step_mod._tp_comm(w, lay, cl)
        return exposed["tp"] / (w.shape.layers * 2 * comm)

    # Long GEMMs hide all they may (1 - tp_exposed); a CP8 shard's GEMMs are shorter than the TP8 collectives.
    assert exposed_fraction(1, 1) == pytest.approx(0.3)
    assert exposed_fraction(1, 8) > 0.3


def test_a_user_efficiency_file_brings_its_own_run_terms(tmp_path, monkeypatch):
    import json

    from scaletrain.sim.efficiency import load_efficiencies

    doc = load_efficiencies()
    doc["run_terms"]["llama2_70b_lora"]["software"]["NeMo 24.09"]["one_off_s"] = 99.0
    path = tmp_path / "eff.json"
    path.write_text(json.dumps({k: doc[k] for k in ("sets", "sku_gemm", "benchmarks", "run_terms")}))
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", str(path))
    w = load_workload("llama2-70b-lora")
    lay = ClusterLayout(gpus=8, tp=1, cp=1, mbs=1, gbs=8, fp8=True, sp=False)
    assert predict(w, lay, "h100", calibration="v4.1").one_off_s == 99.0
