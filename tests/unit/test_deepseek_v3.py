"""DeepSeek-V3 (model.arch "deepseek_v3"): the 671B preset's parameter counts, config validation, and logit parity
with transformers' DeepseekV3ForCausalLM (latent attention, group-limited sigmoid routing with the selection bias,
shared experts, leading dense layers)."""

from __future__ import annotations

import re

import pytest
import torch

from scaletrain.config import ConfigError, MLAConfig, ModelConfig, MoEConfig, resolve
from scaletrain.model.build import build_model
from scaletrain.model.deepseek_v3 import DeepseekV3
from scaletrain.model.moe import MoE, moe_aux_loss


def test_preset_has_671b_parameters_and_37b_active():
    cfg = resolve("deepseek-v3-671b").model
    with torch.device("meta"):
        model = build_model(cfg)
    assert isinstance(model, DeepseekV3) and not model.head_is_tied
    total = sum(p.numel() for p in model.parameters())
    routed = sum(m.experts.w_in.numel() + m.experts.w_out.numel() for m in model.modules() if isinstance(m, MoE))
    active = total - routed + routed * cfg.moe.top_k // cfg.moe.n_experts
    print(f"deepseek-v3-671b: {total:,} parameters, {active:,} active per token")
    # DeepSeek-V3 report: 671B total, 37B activated (the main model; the 14B multi-token prediction module apart).
    # Hand count: per layer MLA 187,107,328 + norms 14,336; dense MLP 3 x 7168 x 18432; MoE 256 + 1 experts of
    # 3 x 7168 x 2048 and the 256 x 7168 router; embedding and head 129280 x 7168 each; final norm 7168.
    assert total == 671_026_404_352
    assert active == 37_552_282_624
    moe_blocks = [i for i, b in model.blocks.items() if isinstance(b.mlp, MoE)]
    assert len(moe_blocks) == 58 and moe_blocks[0] == "3"
    assert cfg.padded_vocab == 129280 and cfg.rope_base == 10000.0


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.mla.kv_lora_rank=0", "model.mla.kv_lora_rank=0: model.arch='deepseek_v3' uses latent attention"),
        ("model.mla.qk_rope_head_dim=63", "model.mla.qk_rope_head_dim=63: must be even"),
        ("model.moe.topk_groups=9", "model.moe.topk_groups=9: must be in [1, model.moe.n_groups=8]"),
        ("model.rope_scaling=yarn", "model.rope_scaling='yarn': model.arch='deepseek_v3' (latent attention)"),
    ],
)
def test_bad_deepseek_fields_get_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve("deepseek-v3-671b", overrides=[override])


transformers = pytest.importorskip("transformers")


def _hf_config(q_lora_rank: int | None):
    return transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )


def _our_config(hf) -> ModelConfig:
    """The scaletrain model section of HF config `hf`."""
    return ModelConfig(
        arch="deepseek_v3",
        n_layers=hf.num_hidden_layers,
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        d_ff=hf.intermediate_size,
        seq_len=hf.max_position_embeddings,
        vocab_size=hf.vocab_size,
        ln_eps=hf.rms_norm_eps,
        rope_theta=hf.rope_parameters["rope_theta"],
        mla=MLAConfig(
            kv_lora_rank=hf.kv_lora_rank,
            q_lora_rank=hf.q_lora_rank or 0,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
        ),
        moe=MoEConfig(
            n_experts=hf.n_routed_experts,
            top_k=hf.num_experts_per_tok,
            d_ff_expert=hf.moe_intermediate_size,
            n_shared=hf.n_shared_experts,
            score_func="sigmoid",
            norm_topk=hf.norm_topk_prob,
            route_scale=hf.routed_scaling_factor,
            n_groups=hf.n_group,
            topk_groups=hf.topk_group,
            first_dense=hf.first_k_dense_replace,
        ),
    )


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up rows [..., f, d] each -> scaletrain's fused [..., 2f, d] with row 2i gate i, 2i+1 up i."""
    return torch.stack((gate, up), dim=-2).flatten(-3, -2)


def _from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF DeepseekV3ForCausalLM state dict -> DeepseekV3's (names in model/deepseek_v3.py's docstring)."""
    out = {"embed.tok.weight": sd["model.embed_tokens.weight"], "ln_f.weight": sd["model.norm.weight"]}
    out["head.weight"] = sd["lm_head.weight"]
    attn = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
    for i in range(cfg.n_layers):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "ln1.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "ln2.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[q + "attn.proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        for name in attn:
            if p + f"self_attn.{name}.weight" in sd:
                out[q + f"attn.{name}.weight"] = sd[p + f"self_attn.{name}.weight"]
        if i < cfg.moe.first_dense:
            out[q + "mlp.fc.weight"] = _interleave(sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"])
            out[q + "mlp.proj.weight"] = sd[p + "mlp.down_proj.weight"]
            continue
        out[q + "mlp.router.gate.weight"] = sd[p + "mlp.gate.weight"]
        out[q + "mlp.router.expert_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
        gate, up = sd[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # HF: [experts, gate rows | up rows, d]
        out[q + "mlp.experts.w_in"] = _interleave(gate, up)
        out[q + "mlp.experts.w_out"] = sd[p + "mlp.experts.down_proj"]
        shared = p + "mlp.shared_experts."
        out[q + "mlp.shared.fc.weight"] = _interleave(sd[shared + "gate_proj.weight"], sd[shared + "up_proj.weight"])
        out[q + "mlp.shared.proj.weight"] = sd[shared + "down_proj.weight"]
    return out


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora", "q_direct"])
def pair(request):
    """(HF model, our model with its weights, tokens); HF's weights widened from its 0.02 init so routing, rotary
    angles and the softmax all matter, and a non-zero selection bias."""
    torch.manual_seed(0)
    hf_cfg = _hf_config(request.param)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    cfg = _our_config(hf_cfg)
    ours = DeepseekV3(cfg).eval()
    missing, unexpected = ours.load_state_dict(_from_hf(hf.state_dict(), cfg), strict=True)
    assert not missing and not unexpected
    tokens = torch.randint(0, 256, (2, 20))
    return hf, ours, tokens


def test_logits_match_transformers(pair):
    hf, ours, tokens = pair
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == want.shape == (2, 20, 256)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert moe_aux_loss(ours) is not None
    assert [type(b.mlp).__name__ for b in ours.blocks.values()] == ["SwiGLU", "MoE", "MoE"]


def test_the_selection_bias_and_group_limit_change_the_routing(pair):
    """The parity above exercises both: without the bias, or with every group eligible, the picks differ."""
    _, ours, tokens = pair
    moe = ours.blocks["1"].mlp
    with torch.no_grad():
        ours(tokens)
        base = moe.tokens_per_expert.clone()
        bias = moe.router.expert_bias.clone()
        moe.router.expert_bias.zero_()
        ours(tokens)
        unbiased = moe.tokens_per_expert.clone()
        moe.router.expert_bias.copy_(bias)
        moe.router.topk_groups = moe.router.n_groups
        ours(tokens)
        ungrouped = moe.tokens_per_expert.clone()
        moe.router.topk_groups = 2
    assert not torch.equal(base, unbiased) and not torch.equal(base, ungrouped)
    assert int(base.sum()) == 2 * 20 * 3  # every token to top_k = 3 experts, none dropped


def test_gradients_match_transformers(pair):
    hf, ours, tokens = pair
    w = torch.randn(2, 20, 256, generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    ours.zero_grad()
    (hf(tokens).logits * w).sum().backward()
    (ours(tokens) * w).sum().backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    pairs = {
        "model.embed_tokens.weight": "embed.tok.weight",
        "model.layers.0.self_attn.kv_b_proj.weight": "blocks.0.attn.kv_b_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": "blocks.1.attn.kv_a_proj_with_mqa.weight",
        "model.layers.2.self_attn.o_proj.weight": "blocks.2.attn.proj.weight",
        "model.layers.1.mlp.gate.weight": "blocks.1.mlp.router.gate.weight",
        "model.layers.2.mlp.experts.down_proj": "blocks.2.mlp.experts.w_out",
        "model.layers.2.mlp.shared_experts.down_proj.weight": "blocks.2.mlp.shared.proj.weight",
    }
    for theirs, mine in pairs.items():
        ref = hf_params[theirs].grad
        # fp32 sums in another order (thread count, flush-to-zero set by earlier in-process runs): the embedding's
        # rows sum dozens of contributions up to ~300, so the absolute tolerance follows each gradient's scale.
        atol = 1e-4 * max(1.0, float(ref.abs().max()) / 10)
        torch.testing.assert_close(our_params[mine].grad, ref, rtol=1e-4, atol=atol, msg=mine)


def test_meta_build_then_init_equals_a_direct_build():
    """init_weights touches every parameter and buffer (the selection bias too): what parallelize relies on."""
    cfg = _our_config(_hf_config(24))
    direct = DeepseekV3(cfg, seed=3)
    with torch.device("meta"):
        lazy = DeepseekV3(cfg, seed=3)
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for b in lazy.buffers():
            b.fill_(float("nan"))  # whatever to_empty left there must be overwritten
    lazy.init_weights(seed=3)
    want = direct.state_dict()
    assert set(lazy.state_dict()) == set(want)
    for name, t in lazy.state_dict().items():
        assert torch.equal(t, want[name]), name
