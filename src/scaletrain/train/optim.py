"""Adam with decoupled weight decay and the MLPerf gpt3 learning-rate rule."""

from __future__ import annotations

import math
from typing import Any

import torch

from scaletrain.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW over every parameter: the gpt3 rule decays LayerNorm weights and biases too (no exclusion groups)."""
    params = [p for p in params if p.requires_grad]
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if device_type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def lr_at(step: int, cfg: OptimConfig, global_batch_size: int) -> float:
    """LR of 1-based optimizer step `step` counted from the schedule's origin (checkpoint steps included).

    Linear warm-up to the base LR over ceil(warmup_samples/GBS) steps, then cosine decay to base*end_lr_ratio
    at ceil(decay_samples/GBS) steps, constant after. At the gpt3 benchmark's first step (3001 at GBS 2048)
    this gives ~0.997*base, as the reference does.
    """
    base, end = cfg.lr, cfg.lr * cfg.end_lr_ratio
    warmup, decay = cfg.warmup_steps(global_batch_size), cfg.decay_steps(global_batch_size)
    if warmup > 0 and step <= warmup:
        return base * step / warmup
    if step >= decay:
        return end
    progress = (step - warmup) / (decay - warmup)
    return end + (base - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write `lr` into every param group (the schedule is computed, not stepped, so resume is exact)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
