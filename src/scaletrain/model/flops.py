"""Parameters and model FLOPs per token: the ONE formula shared by the trainer's MFU and the simulator.

Model FLOPs follow Korthikanti et al. 2022 / Megatron-LM's `num_floating_point_operations` (2 FLOPs per
multiply-add, forward + backward = 3x forward, full s^2 attention without causal halving, no recomputation):
with d_ff = 4h this is F/token = 72*l*h^2*(1 + s/(6h) + V/(12*l*h)); GPT-3 175B at V=51200 gives 1.0764e12.
The simulator's per-layer inventory (`scaletrain.sim.layers`) derives the same figures op by op; a test ties them.
Mixture-of-Experts models (FLOPs count the top-k routed experts a token goes through, not all of them), latent
attention and heads narrower or wider than d_model / n_heads have no closed form here: for them the inventory is
the formula (`_inventory`), pinned by tests on the published counts (GPT-OSS 20B: 20.9B parameters, 3.6B active;
DeepSeek-V3: 671B, 37B).
"""

from __future__ import annotations

from scaletrain import architectures
from scaletrain.config import ModelConfig


def _inventory(cfg: ModelConfig, lora_rank: int = 0, lora_targets=("qkv", "proj")):
    """The simulator's inventory of `cfg` when the closed forms below do not describe it (MoE, MLA, an explicit
    head_dim, sliding windows, QK-norm), else None."""
    special = (
        cfg.moe.n_experts > 0
        or cfg.mla.kv_lora_rank > 0
        or cfg.head_dim > 0
        or bool(getattr(cfg, "sliding_window", 0))
        or bool(getattr(cfg, "attn_sinks", False))
        or architectures.get(cfg.arch).qk_norm
    )
    if not special:
        return None
    from scaletrain.sim.layers import Inventory, shape_of

    return Inventory(shape_of(cfg, lora_rank, tuple(lora_targets)))


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token's FLOPs go through (the routed experts it is sent to; not the input embedding)."""
    inv = _inventory(cfg)
    if inv is not None:
        return inv.active_params
    return num_params(cfg) - _embed(cfg)


def _embed(cfg: ModelConfig) -> int:
    """Input-only embedding parameters: the token table unless the head is tied to it, and learned positions."""
    spec = architectures.get(cfg.arch)
    return cfg.padded_vocab * cfg.d_model * (0 if spec.tied_head else 1) + (
        cfg.seq_len * cfg.d_model if spec.learned_positions else 0
    )


def _attn_proj_params(cfg: ModelConfig) -> int:
    """Weights of the fused QKV and output projections of one layer (grouped-query K/V are narrower)."""
    h, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    return h * (h + 2 * cfg.kv_heads * hd) + h * h


def _mlp_params(cfg: ModelConfig) -> int:
    """Weights of one layer's MLP: two matrices (GELU) or three (SwiGLU gate, up, down)."""
    return architectures.get(cfg.arch).mlp_matrices * cfg.d_model * cfg.ffn_size


def lora_params(cfg: ModelConfig, rank: int, targets=("qkv", "proj")) -> int:
    """Adapter parameters: r * (fan_in + fan_out) per adapted projection per layer."""
    if rank <= 0:
        return 0
    h, f, hd = cfg.d_model, cfg.ffn_size, cfg.d_model // cfg.n_heads
    fans = {
        "qkv": (h, h + 2 * cfg.kv_heads * hd),
        "proj": (h, h),
        "fc1": (h, f * (2 if architectures.get(cfg.arch).gated_mlp else 1)),
        "fc2": (f, h),
    }
    return cfg.n_layers * sum(rank * sum(fans[t]) for t in targets)


def num_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameters of the base model (tied head counted once, padded vocabulary rows included; no adapters)."""
    inv = _inventory(cfg)
    if inv is not None:
        out: int = inv.params
        return out if include_embeddings else out - inv.embedding_params - inv.head_params
    spec = architectures.get(cfg.arch)
    h, f, hd = cfg.d_model, cfg.ffn_size, cfg.d_model // cfg.n_heads
    per_layer = _attn_proj_params(cfg) + _mlp_params(cfg) + 2 * spec.norm_weights * h  # two norms per block
    if spec.biases:  # qkv, attention output, fc (gate and up when gated), MLP output
        per_layer += (h + 2 * cfg.kv_heads * hd) + h + (spec.mlp_matrices - 1) * f + h
    total = cfg.n_layers * per_layer + spec.norm_weights * h  # final norm
    if include_embeddings:
        total += cfg.padded_vocab * h * (1 if spec.tied_head else 2)
        total += cfg.seq_len * h if spec.learned_positions else 0
    return total


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Forward model FLOPs per token by kind: "gemm" (layer weights), "attn" (QK^T and AV), "logits"."""
    h, n_layers, v = cfg.d_model, cfg.n_layers, cfg.padded_vocab
    s = seq_len or cfg.seq_len
    inv = _inventory(cfg)
    if inv is not None:
        return inv.forward_flops(s)
    # Full s^2 attention (no causal halving), as Megatron counts it: QK^T and AV are 2*s*h multiply-adds each.
    return {
        "gemm": 2.0 * n_layers * (_attn_proj_params(cfg) + _mlp_params(cfg)),
        "attn": 2.0 * n_layers * 2 * s * h,
        "logits": 2.0 * h * v,
    }


def flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, lora_rank: int = 0, lora_targets=("qkv", "proj")
) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length `seq_len` (default: the model's).

    Full training: backward = 2x forward. With LoRA (rank > 0) the base weights are frozen, so their GEMMs
    need only the input gradient in backward (1x forward), attention keeps its 2x, and the adapters add
    3 x 2 x their parameters.
    """
    inv = _inventory(cfg, max(lora_rank, 0), lora_targets)
    if inv is not None:
        return float(inv.flops_per_token(seq_len or cfg.seq_len))
    fwd = forward_flops_per_token(cfg, seq_len)
    if lora_rank <= 0:
        return 3.0 * sum(fwd.values())
    adapters = lora_params(cfg, lora_rank, lora_targets)
    return 2.0 * (fwd["gemm"] + fwd["logits"]) + 3.0 * fwd["attn"] + 6.0 * adapters


def mfu(tokens_per_s: float, cfg: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_flops` (pass the dense bf16 peak: the hardware
    catalog's `bf16_tflops`, looked up by `scaletrain.sim.catalog.mfu_peak`)."""
    return tokens_per_s * flops_per_token(cfg) / peak_flops
