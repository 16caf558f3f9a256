"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as Hugging Face transformers' `DeepseekV3Attention` computes it.

Keys and values come from one low-rank latent per token: `kv_a_proj_with_mqa` maps the hidden state to a
kv_lora_rank latent (normalised by `kv_a_layernorm`) plus one qk_rope_head_dim rotary key shared by every head,
and `kv_b_proj` decompresses the latent into each head's qk_nope_head_dim key part and v_head_dim value. Queries
come through a low-rank bottleneck too (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) or, with q_lora_rank 0, straight
from the hidden state (`q_proj`). Each head's query and key are [nope | rope]; rotary positions touch only the rope
part ("decoupled" rotary: the latent stays position-free, which is what lets inference cache it compressed).

Rotary layout: DeepSeek's checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... by one frequency each, HF's
`rope_interleave=True` (its default, and DeepSeek's own `view_as_complex` code). Like HF, the rotated part comes out
as [even slots | odd slots]; queries and keys are permuted alike, so the scores are those of the pairwise form.

Softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim). No YaRN: DeepSeek-V3 was pretrained at 4K context
with plain rotary frequencies and stretched with YaRN (factor 40, mscale 1) only afterwards, and MLPerf's
deepseekv3_671b trains at 4,096, so scaletrain's rotary settings (`model.rope_*`, base from the architecture) apply
unchanged; HF's extra mscale factor on the scale applies only when its config names a scaled rope type. So
model.rope_scaling "yarn" (GPT-OSS's form, which scales cos/sin instead) is refused here rather than misapplied.

Layout seams: the output projection is `proj` (as in GPT and Llama), attention goes through a swappable `core`, and
heads are counted from the local width of `kv_b_proj`/`q_b_proj`, so a column shard of those (whole heads) works.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.common import causal_attention, token_positions
from scaletrain.model.rope import Rope, rope_cos_sin

__all__ = ["MLA", "LATENT_NORM_EPS", "rope_interleaved"]

LATENT_NORM_EPS = 1e-6
"""Epsilon of the query and key/value latent RMSNorms: fixed in DeepSeek's and HF's code (not rms_norm_eps)."""


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of `x` by the angles of `cos`/`sin` [seq, dim/2] (HF's interleaved form).

    Returns [rotated even slots | rotated odd slots], bit for bit HF's `apply_rotary_pos_emb_interleave`.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` in the norm weight's dtype: under autocast the latents arrive in bf16, and an fp32 RMSNorm on them
    would fall back from the fused kernel (with a warning); fp32 is also what HF normalises in."""
    assert norm.weight is not None
    return norm(x.to(norm.weight.dtype))


class MLA(nn.Module):
    """Causal multi-head latent attention over [batch, seq, d_model] (module docstring); no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.mla
        if a.kv_lora_rank <= 0 or a.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLA needs model.mla.kv_lora_rank > 0 and an even qk_rope_head_dim, got {a.kv_lora_rank}, "
                f"{a.qk_rope_head_dim}"
            )
        if cfg.rope_kind == "yarn":
            raise ValueError("MLA does not implement DeepSeek's YaRN (its softmax mscale); use model.rope_scaling none")
        h, d = cfg.n_heads, cfg.d_model
        self.nope, self.rope_dim, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank = a.kv_lora_rank
        qk = self.nope + self.rope_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: nn.RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if a.q_lora_rank:
            self.q_a_proj = nn.Linear(d, a.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(a.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(a.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, a.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(a.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.proj = nn.Linear(h * self.v_dim, d, bias=False)
        # SDPA's default scale is 1/sqrt(q's last dim) = 1/sqrt(nope + rope), DeepSeek's without YaRN.
        self.core = causal_attention  # context parallelism swaps in a sequence-sharded implementation
        self.rope = Rope.of(cfg)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head queries [batch, seq, heads, nope + rope] before rotary positions."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(_norm(self.q_a_layernorm, self.q_a_proj(x)))
        return q.unflatten(-1, (-1, self.nope + self.rope_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q_nope, q_rot = self.queries(x).transpose(1, 2).split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = (
            self.kv_b_proj(_norm(self.kv_a_layernorm, latent))
            .unflatten(-1, (-1, self.nope + self.v_dim))
            .transpose(1, 2)
        )
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [b, heads, s, nope], [b, heads, s, v]
        if positions is None:
            positions = token_positions(self.core, s, x.device)
        cos, sin = rope_cos_sin(positions, self.rope_dim, q_rot.dtype, self.rope)
        cos, sin = cos[:, : self.rope_dim // 2], sin[:, : self.rope_dim // 2]  # cat(freqs, freqs): one per pair
        q = torch.cat((q_nope, rope_interleaved(q_rot, cos, sin)), dim=-1)
        k_rot = rope_interleaved(k_rot.unsqueeze(1), cos, sin)  # [b, 1, s, rope]: one rotary key for all heads
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        out = self.core(q, k, v)  # [b, heads, s, v]
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))
