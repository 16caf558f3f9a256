"""Memory model: Korthikanti's activation formulas, bytes/parameter per ZeRO mode, in-flight micro-batches per
pipeline schedule, LoRA accounting, and feasibility of the published MLPerf layouts (and of absurd ones)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scaletrain.sim.memory import (
    GB,
    GIB,
    MemoryEstimate,
    activation_bytes_per_layer,
    bytes_per_param,
    fits,
    in_flight_microbatches,
    memory_per_gpu,
)
from scaletrain.sim.workload import ClusterLayout, load_workload

GPT3 = load_workload("gpt3")
LLAMA = load_workload("llama2_70b_lora")
S, H = GPT3.seq_len, GPT3.shape.hidden
MLPERF_GPT3 = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, sp=True, fp8=True, zero=1)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_gpt3_tp_sp_is_34_sbh_over_t(t):
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=t, tp=t, sp=True)) == pytest.approx(S * H * 34 / t)
    # Selective recomputation only drops the attention scores, which flash never stores.
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=t, tp=t, recompute="selective")) == pytest.approx(
        S * H * 34 / t
    )


@pytest.mark.parametrize("t", [2, 4, 8])
def test_gpt3_tp_without_sp_is_10_plus_24_over_t(t):
    layout = ClusterLayout(gpus=t, tp=t, sp=False)
    assert activation_bytes_per_layer(GPT3, layout) == pytest.approx(S * H * (10 + 24 / t))


def test_full_recompute_keeps_the_layer_input_only():
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=4, tp=4, sp=False, recompute="full")) == 2 * S * H
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=4, tp=4, sp=True, recompute="full")) == 2 * S * H / 4
    # ...but the peak adds one layer's full set while backward re-runs it.
    lay = ClusterLayout(gpus=4, tp=4, recompute="full")
    est = memory_per_gpu(GPT3, lay)
    assert est.activations == pytest.approx(GPT3.shape.layers * 2 * S * H / 4 + S * H * 32 / 4)


def test_cp_divides_the_sequence_and_mbs_multiplies():
    base = activation_bytes_per_layer(GPT3, ClusterLayout(gpus=4, tp=4))
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=8, tp=4, cp=2)) == pytest.approx(base / 2)
    assert activation_bytes_per_layer(GPT3, ClusterLayout(gpus=4, tp=4, mbs=3)) == pytest.approx(base * 3)


def test_dropout_masks_fp8_and_llama_breakdown():
    lay = ClusterLayout(gpus=4, tp=4)
    assert activation_bytes_per_layer(GPT3, lay, dropout=False) == pytest.approx(S * H * 32 / 4)
    # FP8: QKV, fc1, fc2 inputs at 1 byte (-1, -1, -4), plus an FP8 copy of the flash output (+1).
    assert activation_bytes_per_layer(GPT3, replace(lay, fp8=True)) == pytest.approx(S * H * 29 / 4)
    # Llama, no LoRA, no dropout: norms/GEMM inputs 8h + Q 2h + K,V 4*(h/8) + out 2h + gate,up 4f + fc2 in 2f.
    base = replace(LLAMA, shape=replace(LLAMA.shape, lora_rank=0, lora_targets=()))
    s, h, f = LLAMA.seq_len, LLAMA.shape.hidden, LLAMA.shape.ffn
    per_token = 8 * h + 2 * h + 4 * h / 8 + 2 * h + 6 * f
    assert per_token == 33.5 * h
    assert activation_bytes_per_layer(base, ClusterLayout(gpus=1), dropout=False) == pytest.approx(s * per_token)
    # LoRA: the frozen QKV, fc1 and fc2 keep no inputs (-2h, -2h, -2f: they need only input gradients); the
    # adapters on qkv and proj keep a dropout output and mask of their h-wide inputs (+6h).
    lora_token = per_token - 4 * h - 2 * f + 6 * h
    assert activation_bytes_per_layer(LLAMA, ClusterLayout(gpus=1), dropout=False) == pytest.approx(s * lora_token)


def test_bytes_per_param_match_perf_model():
    assert sum(bytes_per_param(0, 16)) == 16
    assert sum(bytes_per_param(1, 16)) == pytest.approx(6 + 12 / 16)
    assert sum(bytes_per_param(3, 16)) == pytest.approx(16 / 16)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_state_per_gpu_for_each_zero_mode(zero):
    lay = ClusterLayout(gpus=64, tp=4, pp=2, gbs=64, zero=zero)  # dp 8
    d = 8
    est = memory_per_gpu(GPT3, lay)
    h = GPT3.shape.hidden
    # First stage: 48 layers (matrices split by TP 4, column biases too; row biases and LayerNorms whole), the
    # vocabulary-parallel embedding and the learned positions (whole).
    layer = GPT3.inventory.layer_matrix_params / 4 + (3 * h + 4 * h) / 4 + 2 * h + 4 * h
    n = layer * GPT3.shape.layers / 2 + GPT3.shape.vocab * h / 4 + 2048 * h
    expect = {0: (2 * n, 2 * n, 12 * n), 1: (2 * n, 4 * n, 12 * n / d), 3: (2 * n / d, 2 * n / d, 12 * n / d)}[zero]
    if zero == 3:  # plus two gathered layers of bf16 weights and one layer of unsharded grads
        layer = 2 * GPT3.inventory.layer_matrix_params / 4
        expect = (expect[0] + 2 * layer, expect[1] + layer, expect[2])
    assert (est.weights, est.grads, est.optimizer) == pytest.approx(expect)


def test_optimizer_shards_over_dp_times_cp():
    a = memory_per_gpu(GPT3, ClusterLayout(gpus=64, tp=4, pp=8, gbs=64, cp=1))  # d = 2
    b = memory_per_gpu(GPT3, ClusterLayout(gpus=128, tp=4, pp=8, gbs=64, cp=2))  # d = 2 * 2
    assert b.optimizer == pytest.approx(a.optimizer / 2)


def test_in_flight_per_schedule():
    assert in_flight_microbatches(ClusterLayout(gpus=8, pp=8, gbs=32, schedule="gpipe")) == 32
    assert in_flight_microbatches(ClusterLayout(gpus=8, pp=8, gbs=32)) == 8
    assert in_flight_microbatches(ClusterLayout(gpus=8, pp=8, gbs=32), rank=7) == 1
    assert in_flight_microbatches(ClusterLayout(gpus=8, pp=8, gbs=4)) == 4  # fewer micro-batches than stages
    # Megatron interleaved warm-up: (p-1)*2 + (v-1)*p + 1 chunks of 1/v of the rank's layers.
    assert in_flight_microbatches(MLPERF_GPT3) == pytest.approx((7 * 2 + 11 * 8 + 1) / 12)
    assert in_flight_microbatches(ClusterLayout(gpus=8, pp=8, vp=2, gbs=8)) == 8  # m == p: everything warms up
    assert in_flight_microbatches(ClusterLayout(gpus=1, gbs=16)) == 1


def test_in_flight_override_scales_layer_activations():
    est = memory_per_gpu(GPT3, MLPERF_GPT3)
    doubled = memory_per_gpu(GPT3, MLPERF_GPT3, in_flight=2 * est.in_flight)
    assert est.in_flight == pytest.approx(103 / 12)
    assert doubled.activations == pytest.approx(2 * est.activations)
    assert doubled.weights == est.weights


def test_lora_trains_only_adapters():
    lay = ClusterLayout(gpus=8, tp=4, gbs=8)
    est = memory_per_gpu(LLAMA, lay)
    adapters = LLAMA.inventory.trainable_params / 4
    assert est.grads == pytest.approx(4 * adapters)  # zero 1: fp32 grads of adapters only
    assert est.optimizer == pytest.approx(12 * adapters / 2)
    h = LLAMA.shape.hidden
    # + two RMSNorm weights per layer (whole)
    base = LLAMA.inventory.layer_matrix_params * LLAMA.shape.layers / 4 + LLAMA.shape.layers * 2 * h
    outer = (LLAMA.inventory.embedding_params + LLAMA.inventory.head_params) / 4 + h  # split by TP; final norm whole
    assert est.weights == pytest.approx(2 * base + 2 * outer + 2 * adapters)  # frozen bf16 base + adapter weights
    full = memory_per_gpu(replace(LLAMA, shape=replace(LLAMA.shape, lora_rank=0)), lay)
    assert full.grads > 1000 * est.grads and full.optimizer > 1000 * est.optimizer
    # Under FP8 the frozen layers are FP8 parameters (1 byte); the embedding and head stay bf16.
    assert memory_per_gpu(LLAMA, replace(lay, fp8=True)).weights == pytest.approx(base + 2 * outer + 2 * adapters)


def test_gpt3_512_gpu_mlperf_layout_fits_h100():
    est = memory_per_gpu(GPT3, MLPERF_GPT3)
    assert not MLPERF_GPT3.problems(GPT3)
    assert fits(est, 80)
    assert fits(memory_per_gpu(GPT3, replace(MLPERF_GPT3, fp8=False), dropout=True), 80)  # even bf16 + dropout
    assert est.total > 40 * GIB  # not trivially empty either


def test_llama_lora_mlperf_layouts_fit():
    h100 = ClusterLayout(gpus=8, tp=4, cp=1, gbs=8, fp8=True)  # NVIDIA's 8xH100 config: TP4 PP1 CP1, FP8, no recompute
    h200 = ClusterLayout(gpus=8, tp=2, cp=1, gbs=8, fp8=True)  # 8xH200: TP2
    assert fits(memory_per_gpu(LLAMA, h100), 80)
    assert fits(memory_per_gpu(LLAMA, h200), 141)
    assert not fits(memory_per_gpu(LLAMA, h200), 80)
    assert not fits(memory_per_gpu(LLAMA, ClusterLayout(gpus=8, gbs=8)), 80)  # no TP: 138 GB of bf16 base weights


def test_gpt3_without_model_parallelism_does_not_fit():
    assert not fits(memory_per_gpu(GPT3, ClusterLayout(gpus=1, gbs=1, zero=0)), 288)
    est = memory_per_gpu(GPT3, ClusterLayout(gpus=512, gbs=512, zero=1))  # pure data parallel, distributed optimizer
    assert est.weights + est.grads > 5.9 * GPT3.inventory.params and not fits(est, 288)


def test_gib_and_vendor_gb():
    est = MemoryEstimate(
        weights=GIB, grads=0, optimizer=0, activations=1.5 * GIB, other=0, total=2.5 * GIB, in_flight=1.234
    )
    assert est.gib() == {
        "weights": 1.0,
        "grads": 0.0,
        "optimizer": 0.0,
        "activations": 1.5,
        "other": 0.0,
        "total": 2.5,
        "in_flight": 1.23,
    }
    # 80 GB is 74.5 GiB: 74 GiB fits with no reserve, 75 GiB does not (though 75 < 80).
    at = lambda gib: MemoryEstimate(0, 0, 0, 0, 0, gib * GIB, 1)  # noqa: E731
    assert fits(at(74), 80, reserve_gib=0, fragmentation=0)
    assert not fits(at(75), 80, reserve_gib=0, fragmentation=0)
    assert 80 * GB / GIB == pytest.approx(74.51, abs=0.01)
    # The default reserve and fragmentation take real room.
    assert not fits(at(68), 80) and fits(at(67), 80)  # (74.5 - 5) / 1.03 = 67.5 GiB
