"""The architecture registry (scaletrain.model.spec): each ModelSpec's facts match the module it builds."""

from __future__ import annotations

import pytest

from scaletrain import architectures
from scaletrain.config import MLAConfig, ModelConfig, MoEConfig
from scaletrain.model import flops
from scaletrain.model.spec import MODELS, model_spec


def _tiny(arch: str, **kw) -> ModelConfig:
    shape = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2 if model_spec(arch).facts.grouped_kv else 0, d_ff=96)
    if model_spec(arch).facts.latent_attention:  # DeepSeek-V3's shape: a dense first layer, then experts
        shape["mla"] = MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        shape["moe"] = MoEConfig(n_experts=4, top_k=2, d_ff_expert=32, n_shared=1, first_dense=1)
    return ModelConfig(arch=arch, **{**shape, "seq_len": 32, "vocab_size": 250, "vocab_multiple": 128, **kw})


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_spec_builds_a_model_its_facts_describe(arch):
    import torch

    from scaletrain.model.build import build_model

    spec = model_spec(arch)
    cfg = _tiny(arch)
    model = build_model(cfg, seed=0)
    # Tied matrices are one Parameter, so parameters() counts them once, like num_params (latent attention and
    # experts included: flops counts them through the simulator's inventory).
    assert sum(p.numel() for p in model.parameters()) == flops.num_params(cfg)
    assert model.head_is_tied == spec.facts.tied_head
    assert (getattr(model.embed, "pos", None) is not None) == spec.facts.learned_positions
    block = model.blocks["0"]
    assert block.mlp.fc.out_features == (spec.facts.mlp_matrices - 1) * cfg.ffn_size
    assert all(
        (m.bias is not None) == spec.facts.biases for m in block.attn.modules() if isinstance(m, torch.nn.Linear)
    )
    assert hasattr(block.attn, "qkv") != spec.facts.latent_attention
    assert sum(p.numel() for p in block.ln1.parameters()) == spec.facts.norm_weights * cfg.d_model
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, cfg.padded_vocab)


def test_config_accepts_exactly_the_registered_architectures():
    # config validates model.arch before any model code loads, so it keeps the names; they must agree.
    assert architectures.names() == tuple(MODELS)
    with pytest.raises(
        ValueError,
        match=r"model.arch='mamba': no model builder \(known: 'gpt3', 'llama', 'llama31', 'qwen3', 'gpt_oss', 'deepseek_v3'\)",
    ):
        model_spec("mamba")


def test_tp_rules_follow_the_architecture():
    gpt, llama = model_spec("gpt3"), model_spec("llama")
    m = _tiny("llama", n_heads=8, n_kv_heads=2, d_model=64)
    assert llama.tp_problems(m, 4) == [
        "parallel.tp=4 does not divide the key/value heads 2 (model.n_kv_heads)"
    ]  # qkv shards hold whole KV groups
    assert gpt.tp_problems(_tiny("gpt3", n_heads=8, d_model=64), 4) == []
    assert gpt.tp_problems(_tiny("gpt3"), 3)[0] == "parallel.tp=3 does not divide model.n_heads=4"


def test_every_spec_has_a_hugging_face_converter():
    pytest.importorskip("safetensors")
    from scaletrain.checkpoint.hf import CONVERTERS, importer

    for spec in MODELS.values():
        if spec.hf_adapter:  # "" = an architecture without Hugging Face conversion
            assert spec.hf_class and importer(spec.hf_adapter) is CONVERTERS[spec.hf_adapter][1]
    assert importer(["not", "a", "type"]) is CONVERTERS["gpt2"][1]  # GPT-2's importer names what it needed


def test_one_registry_entry_is_enough_for_build_flops_and_layout(monkeypatch):
    from dataclasses import replace

    from scaletrain.config import resolve
    from scaletrain.model import spec as spec_mod
    from scaletrain.model.build import build_model
    from scaletrain.parallel.layout import Layout, LayoutError

    # GPT's module under another name, with grouped K/V declared: a new architecture as the registry sees it.
    monkeypatch.setitem(spec_mod.MODELS, "gptx", replace(MODELS["gpt3"], name="gptx"))
    monkeypatch.setitem(
        architectures.ARCHITECTURES, "gptx", replace(architectures.get("gpt3"), name="gptx", grouped_kv=True)
    )
    cfg = resolve("gpt3-proxy", overrides=["model.arch=gptx", "model.n_kv_heads=2", "parallel.tp=4"])
    tiny = _tiny("gptx", n_kv_heads=0)
    assert sum(p.numel() for p in build_model(tiny).parameters()) == flops.num_params(tiny)
    with pytest.raises(LayoutError, match="does not divide the key/value heads 2"):
        Layout.from_config(cfg, 4)
