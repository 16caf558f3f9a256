"""Parameters and model FLOPs per token: the ONE formula shared by the trainer's MFU and the simulator.

Model FLOPs follow Korthikanti et al. 2022 / Megatron-LM's `num_floating_point_operations` (2 FLOPs per
multiply-add, forward + backward = 3x forward, full s^2 attention without causal halving, no recomputation):
with d_ff = 4h this is F/token = 72*l*h^2*(1 + s/(6h) + V/(12*l*h)); GPT-3 175B at V=51200 gives 1.0764e12.
"""

from __future__ import annotations

from scaletrain.config import ModelConfig

# Dense bf16 peaks (TFLOP/s, no sparsity) used as the MFU denominator; vendor datasheets.
DENSE_BF16_PEAK_TFLOPS = {
    "a100": 312.0,
    "h100": 989.0,
    "h200": 989.0,
    "b200": 2250.0,
    "gb200": 2500.0,
    "gb300": 2500.0,
}


def peak_tflops(device) -> tuple[str, float] | None:
    """(table key, dense bf16 TFLOP/s) of a CUDA device from its name, or None (CPU, unknown GPU: no MFU)."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch
    name = torch.cuda.get_device_name(device).lower()
    # Longest key first, so "gb200" wins over "b200" and "h200" over nothing shorter.
    for key in sorted(DENSE_BF16_PEAK_TFLOPS, key=len, reverse=True):
        if key in name.replace(" ", "").replace("-", ""):
            return key, DENSE_BF16_PEAK_TFLOPS[key]
    return None


def num_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Trainable parameters of the gpt3 model (tied head counted once, padded vocabulary rows included)."""
    h, f, l = cfg.d_model, cfg.ffn_size, cfg.n_layers
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    total = l * per_layer + 2 * h
    if include_embeddings:
        total += cfg.padded_vocab * h + cfg.seq_len * h
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length `seq_len` (default: the model's)."""
    h, f, l, v = cfg.d_model, cfg.ffn_size, cfg.n_layers, cfg.padded_vocab
    s = seq_len or cfg.seq_len
    # Forward per token: QKV + attention output (8h^2), two FFN GEMMs (4hf), QK^T and AV over s keys (4sh),
    # then the logit GEMM (2hV). Backward doubles it.
    forward = 2 * l * (4 * h * h + 2 * h * f + 2 * s * h) + 2 * h * v
    return 3.0 * forward


def mfu(tokens_per_s: float, cfg: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over `peak_flops` (pass the dense bf16 peak)."""
    return tokens_per_s * flops_per_token(cfg) / peak_flops
