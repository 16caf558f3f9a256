"""Parameters and model FLOPs per token: the ONE formula shared by the trainer's MFU and the simulator.

Model FLOPs follow Korthikanti et al. 2022 / Megatron-LM's `num_floating_point_operations` (2 FLOPs per
multiply-add, forward + backward = 3x forward, full s^2 attention without causal halving, no recomputation):
with d_ff = 4h this is F/token = 72*l*h^2*(1 + s/(6h) + V/(12*l*h)); GPT-3 175B at V=51200 gives 1.0764e12.
The simulator's per-layer inventory (`scaletrain.sim.layers`) derives the same figures op by op; a test ties them.
"""

from __future__ import annotations

from scaletrain import architectures
from scaletrain.config import ModelConfig


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
    fwd = forward_flops_per_token(cfg, seq_len)
    if lora_rank <= 0:
        return 3.0 * sum(fwd.values())
    adapters = lora_params(cfg, lora_rank, lora_targets)
    return 2.0 * (fwd["gemm"] + fwd["logits"]) + 3.0 * fwd["attn"] + 6.0 * adapters


def mfu(tokens_per_s: float, cfg: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_flops` (pass the dense bf16 peak: the hardware
    catalog's `bf16_tflops`, looked up by `scaletrain.sim.catalog.mfu_peak`)."""
    return tokens_per_s * flops_per_token(cfg) / peak_flops
