"""The GPT-OSS decoder (= Hugging Face `GptOssForCausalLM`), single-device and plain: the shared decoder of
model/common.py with its own MLPs.

GPT-OSS (OpenAI 2025; HF transformers models/gpt_oss) is a Llama-style pre-norm decoder (RMSNorm, rotate_half
rotary positions, grouped-query attention, untied head) with these differences, each an architecture fact or a
model config field that model/common.py's `Attention` honours:

* attention projections with biases (the `biases` fact) and a head size of its own (model.head_dim: 64 at
  d_model 2,880);
* attention sinks (model.attn_sinks): a learned logit per head joins each softmax row as an extra column that is
  dropped after the softmax, so a head can put weight on nothing;
* alternating attention spans (model.sliding_window, model.sliding_window_pattern): even layers see the last 128
  tokens (the token itself and 127 before it), odd layers the whole causal context;
* YaRN rotary scaling (model.rope_scaling "yarn", base 150,000, factor 32 over an original 4,096 context), in
  `model.rope.Rope`.

Its own part is the MLP: Mixture-of-Experts (model.moe: 32 experts, top-4, softmax over the chosen experts' logits,
router bias) whose experts use the clamped SwiGLU with biases (model.swiglu_limit 7, model.swiglu_alpha 1.702):
`model.moe.MoE`. With model.moe.n_experts 0 the MLP is one dense SwiGLU of that kind (`mlp.fc`/`mlp.proj`).
A layer with sinks or a window computes its softmax explicitly, which context parallelism does not shard yet.
"""

from __future__ import annotations

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.common import Decoder, SwiGLU
from scaletrain.model.moe import MoE

__all__ = ["GptOss"]


class GptOss(Decoder):
    """GPT-OSS decoder. `forward(tokens)` returns logits over the padded vocabulary (pipeline stages as Llama)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        if cfg.n_heads % cfg.kv_heads or cfg.head_size % 2:
            raise ValueError(
                f"gpt_oss needs n_kv_heads | n_heads and an even head size, got n_heads={cfg.n_heads} "
                f"n_kv_heads={cfg.kv_heads} head size {cfg.head_size}"
            )
        super().__init__(cfg, seed)

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """A MoE layer, or with model.moe.n_experts 0 a dense clamped SwiGLU with biases."""
        if cfg.moe.n_experts > 0:
            return MoE(cfg)
        return SwiGLU(cfg.d_model, cfg.ffn_size, bias=True, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
