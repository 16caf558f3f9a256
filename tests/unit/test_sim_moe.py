"""MoE, latent attention and sliding windows in the per-layer inventory: parameter counts pinned on the published
models, FLOPs counting only the routed experts a token goes through, and the trainer's FLOPs formula agreeing."""

import dataclasses

import pytest

from scaletrain import architectures
from scaletrain.architectures import Architecture
from scaletrain.config import resolve
from scaletrain.model import flops
from scaletrain.sim.layers import Inventory, ModelShape, shape_of

# The published shapes (Hugging Face config.json of openai/gpt-oss-20b and deepseek-ai/DeepSeek-V3).
GPT_OSS_20B = dict(
    layers=24,
    hidden=2880,
    heads=64,
    kv_heads=8,
    ffn=2880,
    vocab=201088,
    head_size=64,
    experts=32,
    top_k=4,
    expert_ffn=2880,
    router_bias=True,
    window=128,
    window_layers=12,
)
DEEPSEEK_V3 = dict(
    layers=61,
    hidden=7168,
    heads=128,
    kv_heads=128,
    ffn=18432,
    vocab=129280,
    experts=256,
    top_k=8,
    expert_ffn=2048,
    shared_experts=1,
    dense_layers=3,
    q_rank=1536,
    kv_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_dim=128,
)


@pytest.fixture
def archs(monkeypatch):
    """The two architectures' facts (biases on GPT-OSS's attention and experts; none on DeepSeek-V3), whether or not
    the model registry has them yet."""
    table = dict(architectures.ARCHITECTURES)
    table.setdefault("gpt_oss", Architecture("gpt_oss", True, True, 1, False, False, True, 150000.0))
    table.setdefault("deepseek_v3", Architecture("deepseek_v3", True, False, 1, False, False, False, 10000.0))
    monkeypatch.setattr(architectures, "ARCHITECTURES", table)


def test_gpt_oss_20b_counts(archs):
    inv = Inventory(ModelShape(arch="gpt_oss", **GPT_OSS_20B))
    assert inv.params == pytest.approx(20.91e9, abs=0.01e9)  # model card: 20.91B
    assert inv.active_params == pytest.approx(3.61e9, abs=0.01e9)  # model card: 3.61B active


def test_deepseek_v3_counts(archs):
    inv = Inventory(ModelShape(arch="deepseek_v3", **DEEPSEEK_V3))
    assert inv.params == pytest.approx(671.0e9, abs=0.1e9)  # 671B without the multi-token-prediction module
    # 37B activated (DeepSeek-V3 report); without the 0.93B input embedding table, as GPT-OSS's 3.6B counts.
    assert inv.active_params == pytest.approx(36.6e9, abs=0.1e9)


def test_flops_follow_top_k_not_the_expert_count(archs):
    base = ModelShape(arch="deepseek_v3", **DEEPSEEK_V3)
    a, b = Inventory(base), Inventory(dataclasses.replace(base, experts=512))
    assert b.params > a.params + 100e9
    router = 6 * 58 * 7168 * 256  # only the router (one score per expert) grows with the experts
    assert b.flops_per_token(4096) - a.flops_per_token(4096) == pytest.approx(router, rel=1e-9)
    k2 = Inventory(dataclasses.replace(base, top_k=9))
    expert = 3 * 2048 * 7168  # one expert's SwiGLU matrices
    assert k2.flops_per_token(4096) - a.flops_per_token(4096) == pytest.approx(6 * 58 * expert, rel=1e-9)


def test_dense_leading_layers_are_counted_as_dense(archs):
    s = ModelShape(arch="deepseek_v3", **DEEPSEEK_V3)
    all_moe, all_dense = (
        Inventory(dataclasses.replace(s, dense_layers=0)),
        Inventory(dataclasses.replace(s, dense_layers=61)),
    )
    inv = Inventory(s)
    per_moe = (all_moe.params - inv.params) / 3
    per_dense = (inv.params - all_dense.params) / 58
    assert per_moe == pytest.approx(per_dense, rel=1e-12)  # both = one MoE layer less one dense layer
    dense_mlp, moe_mlp = 3 * 7168 * 18432, 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 256 * 7168
    assert per_moe == pytest.approx(moe_mlp - dense_mlp, rel=1e-12)


def test_sliding_window_layers_attend_to_the_window_only(archs):
    s = ModelShape(arch="gpt_oss", **GPT_OSS_20B)
    full = Inventory(dataclasses.replace(s, window=0, window_layers=0))
    inv = Inventory(s)
    attn = full.forward_flops(8192)["attn"]
    # 12 full layers at 8,192 keys and 12 at 128.
    assert inv.forward_flops(8192)["attn"] == pytest.approx(attn * (8192 + 128) / (2 * 8192), rel=1e-12)


def test_mla_attention_widths(archs):
    inv = Inventory(ModelShape(arch="deepseek_v3", **DEEPSEEK_V3))
    names = [g.name for g in inv.base]
    assert names[:5] == ["q_down", "q_up", "kv_down", "kv_up", "proj"]
    # QK^T over 192 = 128 + 64 dimensions per head, AV over 128, full s^2 (Megatron's count).
    assert inv.attention.forward_flops(4096) == pytest.approx(2 * 4096 * 128 * (192 + 128))


def test_trainer_formula_uses_the_inventory_for_moe():
    cfg = resolve("gpt-oss-20b", overrides=TINY_MOE["gpt-oss-20b"]).model
    inv = Inventory(shape_of(cfg))
    assert flops.num_params(cfg) == inv.params and flops.active_params(cfg) == inv.active_params
    assert flops.flops_per_token(cfg) == pytest.approx(inv.flops_per_token(cfg.seq_len))
    dense = resolve("llama-proxy").model
    assert flops.active_params(dense) == Inventory(shape_of(dense)).active_params


TINY_MOE = {
    "gpt-oss-20b": [
        "model.n_layers=3",
        "model.d_model=32",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=12",
        "model.vocab_size=300",
        "model.moe.n_experts=4",
        "model.moe.top_k=2",
        "model.moe.d_ff_expert=16",
        "model.sliding_window=4",
    ],
    "deepseek-v3-671b": [
        "model.n_layers=3",
        "model.d_model=32",
        "model.n_heads=4",
        "model.d_ff=48",
        "model.vocab_size=300",
        "model.moe.n_experts=8",
        "model.moe.n_groups=4",
        "model.moe.topk_groups=2",
        "model.moe.top_k=2",
        "model.moe.d_ff_expert=16",
        "model.moe.first_dense=1",
        "model.mla.q_lora_rank=24",
        "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4",
        "model.mla.v_head_dim=8",
    ],
}


@pytest.mark.parametrize("preset", sorted(TINY_MOE))
def test_inventory_and_trainer_count_the_real_modules(preset):
    import torch

    from scaletrain.model.build import build_model

    cfg = resolve(preset, overrides=TINY_MOE[preset]).model
    with torch.device("meta"):
        model = build_model(cfg)
    real = sum(p.numel() for p in model.parameters())
    assert Inventory(shape_of(cfg)).params == real == flops.num_params(cfg)


@pytest.mark.parametrize(
    "preset, total, active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("deepseek-v3-671b", 671.0e9, 36.6e9)]
)
def test_presets_counts(preset, total, active):
    cfg = resolve(preset).model
    assert flops.num_params(cfg) == pytest.approx(total, abs=0.01e9 if total < 1e11 else 0.1e9)
    assert flops.active_params(cfg) == pytest.approx(active, abs=0.01e9 if total < 1e11 else 0.1e9)


# ---------------------------------------------------------------- expert parallelism in the step and memory model
def _cluster(gpus, gpu="h100"):
    from scaletrain.sim.catalog import load_catalog
    from scaletrain.sim.comm import Cluster

    return Cluster(*load_catalog().system(gpu, None, None), gpus)


def test_all_to_all_inside_a_domain_and_across_nics():
    cl = _cluster(64)
    size = 64e6
    nv, nic = cl.node.nvlink_busbw_gbps * 1e9, cl.fabric.busbw_gbps * 1e9
    inside = cl.all_to_all(8, size)
    assert inside == pytest.approx(7 * cl.node.nvlink_alpha_us * 1e-6 + 7 / 8 * size / nv)
    # 64 ranks over 8 boards: 7/64 of the bytes on NVLink, 56/64 through the GPU's own NIC, at the same time.
    across = cl.all_to_all(64, size)
    assert across >= 56 / 64 * size / nic and across == pytest.approx(
        max(
            7 * cl.node.nvlink_alpha_us * 1e-6 + 7 / 64 * size / nv,
            7 * cl.net_alpha_us(8) * 1e-6 + 56 / 64 * size / nic,
        )
    )
    assert cl.collective("all_to_all", 64, size) == across
    # An NVL72 rack keeps 64 ranks inside its NVLink domain.
    gb = _cluster(64, "gb200")
    assert gb.all_to_all(64, size) < across / 3


def _deepseek(overrides=()):
    from scaletrain.sim.workload import load_workload

    return load_workload("deepseek-v3-671b", tuple(overrides))


def test_expert_parallelism_shards_the_experts_state():
    from scaletrain.sim.memory import memory_per_gpu
    from scaletrain.sim.workload import ClusterLayout

    w = _deepseek()
    one = ClusterLayout(gpus=1024, pp=16, gbs=16384, fp8=True, ep=8)
    many = ClusterLayout(gpus=1024, pp=16, gbs=16384, fp8=True, ep=64)
    a, b = memory_per_gpu(w, one), memory_per_gpu(w, many)
    experts = w.inventory.expert_rank_params(61 // 16 + 1, 1)
    # Going from 8 to 64 expert ranks drops 7/8 - 63/64 of a stage's expert weights (bf16) per GPU.
    assert a.weights - b.weights == pytest.approx(2 * experts * (1 / 8 - 1 / 64), rel=0.05)
    assert one.expert_dp == 64 * 1 // 8 and many.expert_dp == 1


def test_ep_layout_problems():
    from scaletrain.sim.workload import ClusterLayout, load_workload

    w = _deepseek()
    assert "ep=3 does not divide the 256 experts" in ClusterLayout(gpus=96, ep=3, gbs=96).problems(w)[0]
    assert "does not divide tp*cp*dp=4" in ClusterLayout(gpus=16, pp=4, ep=8, gbs=16).problems(w)[0]
    dense = load_workload("llama2-70b")
    assert "needs a Mixture-of-Experts model" in ClusterLayout(gpus=8, ep=2, gbs=8).problems(dense)[0]
    assert "moe_imbalance" in ClusterLayout(gpus=8, ep=2, gbs=8, moe_imbalance=0.5).problems(w)[-1]


def test_all_to_all_and_imbalance_cost_step_time():
    from scaletrain.sim.efficiency import Efficiency
    from scaletrain.sim.step import step_time
    from scaletrain.sim.workload import ClusterLayout

    w = _deepseek()
    cl = _cluster(1024, "h100")
    base = ClusterLayout(gpus=1024, pp=16, gbs=16384, fp8=True, ep=64)
    st = step_time(w, base, cl, Efficiency())
    assert st.breakdown["ep_exposed"] > 0
    hidden = step_time(w, base, cl, Efficiency(a2a_exposed=0.0))
    assert hidden.breakdown["ep_exposed"] == 0 and hidden.step_time_s < st.step_time_s
    skewed = step_time(w, dataclasses.replace(base, moe_imbalance=1.5), cl, Efficiency())
    assert (
        skewed.breakdown["compute"] > st.breakdown["compute"]
        and skewed.breakdown["ep_exposed"] > st.breakdown["ep_exposed"]
    )
    dense_keys = step_time(_deepseek(["model.moe.n_experts=0"]), dataclasses.replace(base, ep=1), cl, Efficiency())
    assert "ep_exposed" not in dense_keys.breakdown


def test_plan_searches_expert_parallelism():
    from scaletrain.sim.plan import plan

    res = plan(_deepseek(), "gb300", 1024, top=2)
    assert res.best and all(p.layout["ep"] > 1 and p.feasible for p in res.best)
    assert all(256 % p.layout["ep"] == 0 for p in res.best)


def test_grouped_gemm_pays_for_its_groups_tiles():
    """A grouped GEMM is priced by its groups: rows padded to the 128-row tile, each expert's weight read whatever its
    rows, one launch; equal to one GEMM of the same FLOPs when every group fills whole tiles at a compute-bound size,
    slower when the experts get a few rows each (there the weights' HBM reads set the time)."""
    from scaletrain.sim.catalog import load_catalog
    from scaletrain.sim.compute import gemm_time, grouped_gemm_time

    gpu = load_catalog().gpu("h100")
    n, k = 4096, 7168
    whole = grouped_gemm_time(gpu, 8 * 1024, n, k, 8, False, 0.8)
    assert whole == pytest.approx(gemm_time(gpu, 2.0 * 8 * 1024 * n * k, False, 0.8))
    # 256 experts sharing 8,192 rows: 32 rows each; a 128-row tile of FLOPs (4x the work) or the bf16 weight read,
    # whichever is longer, per expert.
    sparse = grouped_gemm_time(gpu, 8 * 1024, n, k, 256, False, 0.8)
    launch = gpu.kernel_us * 1e-6
    tile = 2.0 * 128 * n * k / (gpu.matmul_bf16_tflops * 1e12 * 0.8)
    read = (2 * (n * k + 32 * k) + 2 * 32 * n) / (gpu.hbm_copy_tbps * 1e12)
    assert read > tile and sparse - launch == pytest.approx(256 * read, rel=1e-6)
    assert sparse - launch > 4 * (whole - launch)
