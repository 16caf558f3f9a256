"""The zero-bubble schedule (ZB-H1) priced by `predict`: weight gradients deferred into the bubble, 1F1B's memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scaletrain.sim import compute, step
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import efficiency_for
from scaletrain.sim.predict import predict
from scaletrain.sim.workload import ClusterLayout, load_workload

GPT3 = load_workload("gpt3")
CAT = load_catalog()
LAY = ClusterLayout(gpus=1024, tp=8, pp=8, gbs=512)


def test_zb_h1_fills_the_bubble_with_weight_gradients_at_1f1b_memory():
    one = predict(GPT3, replace(LAY, schedule="1f1b"), "h100", mlperf_run=False)
    zb = predict(GPT3, replace(LAY, schedule="zb_h1"), "h100", mlperf_run=False)
    assert zb.breakdown["compute"] == pytest.approx(one.breakdown["compute"])
    # ZB-H1 idles (p-1)(T_F + T_B - T_W) where 1F1B idles (p-1)(T_F + T_B + T_W) (Qi et al. 2023), with T_B + T_W
    # this model's backward b and T_W the weight-gradient GEMMs w: the ratio (f + b - 2w) / (f + b) of one stage.
    g, n, f = CAT.system("h100")
    _, eff = efficiency_for(None, "h100", "gpt3", CAT)
    cl = Cluster(g, n, f, LAY.gpus)
    fwd, bwd, _ = step.stage_costs(GPT3, LAY, cl, eff)
    w = step.wgrad_costs(GPT3, LAY, cl, eff)[3][0]
    expect = (fwd[3][0] + bwd[3][0] - 2 * w) / (fwd[3][0] + bwd[3][0])
    assert zb.breakdown["pp_bubble"] / one.breakdown["pp_bubble"] == pytest.approx(expect, rel=0.02)
    assert zb.step_time_s < one.step_time_s
    assert zb.memory_gib_per_gpu == pytest.approx(one.memory_gib_per_gpu)


def test_weight_gradients_are_the_trained_gemms_half_of_their_backward():
    _, eff = efficiency_for(None, "h100", "gpt3", CAT)
    lt = compute.layer_times(GPT3, LAY, CAT.gpu("h100"), eff.gemm_eff)
    assert lt.gemm_wgrad == pytest.approx(lt.gemm_bwd / 2)  # every GPT-3 GEMM is trained
    lora = load_workload("llama2_70b_lora")
    lt = compute.layer_times(lora, ClusterLayout(gpus=8, tp=8, gbs=8), CAT.gpu("h100"), eff.gemm_eff)
    assert 0 < lt.gemm_wgrad < 0.05 * lt.gemm_bwd  # the frozen base has none; only the adapters' are left


def test_zb_h1_closed_form_is_near_the_event_simulation():
    g, n, f = CAT.system("h100")
    _, eff = efficiency_for(None, "h100", "gpt3", CAT)
    lay = replace(LAY, schedule="zb_h1")
    cl = Cluster(g, n, f, lay.gpus)
    event, closed = step.step_time(GPT3, lay, cl, eff), step.step_time(GPT3, lay, cl, eff, event=False)
    assert closed.step_time_s == pytest.approx(event.step_time_s, rel=0.03)


def test_zb_h1_runs_one_chunk_per_rank():
    reasons = replace(LAY, vp=2, gbs=512, schedule="zb_h1").problems(GPT3)
    assert any("vp=2 needs the interleaved_1f1b schedule" in r for r in reasons)
