"""GPT-OSS (scaletrain.model.gpt_oss) against Hugging Face's GptOssForCausalLM, and its pieces."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ModelConfig, MoEConfig, resolve
from scaletrain.model.common import is_sliding, sink_attention
from scaletrain.model.gpt_oss import GptOss

transformers = pytest.importorskip("transformers")


def _tiny_pair(seed: int = 0):
    """A tiny HF GPT-OSS with random weights (every tensor, biases and norms included) and our config of it."""
    from transformers import GptOssConfig, GptOssForCausalLM

    hf_cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        swiglu_limit=1.5,
        swiglu_alpha=1.702,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.25)
    cfg = ModelConfig(
        arch="gpt_oss",
        n_layers=3,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        seq_len=32,
        vocab_size=256,
        vocab_multiple=128,
        ln_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling="yarn",
        rope_factor=32.0,
        rope_original_seq_len=16,
        rope_yarn_truncate=False,
        swiglu_limit=1.5,
        sliding_window=4,
        attn_sinks=True,
        moe=MoEConfig(n_experts=4, top_k=2, d_ff_expert=24, router_bias=True, score_func="softmax"),
    )
    return hf, cfg


def _fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int) -> torch.Tensor:
    """HF q/k/v rows -> our qkv rows (kv_group, [q_0..q_{r-1}, k, v], head_dim); weights or biases."""
    tail = q.shape[1:]
    groups = [t.reshape(n_kv, -1, k.shape[0] // n_kv, *tail) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def _hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {
        "embed.tok.weight": hf_sd["model.embed_tokens.weight"],
        "ln_f.weight": hf_sd["model.norm.weight"],
        "head.weight": hf_sd["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        a = h + "self_attn."
        for kind in ("weight", "bias"):
            sd[o + f"attn.qkv.{kind}"] = _fuse(
                hf_sd[a + f"q_proj.{kind}"], hf_sd[a + f"k_proj.{kind}"], hf_sd[a + f"v_proj.{kind}"], cfg.kv_heads
            )
            sd[o + f"attn.proj.{kind}"] = hf_sd[a + f"o_proj.{kind}"]
            sd[o + f"mlp.router.gate.{kind}"] = hf_sd[h + f"mlp.router.{kind}"]
        sd[o + "attn.sinks"] = hf_sd[a + "sinks"]
        sd[o + "ln1.weight"] = hf_sd[h + "input_layernorm.weight"]
        sd[o + "ln2.weight"] = hf_sd[h + "post_attention_layernorm.weight"]
        e = h + "mlp.experts."
        sd[o + "mlp.experts.w_in"] = hf_sd[e + "gate_up_proj"].transpose(1, 2)  # [E, d, 2f] -> [E, 2f, d]
        sd[o + "mlp.experts.b_in"] = hf_sd[e + "gate_up_proj_bias"]
        sd[o + "mlp.experts.w_out"] = hf_sd[e + "down_proj"].transpose(1, 2)  # [E, f, d] -> [E, d, f]
        sd[o + "mlp.experts.b_out"] = hf_sd[e + "down_proj_bias"]
        sd[o + "mlp.router.expert_bias"] = torch.zeros(cfg.moe.n_experts)
    return sd


def test_logits_match_hugging_face():
    hf, cfg = _tiny_pair()
    ours = GptOss(cfg).eval()
    ours.load_state_dict(_hf_to_ours(hf.state_dict(), cfg), strict=True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    assert want.abs().max() > 1.0  # far from trivial outputs
    assert (got - want).abs().max() < 1e-4
    # The parity is not vacuous: each GPT-OSS feature changes the logits.
    for field, value in (("sliding_window", 0), ("attn_sinks", False), ("swiglu_limit", 0.0), ("rope_scaling", "none")):
        other = ModelConfig(**{**cfg.__dict__, field: value})
        model = GptOss(other).eval()
        model.load_state_dict(ours.state_dict(), strict=False)
        with torch.no_grad():
            assert (model(tokens) - want).abs().max() > 1e-3, field


def test_sliding_layers_alternate_and_window_masks_old_tokens():
    cfg = ModelConfig(arch="gpt_oss", n_layers=4, sliding_window=128)
    assert [is_sliding(cfg, i) for i in range(4)] == [True, False, True, False]
    assert not any(is_sliding(ModelConfig(arch="gpt_oss", n_layers=4), i) for i in range(4))  # no window: full
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    v2 = v.clone()
    v2[:, :, 0] += 10.0  # token 0 is outside the 3-token window of queries 3..5
    a, b = sink_attention(q, k, v, window=3), sink_attention(q, k, v2, window=3)
    assert torch.allclose(a[:, :, 3:], b[:, :, 3:]) and not torch.allclose(a[:, :, :3], b[:, :, :3])
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(sink_attention(q, k, v), full, atol=1e-6)
    # A very negative sink is no sink; a very positive one takes all the weight.
    assert torch.allclose(sink_attention(q, k, v, sinks=torch.full((2,), -1e4)), full, atol=1e-6)
    assert sink_attention(q, k, v, sinks=torch.full((2,), 1e4)).abs().max() < 1e-6


def test_preset_is_the_published_shape():
    cfg = resolve("gpt-oss-20b").model
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size) == (
        "gpt_oss",
        24,
        2880,
        64,
        8,
        64,
    )
    assert (cfg.vocab_size, cfg.seq_len, cfg.sliding_window, cfg.attn_sinks, cfg.rope_kind) == (
        201088,
        8192,
        128,
        True,
        "yarn",
    )
    m = cfg.moe
    assert (m.n_experts, m.top_k, m.d_ff_expert, m.router_bias, m.n_shared) == (32, 4, 2880, True, 0)
    with torch.device("meta"):
        model = GptOss(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embedding = model.embed.tok.weight.numel()
    active = total - embedding - experts + experts * m.top_k // m.n_experts
    # gpt-oss model card (OpenAI 2025, table 1): 20.91B parameters in total; 3.61B active per token, which counts
    # the output layer but not the embedding lookup (MLP 19.12B x 4/32 + attention 0.64B + unembedding 0.58B).
    assert round(total / 1e9, 2) == 20.91 and round(active / 1e9, 2) == 3.61


def test_moe_model_trains_a_step():
    cfg = resolve(
        "gpt-oss-20b",
        overrides=[
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.head_dim=8",
            "model.vocab_size=300",
            "model.moe.n_experts=4",
            "model.moe.top_k=2",
            "model.moe.d_ff_expert=16",
            "model.sliding_window=4",
        ],
    ).model
    model = GptOss(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." not in n)
    assert (
        GptOss(cfg, seed=3)
        .state_dict()["blocks.0.mlp.experts.w_in"]
        .equal(model.state_dict()["blocks.0.mlp.experts.w_in"])
    )  # init is a function of the seed


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.rope_beta_slow=40", r"model.rope_beta_slow=40.0, model.rope_beta_fast=32.0: need 0 < slow < fast"),
        ("model.sliding_window=-1", r"model.sliding_window=-1, model.sliding_window_pattern=2: must be >= 0"),
        ("model.swiglu_alpha=0", r"model.swiglu_limit=7.0, model.swiglu_alpha=0.0: need limit >= 0, alpha > 0"),
    ],
)
def test_bad_gpt_oss_fields_get_one_line_errors(override, message):
    from scaletrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve("gpt-oss-20b", overrides=[override])


def test_yarn_frequencies_match_hugging_face():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scaletrain.model.rope import Rope

    for truncate in (False, True):
        hf_cfg = GptOssConfig(
            head_dim=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": truncate,
                "original_max_position_embeddings": 4096,
            },
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        rope = Rope(150000.0, "yarn", factor=32.0, original_seq_len=4096, truncate=truncate)
        assert torch.allclose(rope.inv_freq(64), inv_freq, rtol=1e-6) and rope.attention_factor == pytest.approx(scale)


def test_a_llama_with_yarn_exports_to_hugging_face_exactly(tmp_path):
    pytest.importorskip("safetensors")
    from transformers import LlamaForCausalLM

    from scaletrain.checkpoint.hf import export_hf
    from scaletrain.model.llama import Llama

    cfg = ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        seq_len=64,
        vocab_size=128,
        init_std=0.3,
        rope_scaling="yarn",
        rope_factor=8.0,
        rope_original_seq_len=8,
    )
    ours = Llama(cfg, seed=1).eval()
    hf = LlamaForCausalLM.from_pretrained(export_hf(ours.state_dict(), cfg, tmp_path / "hf")).eval()
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() < 1e-4
