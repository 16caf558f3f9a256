"""Expert-parallel layouts: parallel.ep's checks (one line each), the expert mesh, and the dry run of DeepSeek-V3
671B on 1,024 GB300 with EP 64. The training parity on gloo is tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli.main import main
from scaletrain.config import ConfigError, resolve
from scaletrain.parallel.layout import Layout, LayoutError

TINY_DSV3 = [
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
    "model.seq_len=16",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
]


def moe_layout(world, *over):
    return Layout.from_config(resolve("deepseek-v3-671b", overrides=[*TINY_DSV3, *over]), world)


def test_ep_borrows_dp_shard():
    lay = moe_layout(8, "parallel.ep=4")
    assert (lay.dp_shard, lay.cp, lay.ep, lay.efsdp) == (8, 1, 4, 2)
    assert lay.describe() == "dp_shard8 x ep4 = 8 ranks"
    assert lay.data_parallel_kind == "fsdp"
    # Context parallelism (which EP would borrow too) has no latent or sink attention yet: refused in one line.
    with pytest.raises(LayoutError, match="parallel.cp=2: model.arch='deepseek_v3' has no context-parallel"):
        moe_layout(8, "parallel.ep=4", "parallel.cp=2")
    assert moe_layout(4).ep == 1 and "ep" not in moe_layout(4).describe()


@pytest.mark.parametrize(
    "preset,over,needle",
    [
        ("deepseek-v3-671b", ["parallel.ep=3"], "parallel.ep=3: must divide model.moe.n_experts=8"),
        ("deepseek-v3-671b", ["parallel.ep=0"], "parallel.ep=0: must be >= 1"),
        ("gpt3-proxy", ["parallel.ep=2"], "parallel.ep=2: expert parallelism needs an MoE model"),
    ],
)
def test_bad_ep_in_the_config(preset, over, needle):
    extra = TINY_DSV3 if preset == "deepseek-v3-671b" else []
    with pytest.raises(ConfigError) as err:
        resolve(preset, overrides=[*extra, *over])
    assert needle in str(err.value) and "\n" not in str(err.value)


TINY_GPT_OSS = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=8",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff_expert=16",
    "model.seq_len=16",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
]


@pytest.mark.parametrize(
    "model,world,over,needle",
    [
        ("dsv3", 4, ["parallel.ep=8"], "parallel.ep=8: must divide dp_shard x cp x tp = 4"),
        ("dsv3", 2, ["parallel.ep=2", "parallel.dp_replicate=2"], "parallel.ep=2: must divide dp_shard x cp x tp = 1"),
        ("dsv3", 4, ["parallel.tp=2"], "parallel.tp=2: model.arch='deepseek_v3' has no tensor-parallel plan for its"),
        ("gpt_oss", 4, ["parallel.tp=2"], "parallel.tp=2 with MoE layers needs parallel.ep a multiple of tp"),
        (
            "gpt_oss",
            8,
            ["parallel.tp=4", "parallel.ep=2"],
            "parallel.ep=2 with parallel.tp=4: ep must be a multiple of",
        ),
        (
            "gpt_oss",
            4,
            ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=false"],
            "parallel.tp=2 with MoE layers needs parallel.sequence_parallel=true",
        ),
    ],
)
def test_bad_ep_in_the_layout(model, world, over, needle):
    with pytest.raises(LayoutError) as err:
        if model == "dsv3":
            moe_layout(world, *over)
        else:
            Layout.from_config(resolve("gpt-oss-20b", overrides=[*TINY_GPT_OSS, *over]), world)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_ep_borrows_tp_ranks():
    """Under TP the experts' group holds whole tp groups: EP 4 x TP 2 on 8 ranks shards experts over the 4 ranks of
    two dp_shard coordinates' tp pairs, FSDP over the other 2."""
    lay = Layout.from_config(resolve("gpt-oss-20b", overrides=[*TINY_GPT_OSS, "parallel.tp=2", "parallel.ep=4"]), 8)
    assert (lay.dp_shard, lay.tp, lay.ep, lay.efsdp) == (4, 2, 4, 2)


def test_dry_run_deepseek_v3_671b_on_1024_gb300_with_ep64(capsys):
    code = main(
        [
            "train",
            "--dry-run",
            "--json",
            "--world-size",
            "1024",
            "--gpu",
            "gb300",
            "--preset",
            "deepseek-v3-671b",
            "--set",
            "parallel.ep=64",
            "--set",
            "train.global_batch_size=15360",
            "--set",
            "train.micro_batch_size=1",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["fits"] and report["layout"] == "dp_shard1024 x ep64 = 1024 ranks"
    assert report["experts"] == {"per_layer": 256, "ep": 64, "per_ep_rank": 4, "fsdp_ranks": 16}
    (rank,) = report["ranks"]
    assert rank["coords"]["ep"] == 0
    shards = {s["name"]: s for s in rank["shards"]}
    # 256 experts: 4 per EP rank (Shard(0) over ep), then FSDP splits those 4 over 16 ranks (ceil chunks: 1).
    assert shards["blocks.3.mlp.experts.w_in"]["global"] == [256, 4096, 7168]
    assert shards["blocks.3.mlp.experts.w_in"]["local"] == [1, 4096, 7168]
    assert "blocks.2.mlp.experts.w_in" not in shards  # the first three layers are dense
    assert 10 < report["max_memory_gib"] < 255
