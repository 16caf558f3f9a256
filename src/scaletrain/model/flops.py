"""Parameters and model FLOPs per token: the ONE formula shared by the trainer's MFU and the simulator.

Every count here is the simulator's per-layer inventory (`scaletrain.sim.layers`) of the model config, so the
trainer's MFU and the simulator's cannot disagree. Model FLOPs follow Korthikanti et al. 2022 / Megatron-LM's
`num_floating_point_operations` (2 FLOPs per multiply-add, forward + backward = 3x forward, full s^2 attention
without causal halving, no recomputation): for a dense GPT with d_ff = 4h that is
F/token = 72*l*h^2*(1 + s/(6h) + V/(12*l*h)); GPT-3 175B at V=51200 gives 1.0764e12. Mixture-of-Experts models
count the top-k routed experts a token goes through, not all of them. Tests pin the counts to the real modules and
to the published figures (Llama-2-7B: 6,738,415,616 parameters; GPT-OSS 20B: 20.9B, 3.6B active; DeepSeek-V3: 671B,
37B).
"""

from __future__ import annotations

from scaletrain.config import ModelConfig
from scaletrain.sim.layers import Inventory, shape_of


def _inventory(cfg: ModelConfig, lora_rank: int = 0, lora_targets=("qkv", "proj")) -> Inventory:
    """The simulator's inventory of `cfg`, trained with LoRA adapters of `lora_rank` on `lora_targets` (rank 0:
    fully)."""
    return Inventory(shape_of(cfg, max(lora_rank, 0), tuple(lora_targets)))


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token's FLOPs go through (the routed experts it is sent to; not the input embedding)."""
    return _inventory(cfg).active_params


def lora_params(cfg: ModelConfig, rank: int, targets=("qkv", "proj")) -> int:
    """Adapter parameters: r * (fan_in + fan_out) per adapted projection per layer (architectures.LORA_TARGETS)."""
    return _inventory(cfg, rank, targets).adapter_params


def num_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameters of the base model (tied head counted once, padded vocabulary rows included; no adapters)."""
    inv = _inventory(cfg)
    return inv.params if include_embeddings else inv.params - inv.embedding_params - inv.head_params


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Forward model FLOPs per token by kind: "gemm" (layer weights), "attn" (QK^T and AV), "logits"."""
    return _inventory(cfg).forward_flops(seq_len or cfg.seq_len)


def flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, lora_rank: int = 0, lora_targets=("qkv", "proj")
) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length `seq_len` (default: the model's).

    Full training: backward = 2x forward. With LoRA (rank > 0) the base weights are frozen, so their GEMMs
    need only the input gradient in backward (1x forward), attention keeps its 2x, and the adapters add
    3 x 2 x their parameters.
    """
    return _inventory(cfg, lora_rank, lora_targets).flops_per_token(seq_len or cfg.seq_len)


def mfu(tokens_per_s: float, cfg: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_flops` (pass the dense bf16 peak: the hardware
    catalog's `bf16_tflops`, looked up by `scaletrain.sim.catalog.mfu_peak`)."""
    return tokens_per_s * flops_per_token(cfg) / peak_flops
