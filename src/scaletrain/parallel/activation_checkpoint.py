"""Activation checkpointing of transformer blocks: recompute in backward what forward did not keep.

"full" keeps only each block's input (memory ~ one hidden state per layer, +1/3 compute).
"selective" keeps the outputs of matmuls and attention and recomputes the cheap elementwise work (LayerNorm,
GELU, residual adds, casts): most of full's memory saving on the activations that dominate at long sequence,
at a few percent of compute (Korthikanti et al. 2022, "Reducing Activation Recomputation").
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from scaletrain.model.build import Decoder

MODES = ("none", "full", "selective")


def _selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    ops = torch.ops.aten
    save = {
        ops.mm.default,
        ops.addmm.default,
        ops.bmm.default,
        ops.linear.default,
        ops._scaled_dot_product_flash_attention.default,
        ops._scaled_dot_product_efficient_attention.default,
        ops._scaled_dot_product_flash_attention_for_cpu.default,
    }
    if hasattr(ops, "_scaled_dot_product_cudnn_attention"):
        save.add(ops._scaled_dot_product_cudnn_attention.default)
    if hasattr(ops, "_scaled_mm"):  # FP8 GEMMs (model/fp8.py) are matmuls too
        save.add(ops._scaled_mm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    """Wrap every block of `model` (a GPT or pipeline stage) in place; mode in MODES."""
    if mode not in MODES:
        raise ValueError(f"activation checkpoint mode {mode!r}: must be one of {MODES}")
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # LoRA's adapter dropout must draw the same mask when a block is recomputed.
    kwargs: dict = {"preserve_rng_state": True}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy())
    blocks = cast("Decoder", model).blocks
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block, **kwargs)
