"""The GPT-OSS decoder (= Hugging Face `GptOssForCausalLM`), single-device and plain, with Llama's seams.

GPT-OSS (OpenAI 2025; HF transformers models/gpt_oss) is a Llama-style pre-norm decoder (RMSNorm, rotate_half
rotary positions, grouped-query attention, untied head) with these differences, each a model config field:

* attention projections with biases and a head size of its own (model.head_dim: 64 at d_model 2,880);
* attention sinks (model.attn_sinks): a learned logit per head joins each softmax row as an extra column that is
  dropped after the softmax, so a head can put weight on nothing;
* alternating attention spans (model.sliding_window, model.sliding_window_pattern): even layers see the last 128
  tokens (the token itself and 127 before it), odd layers the whole causal context;
* YaRN rotary scaling (model.rope_scaling "yarn", base 150,000, factor 32 over an original 4,096 context), in
  `model.llama.Rope`;
* Mixture-of-Experts MLPs (model.moe: 32 experts, top-4, softmax over the chosen experts' logits, router bias)
  whose experts use the clamped SwiGLU with biases (model.swiglu_limit 7, model.swiglu_alpha 1.702):
  `model.moe.MoE`. With model.moe.n_experts 0 the MLP is one dense SwiGLU of that kind (`mlp.fc`/`mlp.proj`).

Seams as Llama's: `embed.tok`, `blocks.<i>.{ln1, attn.qkv, attn.proj, attn.sinks, ln2, mlp}`, `ln_f`, `head`,
`attn.qkv` rows in Llama's (kv_group, [q_0..q_{r-1}, k, v], head_dim) order, a pipeline stage is this class with
modules set to None. `attn.core` is SDPA's causal attention only in a layer without sinks or window; a layer with
either computes its softmax explicitly (as HF's eager path does), which context parallelism does not shard yet.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.gpt import causal_attention
from scaletrain.model.init import normal_
from scaletrain.model.llama import Embeddings, Rope, UntiedDecoder, rope_cos_sin, rotate_half
from scaletrain.model.moe import MoE, SwiGLU

__all__ = ["GptOss", "sink_attention", "is_sliding"]


def is_sliding(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` uses the sliding window (model.sliding_window_pattern: the last of every run of that
    many layers has full attention; GPT-OSS's 2 makes even layers sliding)."""
    p = cfg.sliding_window_pattern
    return cfg.sliding_window > 0 and (p == 0 or (layer + 1) % p != 0)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, head_dim] with an optional sliding window (key j is visible from
    query i when i - window < j <= i) and optional per-head sink logits [heads]; HF GPT-OSS's eager attention."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    i = torch.arange(s, device=q.device)
    visible = i[None, :] <= i[:, None]
    if window > 0:
        visible = visible & (i[None, :] > i[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        scores = torch.cat([scores, sink], dim=-1)
    # Subtracting the row max before the softmax keeps bf16 from overflowing (HF does the same).
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class Attention(nn.Module):
    """Grouped-query attention with biases, rotary (YaRN) positions, optional sinks and sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.head_dim = cfg.head_size
        self.n_rep = cfg.n_heads // cfg.kv_heads
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim, bias=True)
        self.proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=True)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attn_sinks else None
        self.window = cfg.sliding_window if is_sliding(cfg, layer) else 0
        self.core = causal_attention  # used only without sinks and window (module docstring)
        self.rope = Rope.of(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        r, hd = self.n_rep, self.head_dim
        y = self.qkv(x).view(b, s, -1, r + 2, hd)
        g = y.shape[2]
        q = y[:, :, :, :r].reshape(b, s, g * r, hd).transpose(1, 2)
        k, v = y[:, :, :, r].transpose(1, 2), y[:, :, :, r + 1].transpose(1, 2)
        if positions is None:
            core_positions = getattr(self.core, "positions", None)
            positions = core_positions(s, x.device) if core_positions else torch.arange(s, device=x.device)
        cos, sin = rope_cos_sin(positions, hd, q.dtype, self.rope)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if r > 1:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        if self.sinks is None and not self.window:
            out = self.core(q, k, v)
        else:
            if self.core is not causal_attention:  # a swapped core (context parallelism) would be bypassed
                raise NotImplementedError("a replaced attention core with attention sinks or a sliding window")
            sinks = self.sinks
            if sinks is not None and hasattr(sinks, "to_local"):  # tensor parallel: this rank's heads' sinks
                sinks = sinks.to_local()
            out = sink_attention(q, k, v, self.window, sinks)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)); mlp is a MoE (or a dense clamped SwiGLU)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg, layer)
        self.ln2 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp: nn.Module = (
            MoE(cfg)
            if cfg.moe.n_experts > 0
            else SwiGLU(cfg.d_model, cfg.ffn_size, bias=True, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if positions is None else self.attn(self.ln1(x), positions=positions))
        return x + self.mlp(self.ln2(x))


class GptOss(UntiedDecoder):
    """GPT-OSS decoder. `forward(tokens)` returns logits over the padded vocabulary (pipeline stages as Llama)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.n_heads % cfg.kv_heads or cfg.head_size % 2:
            raise ValueError(
                f"gpt_oss needs n_kv_heads | n_heads and an even head size, got n_heads={cfg.n_heads} "
                f"n_kv_heads={cfg.kv_heads} head size {cfg.head_size}"
            )
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.ln_f: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.init_weights(seed)

    def init_weights(self, seed: int = 0) -> None:
        """Matrices, embeddings and sinks N(0, init_std) from layout-independent streams; biases 0, norms 1.

        Must touch every parameter and buffer (called again after `to_empty`)."""
        std = self.cfg.init_std
        for name, module in self.plain_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoE):  # its own linears come next in named_modules and draw the same values
                module.init_weights(std, seed, name)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                normal_(module.weight, std, seed, f"{name}.weight")
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Attention) and module.sinks is not None:
                normal_(module.sinks, std, seed, f"{name}.sinks")
