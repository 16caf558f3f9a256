"""The model section's MoE and MLA fields: defaults are dense/standard, --set reaches them, bad values are named."""

import pytest

from scaletrain.config import ConfigError, resolve


def test_defaults_are_dense_and_standard_attention():
    cfg = resolve("gpt3-proxy")
    assert cfg.model.moe.n_experts == 0 and cfg.model.mla.kv_lora_rank == 0
    assert cfg.model.head_size == cfg.model.d_model // cfg.model.n_heads


def test_overrides_reach_nested_sections():
    cfg = resolve(
        "deepseek-v3-671b",
        overrides=[
            "model.moe.n_experts=8",
            "model.moe.n_groups=1",
            "model.moe.topk_groups=1",
            "model.moe.top_k=2",
            "model.mla.kv_lora_rank=32",
            "model.head_dim=48",
        ],
    )
    assert (cfg.model.moe.n_experts, cfg.model.moe.top_k, cfg.model.mla.kv_lora_rank) == (8, 2, 32)
    assert cfg.model.head_size == 48
    assert cfg.to_dict()["model"]["moe"]["n_experts"] == 8  # saved into config.json


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.moe.n_experts=8", "model.moe.top_k=9"], "model.moe.top_k=9"),
        (["model.moe.n_experts=8", "model.moe.n_groups=3"], "model.moe.n_groups=3"),
        (
            ["model.moe.n_experts=8", "model.moe.n_groups=4", "model.moe.topk_groups=1", "model.moe.top_k=3"],
            "more than the 2 experts",
        ),
        (["model.moe.n_experts=8", "model.moe.score_func=relu"], "model.moe.score_func='relu'"),
        (["model.moe.n_experts=8", "model.moe.aux_loss_coef=nan"], "model.moe.aux_loss_coef"),
        (["model.moe.n_experts=8", "model.moe.first_dense=99"], "model.moe.first_dense=99"),
        (["model.mla.kv_lora_rank=16", "model.mla.qk_rope_head_dim=7"], "model.mla.qk_rope_head_dim=7"),
        (["model.head_dim=-1"], "model.head_dim=-1"),
        (["model.d_model=102", "model.n_heads=4", "model.n_kv_heads=2"], "must divide model.d_model=102"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    preset = "deepseek-v3-671b" if any("mla" in o for o in overrides) else "gpt-oss-20b"
    if any(o.startswith("model.d_model") for o in overrides):
        preset = "llama-proxy"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        resolve(preset, overrides=overrides)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.moe.n_experts=8", "model.arch='llama' has no Mixture-of-Experts layers"),
        ("model.mla.kv_lora_rank=16", "model.arch='llama' has no latent attention"),
        ("model.sliding_window=4", "model.arch='llama' has no windowed or sink attention"),
        ("model.attn_sinks=true", "model.arch='llama' has no windowed or sink attention"),
    ],
)
def test_fields_an_architecture_would_ignore_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve("llama-proxy", overrides=[override])


def test_head_dim_lifts_the_divisibility_rule():
    cfg = resolve(
        "llama-proxy", overrides=["model.d_model=100", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=32"]
    )
    assert cfg.model.head_size == 32
