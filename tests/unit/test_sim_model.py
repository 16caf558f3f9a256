"""The analytical performance model pinned against hand-computed values: FLOPs and parameters, recomputation, the
pipeline bubble inside a whole step, the step breakdown, and `predict` (collectives: test_sim_comm.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from scaletrain.config import resolve
from scaletrain.model import flops
from scaletrain.sim import compute, schedule, step
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.predict import predict
from scaletrain.sim.step import stage_costs, step_time
from scaletrain.sim.workload import ClusterLayout, load_workload

CAT = load_catalog()
GPT3 = load_workload("gpt3")
LLAMA = load_workload("llama2-70b")
LORA = load_workload("llama2_70b_lora")
EFF = Efficiency()
BREAKDOWN_KEYS = {
    "compute",
    "tp_exposed",
    "cp_exposed",
    "pp_bubble",
    "dp_exposed",
    "overlap_slowdown",
    "optimizer",
    "overhead",
    "sync",
    "straggler",
}


@pytest.fixture(autouse=True)
def _no_user_files(monkeypatch):
    """Only the shipped catalog and fitted efficiencies."""
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


def _cluster(gpus: int, gpu: str = "h100", node: str | None = None, fabric: str | None = None) -> Cluster:
    return Cluster(*CAT.system(gpu, node, fabric), gpus)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and parameters


def test_llama2_70b_parameter_count_is_hugging_faces():
    m = resolve("llama2-70b").model
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_size, m.padded_vocab) == (80, 8192, 64, 8, 28672, 32000)
    # meta-llama/Llama-2-70b-hf: 68,976,648,192 parameters (untied embedding and head, RMSNorm weights, no biases).
    assert flops.num_params(m) == 68_976_648_192
    assert LLAMA.inventory.params == 68_976_648_192
    # By hand: per layer Q,O 8192^2 each, K,V 8192x1024 each, SwiGLU 3 x 8192 x 28672, two norms.
    per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert 80 * per_layer + 8192 + 2 * 32000 * 8192 == 68_976_648_192
    assert flops.num_params(m, include_embeddings=False) == 80 * per_layer + 8192


def test_llama2_70b_training_flops_per_token_by_hand():
    n_l, h, s, V, kv, hd, f = 80, 8192, 4096, 32000, 8, 128, 28672
    layer_matmul = h * (h + 2 * kv * hd) + h * h + 3 * h * f  # fused QKV (GQA), output, gate+up+down
    assert LLAMA.inventory.layer_matrix_params == layer_matmul == 855_638_016
    fwd = 2 * layer_matmul * n_l + 2 * 2 * s * h * n_l + 2 * h * V  # GEMMs, full s^2 attention (QK^T, AV), logits
    assert fwd == 136_902_082_560 + 10_737_418_240 + 524_288_000 == 148_163_788_800
    m = resolve("llama2-70b").model
    assert flops.flops_per_token(m) == pytest.approx(3 * fwd, rel=1e-15)
    assert LLAMA.flops_per_token == pytest.approx(3 * fwd, rel=1e-15)
    assert 3 * fwd == 444_491_366_400  # ~6.44 x N: 6N = 4.139e11 plus attention and the untied head
    parts = flops.forward_flops_per_token(m)
    assert parts == {"gemm": 2.0 * layer_matmul * n_l, "attn": 4.0 * s * h * n_l, "logits": 2.0 * h * V}
    # A different sequence length only moves the attention term.
    assert flops.flops_per_token(m, seq_len=8192) - flops.flops_per_token(m) == pytest.approx(3 * 4 * 4096 * h * n_l)


def test_gpt3_flops_are_the_72_l_h2_closed_form():
    n_l, h, s, V = 96, 12288, 2048, 51200
    closed = 72 * n_l * h * h * (1 + s / (6 * h) + V / (12 * n_l * h))
    assert GPT3.flops_per_token == pytest.approx(closed, rel=1e-12)
    assert GPT3.flops_per_token == pytest.approx(1.0764e12, rel=1e-4)
    assert GPT3.inventory.layer_matrix_params == 12 * h * h


def test_lora_adapter_count_by_hand():
    m = resolve("llama2-70b-lora").model
    h, kv, hd, r, n_l = 8192, 8, 128, 16, 80
    per_layer = r * (h + (h + 2 * kv * hd)) + r * (h + h)  # qkv: h -> h + 2*kv*hd; proj: h -> h
    assert per_layer == 557_056
    assert flops.lora_params(m, 16, ("qkv", "proj")) == n_l * per_layer == 44_564_480
    assert LORA.inventory.trainable_params == 44_564_480
    assert LORA.inventory.params == 68_976_648_192
    assert flops.lora_params(m, 0) == 0
    # Other targets: fc1 is gate+up (h -> 2f), fc2 f -> h.
    f = 28672
    assert flops.lora_params(m, 8, ("fc1",)) == n_l * 8 * (h + 2 * f)
    assert flops.lora_params(m, 8, ("fc2",)) == n_l * 8 * (f + h)


def test_lora_flops_per_token():
    m = resolve("llama2-70b-lora").model
    n_l, h, s, V = 80, 8192, 8192, 32000
    gemm = 2.0 * 855_638_016 * n_l
    attn = 2.0 * 2 * s * h * n_l
    logits = 2.0 * h * V
    adapters = 44_564_480
    # Frozen base: GEMMs and logits need only input gradients (2x forward), attention keeps 3x, adapters train (6x).
    expected = 2 * (gemm + logits) + 3 * attn + 6 * adapters
    assert flops.flops_per_token(m, lora_rank=16) == pytest.approx(expected, rel=1e-15)
    assert LORA.flops_per_token == pytest.approx(expected, rel=1e-15)
    assert LORA.seq_len == 8192
    # Cheaper than full training of the same model at the same length, by exactly gemm + logits - 6 * adapters.
    full = flops.flops_per_token(m)
    assert full - LORA.flops_per_token == pytest.approx(gemm + logits - 6 * adapters, rel=1e-12)


def test_layer_gemms_carry_exactly_the_counted_flops():
    """compute.layer_gemms (what the simulator times) and model.flops (what MFU counts) agree GEMM by GEMM."""
    for w in (GPT3, LLAMA):
        tokens = w.seq_len
        base = sum(2 * m_ * n * k for m_, n, k in compute.layer_gemms(w, ClusterLayout(gpus=1)))
        assert base == pytest.approx(w.forward_flops["gemm"] / w.shape.layers * tokens, rel=1e-12)
        for t in (2, 4, 8):
            sharded = sum(2 * m_ * n * k for m_, n, k in compute.layer_gemms(w, ClusterLayout(gpus=t, tp=t)))
            assert sharded * t == pytest.approx(base, rel=1e-12)
    # LoRA adapters on qkv and proj: 2 FLOPs per adapter parameter per token on top of the base GEMMs.
    gemms = compute.layer_gemms(LORA, ClusterLayout(gpus=1))
    assert len(gemms) == 4 + 2 * 2
    adapter = sum(2 * m_ * n * k for m_, n, k in gemms[4:])
    assert adapter == pytest.approx(2 * LORA.seq_len * LORA.inventory.trainable_params / LORA.shape.layers, rel=1e-12)


def test_lora_fc1_adapter_gemms_match_lora_params_for_gated_mlp():
    # A gated MLP's fc1 is the fused gate and up (2·ffn wide): one adapter of r·(h + 2·ffn) per layer.
    w = replace(LORA, shape=replace(LORA.shape, lora_targets=("fc1",)))
    h, f, r = w.shape.hidden, w.shape.ffn, w.shape.lora_rank
    assert flops.lora_params(resolve("llama2-70b-lora").model, r, ("fc1",)) == w.shape.layers * r * (h + 2 * f)
    gemms = compute.layer_gemms(w, ClusterLayout(gpus=1))
    adapter = sum(2 * m_ * n * k for m_, n, k in gemms[4:])
    assert adapter == pytest.approx(2 * w.seq_len * r * (h + 2 * f), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Recomputation (the simulator prices time, not FLOPs)


@pytest.mark.parametrize(
    "w, lay",
    [
        (GPT3, ClusterLayout(gpus=4, tp=4, fp8=True)),
        (GPT3, ClusterLayout(gpus=8, tp=4, cp=2)),
        (LLAMA, ClusterLayout(gpus=8, tp=8, mbs=2)),
        (LORA, ClusterLayout(gpus=4, tp=4, sp=False)),
    ],
)
def test_recompute_adds_one_forward_or_one_attention_forward(w, lay):
    gpu = CAT.gpu("h100")
    none = compute.layer_times(w, lay, gpu, 0.8)
    full = compute.layer_times(w, replace(lay, recompute="full"), gpu, 0.8)
    sel = compute.layer_times(w, replace(lay, recompute="selective"), gpu, 0.8)
    assert full.fwd == none.fwd and sel.fwd == none.fwd
    assert full.bwd == pytest.approx(none.bwd + none.fwd, rel=1e-12)
    assert sel.bwd == pytest.approx(none.bwd + none.attn_fwd, rel=1e-12)
    assert 0 < none.attn_fwd < none.fwd and 0 < none.gemm_fwd < none.fwd
    assert none.bwd > none.fwd


def test_full_recompute_repeats_the_forward_tp_communication():
    lay = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=512, fp8=True)
    cl = _cluster(512)
    none = step_time(GPT3, lay, cl, EFF)
    full = step_time(GPT3, replace(lay, recompute="full"), cl, EFF)
    assert none.breakdown["tp_exposed"] > 0
    # Forward + backward TP collectives (2x), plus the forward's again when re-running it (3x).
    assert full.breakdown["tp_exposed"] == pytest.approx(1.5 * none.breakdown["tp_exposed"], rel=1e-12)
    assert full.step_time_s > none.step_time_s


# ---------------------------------------------------------------------------------------------------------------
# Pipeline bubble inside a step


@pytest.fixture
def uniform_stages(monkeypatch):
    """No embedding/logits extras and free p2p: every pipeline rank does the same work."""
    monkeypatch.setattr(compute, "embedding_times", lambda *a, **k: (0.0, 0.0))
    monkeypatch.setattr(compute, "logits_times", lambda *a, **k: (0.0, 0.0))
    monkeypatch.setattr(Cluster, "p2p", lambda self, size, same_domain: 0.0)


BUBBLE_LAYOUTS = [
    ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=512, fp8=True),  # interleaved, m=32
    ClusterLayout(gpus=10752, tp=4, pp=8, vp=12, mbs=1, gbs=2688, fp8=True),  # interleaved, m=8 = p
    ClusterLayout(gpus=512, tp=4, pp=8, vp=4, mbs=2, gbs=1024),  # interleaved, m=32, mbs 2
    ClusterLayout(gpus=512, tp=4, pp=8, mbs=1, gbs=512),  # 1f1b, m=32
    ClusterLayout(gpus=256, tp=8, pp=4, mbs=1, gbs=40, schedule="gpipe"),  # gpipe, m=5
]


@pytest.mark.parametrize("lay", BUBBLE_LAYOUTS, ids=lambda lay: lay.describe())
def test_step_bubble_is_the_closed_form_for_uniform_stages(uniform_stages, lay):
    assert lay.problems(GPT3) == []
    cl = _cluster(lay.gpus)
    fwd, bwd, _ = stage_costs(GPT3, lay, cl, EFF)
    work = [sum(fwd[r]) + sum(bwd[r]) for r in range(lay.pp)]
    assert max(work) == pytest.approx(min(work), rel=1e-12)
    m = lay.microbatches
    ideal = m * work[0]
    cf = schedule.bubble_closed_form(lay.pipeline_schedule, lay.pp, m, lay.vp)
    expected = (lay.pp - 1) / (lay.vp * m)
    assert cf == pytest.approx(expected)
    for event in (True, False):
        res = step_time(GPT3, lay, cl, EFF, event=event)
        assert res.breakdown["pp_bubble"] == pytest.approx(expected * ideal, rel=1e-9), event
        assert res.details["makespan_s"] == pytest.approx(ideal * (1 + expected), rel=1e-9)


@pytest.mark.parametrize("lay", BUBBLE_LAYOUTS[:4], ids=lambda lay: lay.describe())
def test_step_bubble_with_first_and_last_stage_extras(lay):
    """With embedding on the first stage and logits on the last the closed form is not exact. Simulating the
    schedule on `stage_costs` at p2p=0, the bubble over the busiest rank's work lies between the closed form
    applied with the lightest rank's chunk time and with the busiest's; p2p then adds at most 2(pv-1) transfers."""
    cl = _cluster(lay.gpus)
    p, v, m = lay.pp, lay.vp, lay.microbatches
    fwd, bwd, _ = stage_costs(GPT3, lay, cl, EFF)
    work = [sum(fwd[r]) + sum(bwd[r]) for r in range(p)]
    assert work[-1] == max(work) > work[0] > work[1] == min(work)  # logits > embedding > plain layers
    res = schedule.simulate(lay.pipeline_schedule, p, m, v, fwd, bwd, 0.0)
    lo = m * max(work) + (p - 1) * min(work) / v
    hi = m * max(work) + (p - 1) * max(work) / v
    assert lo * (1 - 1e-9) <= res.makespan <= hi * (1 + 1e-9)
    full = step_time(GPT3, lay, cl, EFF)
    p2p = full.details["p2p_s"]
    assert p2p > 0
    extra = full.details["makespan_s"] - res.makespan
    assert 0 < extra <= 2 * (p * v - 1) * p2p * (1 + 1e-9)
    assert full.breakdown["pp_bubble"] == pytest.approx(full.details["makespan_s"] - m * max(work), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Step breakdown


def _step(lay: ClusterLayout, gpu: str = "h100", w=GPT3, eff: Efficiency = EFF, node: str | None = None):
    return step_time(w, lay, _cluster(lay.gpus, gpu, node), eff)


@pytest.mark.parametrize(
    "w, lay",
    [
        (GPT3, ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)),
        (GPT3, ClusterLayout(gpus=1024, tp=8, pp=8, cp=2, mbs=1, gbs=1024, recompute="selective", zero=3)),
        (GPT3, ClusterLayout(gpus=64, tp=8, pp=8, mbs=1, gbs=64)),
        (LORA, ClusterLayout(gpus=8, tp=4, pp=1, cp=2, mbs=1, gbs=8, fp8=True)),
        (LLAMA, ClusterLayout(gpus=256, tp=8, pp=4, vp=5, cp=1, mbs=1, gbs=256, zero=0)),
    ],
    ids=["gpt3-512", "gpt3-cp2-zero3", "gpt3-dp1", "lora-cp2", "llama-zero0"],
)
def test_breakdown_keys_sum_to_step_time(w, lay):
    assert lay.problems(w) == []
    res = _step(lay, w=w)
    assert set(res.breakdown) == BREAKDOWN_KEYS
    assert all(v >= 0 and math.isfinite(v) for v in res.breakdown.values()), res.breakdown
    assert sum(res.breakdown.values()) == pytest.approx(res.step_time_s, rel=1e-12)
    if lay.zero == 3:  # fully sharded with 64 micro-batches: parameter gathers dominate
        assert res.breakdown["dp_exposed"] > 0
    else:
        assert res.breakdown["compute"] > 0.5 * res.step_time_s
    assert res.breakdown["overhead"] == EFF.step_overhead_s
    assert res.breakdown["tp_exposed"] > 0  # tp > 1 in all of these
    # compute + exposed TP/CP + bubble is the pipeline makespan.
    pipe = sum(res.breakdown[k] for k in ("compute", "tp_exposed", "cp_exposed", "pp_bubble"))
    assert pipe == pytest.approx(res.details["makespan_s"], rel=1e-12)


def test_degree_one_dimensions_expose_nothing():
    tp1 = _step(ClusterLayout(gpus=64, tp=1, pp=8, mbs=1, gbs=512))
    assert tp1.breakdown["tp_exposed"] == 0.0
    assert tp1.breakdown["cp_exposed"] == 0.0
    dp1 = _step(ClusterLayout(gpus=32, tp=4, pp=8, mbs=1, gbs=64))
    assert dp1.breakdown["dp_exposed"] == 0.0 and dp1.breakdown["overlap_slowdown"] == 0.0
    assert dp1.breakdown["tp_exposed"] > 0
    pp1 = _step(ClusterLayout(gpus=8, tp=8, mbs=1, gbs=8), w=LORA)
    assert pp1.breakdown["pp_bubble"] == pytest.approx(0.0, abs=1e-12)
    assert pp1.breakdown["dp_exposed"] == 0.0
    # A DP group does communicate (whether or not it hides).
    dp2 = _step(ClusterLayout(gpus=64, tp=4, pp=8, mbs=1, gbs=128))
    assert dp2.breakdown["dp_exposed"] + dp2.breakdown["overlap_slowdown"] > 0


def test_more_gpus_same_batch_is_faster():
    times = [
        _step(ClusterLayout(gpus=g, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)).step_time_s
        for g in (256, 512, 1024, 2048)
    ]
    assert times == sorted(times, reverse=True) and len(set(times)) == 4
    # Strong scaling is sub-linear: the bubble grows as m shrinks.
    assert times[0] / times[-1] < 8


def test_fp8_is_faster_than_bf16_and_h200_is_not_slower_than_h100():
    lay = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048)
    bf16 = _step(lay).step_time_s
    fp8 = _step(replace(lay, fp8=True)).step_time_s
    assert fp8 < bf16
    for layout in (lay, replace(lay, fp8=True)):
        assert _step(layout, "h200").step_time_s <= _step(layout, "h100").step_time_s
    # On A100 fp8 has no tensor cores: the step falls back to bf16 GEMMs (only the cast traffic is added).
    a100 = _step(lay, "a100").step_time_s
    assert a100 > bf16
    # Faster GPUs: B200 beats H100 on the same layout.
    assert _step(lay, "b200").step_time_s < bf16


def test_dp_overlap_efficiency_and_slowdown_move_the_right_way():
    lay = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)
    base = _step(lay)
    worse = _step(lay, eff=replace(EFF, dp_overlap=0.2))
    assert worse.breakdown["dp_exposed"] > base.breakdown["dp_exposed"]
    none = _step(lay, eff=replace(EFF, overlap_slowdown=0.0))
    assert none.breakdown["overlap_slowdown"] == 0.0
    assert none.step_time_s < base.step_time_s


class _Recorder:
    """A stand-in cluster that prices a collective at its size in bytes, to read what `_dp_buckets` moves."""

    def collective(self, op, n, size, stride=1):
        return size


def _rank_traffic(lay, rank):
    rs = [sum(step._dp_buckets(GPT3, lay, _Recorder(), rank, c)[0]) for c in range(lay.vp)]
    ag = [sum(step._dp_buckets(GPT3, lay, _Recorder(), rank, c)[1]) for c in range(lay.vp)]
    return rs, ag


LAY_512 = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)
PER_CHUNK = GPT3.inventory.layer_matrix_params * GPT3.shape.layers / (4 * 8 * 12)


def test_dp_traffic_holds_the_embedding_once_where_it_lives():
    embed = GPT3.shape.vocab * GPT3.shape.hidden / LAY_512.tp
    mid, _ = _rank_traffic(LAY_512, 3)
    assert mid == pytest.approx([4 * PER_CHUNK] * LAY_512.vp)  # fp32 grads, no embedding
    first, _ = _rank_traffic(LAY_512, 0)
    last, _ = _rank_traffic(LAY_512, LAY_512.pp - 1)
    assert first[0] == pytest.approx(4 * (PER_CHUNK + embed)) and first[1:] == pytest.approx(mid[1:])
    assert last[-1] == pytest.approx(4 * (PER_CHUNK + embed)) and last[:-1] == pytest.approx(mid[:-1])


def test_dp_gradient_bytes_follow_the_gradient_dtype():
    rs32, _ = _rank_traffic(LAY_512, 3)
    rs16, _ = _rank_traffic(replace(LAY_512, bf16_grads=True), 3)
    assert rs16[1] == pytest.approx(2 * PER_CHUNK) and rs32[1] == pytest.approx(4 * PER_CHUNK)


def test_dp_parameter_all_gather_is_bf16_whatever_the_gradient_dtype():
    for layout in (LAY_512, replace(LAY_512, zero=3)):
        _, ag = _rank_traffic(layout, 3)
        assert ag[1] == pytest.approx(2 * PER_CHUNK * (2 if layout.zero == 3 else 1))


def test_hidden_dp_time_is_at_most_one_ranks_dp_traffic():
    cl = _cluster(LAY_512.gpus)
    eff = replace(EFF, overlap_slowdown=1.0, dp_overlap=1.0)  # slowdown = hidden seconds
    traffic = 0.0
    for r in range(LAY_512.pp):
        rs = [step._dp_buckets(GPT3, LAY_512, cl, r, c) for c in range(LAY_512.vp)]
        traffic = max(traffic, sum(sum(a) + sum(b) for a, b in rs))
    res = step_time(GPT3, LAY_512, cl, eff)
    assert res.breakdown["overlap_slowdown"] + res.breakdown["dp_exposed"] <= traffic * (1 + 1e-9)
    assert res.breakdown["overlap_slowdown"] > 0.5 * traffic  # most of it hides under the cooldown


def test_plain_1f1b_hides_dp_traffic_under_the_last_backward():
    lay = ClusterLayout(gpus=256, tp=8, pp=4, mbs=1, gbs=256, fp8=True)
    res = step_time(GPT3, lay, _cluster(lay.gpus), replace(EFF, overlap_slowdown=1.0))
    assert res.breakdown["overlap_slowdown"] > 0  # buckets release during the last micro-batch's backward


def test_zero3_pays_per_micro_batch():
    lay = ClusterLayout(gpus=512, tp=8, pp=1, mbs=1, gbs=512, fp8=True)
    few = step_time(GPT3, replace(lay, gbs=64, zero=3), _cluster(512), EFF)
    many = step_time(GPT3, replace(lay, zero=3), _cluster(512), EFF)
    z1 = step_time(GPT3, lay, _cluster(512), EFF)
    assert (
        many.breakdown["dp_exposed"] + many.breakdown["overlap_slowdown"]
        > z1.breakdown["dp_exposed"] + z1.breakdown["overlap_slowdown"]
    )
    assert many.step_time_s / few.step_time_s > 512 / 64 * 0.9


# ---------------------------------------------------------------------------------------------------------------
# predict()

# MLPerf gpt3 recipes reduce gradients in bf16 (docs/perf-model.md), where the ClusterLayout can say so.
_BF16_GRADS = {"bf16_grads": True} if "bf16_grads" in ClusterLayout.__dataclass_fields__ else {}
MLPERF_10752 = ClusterLayout(gpus=10752, tp=4, pp=8, vp=12, mbs=1, gbs=2688, fp8=True, **_BF16_GRADS)


def test_predict_json_keys_and_mfu_relation():
    pred = predict(GPT3, MLPERF_10752, "h100", node="nd-h100-v5", calibration="v3.1")
    d = pred.to_dict()
    for key in (
        "step_time_s",
        "time_to_train_min",
        "tokens_per_s_per_gpu",
        "mfu",
        "memory_gib_per_gpu",
        "steps",
        "feasible",
        "reasons",
        "breakdown",
        "layout",
    ):
        assert key in d
    json.loads(json.dumps(d))
    assert d["feasible"] is True and d["reasons"] == []
    assert (d["gpu"], d["node"], d["fabric"]) == ("h100", "nd-h100-v5", "ib-ndr")
    assert d["layout"]["dp"] == 336 and d["layout"]["microbatches"] == 8
    assert d["layout"]["schedule"] == "interleaved_1f1b"
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"], rel=1e-12)
    assert pred.tokens_per_s_per_gpu == pytest.approx(2688 * 2048 / pred.step_time_s / 10752, rel=1e-12)
    assert pred.mfu_peak_tflops == 989.0
    assert pred.mfu == pytest.approx(pred.tokens_per_s_per_gpu * GPT3.flops_per_token / 989e12, rel=1e-12)
    assert pred.model_tflops_per_gpu == pytest.approx(pred.tokens_per_s_per_gpu * 1.0764e12 / 1e12, rel=1e-4)
    assert 0 < pred.mfu < 1
    assert 0 < pred.memory_gib_per_gpu < 80e9 / 2**30
    assert pred.steps > 0 and pred.evals > 0
    assert pred.time_to_train_min == pytest.approx(
        (pred.warmup_s + pred.steps * pred.step_time_s + (pred.evals - 1) * pred.eval_time_s + pred.eval_first_s) / 60,
        rel=1e-12,
    )
    assert set(d["phases_min"]) == {"warmup", "steps", "evaluations"}
    assert sum(d["phases_min"].values()) == pytest.approx(d["time_to_train_min"], rel=1e-12)
    assert set(d["breakdown"]) | {"evaluation", "warmup"} == set(d["ttt_breakdown"])
    assert sum(d["ttt_breakdown"].values()) == pytest.approx(d["time_to_train_min"], rel=1e-12)


def test_gpt3_on_10752_h100_is_about_four_minutes():
    """Published (MLPerf v3.1, Azure ND H100 v5, 10,752 GPUs): ~4 minutes. A sanity band, not a fit."""
    pred = predict(GPT3, MLPERF_10752, "h100", node="nd-h100-v5", calibration="v3.1")
    assert pred.feasible
    assert 3.0 <= pred.time_to_train_min <= 5.0


def test_mfu_uses_the_dense_bf16_peak_for_other_gpus():
    lay = ClusterLayout(gpus=64, tp=4, pp=8, vp=4, mbs=1, gbs=256)
    for gpu, peak in (("a100", 312.0), ("h200", 989.0), ("b200", 2250.0)):
        pred = predict(GPT3, lay, gpu, eff=EFF)
        assert pred.mfu_peak_tflops == peak
        assert pred.mfu == pytest.approx(pred.tokens_per_s_per_gpu * GPT3.flops_per_token / (peak * 1e12))


@pytest.mark.parametrize(
    "lay, words",
    [
        (ClusterLayout(gpus=10, tp=4, pp=1, gbs=8), "not a multiple of tp*pp*cp"),
        (ClusterLayout(gpus=40, tp=5, gbs=8), "tp=5"),
        (ClusterLayout(gpus=40, tp=8, pp=5, gbs=40), "layers"),  # 96 and 96 + 2 do not split into 5
        (ClusterLayout(gpus=128, tp=8, pp=8, gbs=3), "gbs=3"),
        (ClusterLayout(gpus=64, tp=8, pp=8, gbs=4), "micro-batches"),
        (ClusterLayout(gpus=64, tp=8, pp=8, vp=5, gbs=8), "pp*vp=40"),
        (ClusterLayout(gpus=64, tp=8, pp=8, vp=2, gbs=12), "multiple of pp"),
        (ClusterLayout(gpus=8, tp=8, recompute="most"), "recompute"),
        (ClusterLayout(gpus=0), "gpus=0"),
        (ClusterLayout(gpus=8, gbs=0), "gbs=0"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.describe(),
)
def test_impossible_layouts_are_infeasible_not_errors(lay, words):
    pred = predict(GPT3, lay, "h100", eff=EFF)
    assert pred.feasible is False
    assert any(words in r for r in pred.reasons), pred.reasons
    assert math.isnan(pred.step_time_s) and pred.time_to_train_min is None
    json.dumps(pred.to_dict())


@pytest.mark.parametrize("lay", [ClusterLayout(gpus=8, tp=0), ClusterLayout(gpus=8, mbs=0)], ids=["tp0", "mbs0"])
def test_zero_degrees_are_infeasible_not_errors(lay):
    pred = predict(GPT3, lay, "h100", eff=EFF)
    assert pred.feasible is False


def test_fp8_on_a100_is_infeasible_with_a_reason():
    lay = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)
    pred = predict(GPT3, lay, "a100", eff=EFF)
    assert pred.feasible is False
    assert any("a100" in r and "FP8" in r for r in pred.reasons), pred.reasons
    # Same layout on H100 is fine.
    assert predict(GPT3, lay, "h100", eff=EFF).feasible


def test_out_of_memory_is_infeasible_but_still_priced():
    lay = ClusterLayout(gpus=8, tp=8, mbs=1, gbs=8)  # 175B on one node
    pred = predict(GPT3, lay, "h100", eff=EFF)
    assert pred.feasible is False
    assert any("GiB per GPU" in r for r in pred.reasons)
    assert pred.step_time_s > 0 and pred.memory_gib_per_gpu > 80
