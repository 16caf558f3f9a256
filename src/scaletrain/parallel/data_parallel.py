"""Data parallelism applied last: FSDP2 `fully_shard` (ZeRO-3, or HSDP on a 2-D mesh) or composable DDP.

FSDP units: one per transformer block, then the root, which holds the embedding, the final LayerNorm and the
tied output layer (one unit, so the tied matrix is gathered once and its two gradient contributions are summed
before the reduce-scatter). With bf16 training FSDP gathers bf16 parameters and reduces gradients in fp32. FP8
linears with tensorwise scaling (model/fp8.py, converted with `fsdp_all_gather`) carry torchao's weight subclass,
so their shards are cast to FP8 before the all-gather (half the bytes) with scales the trainer precomputes after
each optimizer step (`precompute_fp8_scales`); torchao has this for tensorwise scaling only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from scaletrain.model.build import Decoder


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None, reshard_after_forward: bool = True) -> None:
    """fully_shard every block and then `model` over `dp_mesh` (1-D: FSDP; 2-D (replicate, shard): HSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(cast("Decoder", model).blocks.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keeping them saves one all-gather.
        fully_shard(
            block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dp_mesh) -> None:
    """Composable DDP (gradient all-reduce bucketed and overlapped with backward) over the 1-D `dp_mesh`."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on/off for the next backward (off for all but the last accumulation micro-batch)."""
    # fully_shard (FSDPModule) and replicate (its DDP mixin) both add this method to the module's class.
    sync = getattr(model, "set_requires_gradient_sync", None)
    if sync is not None:
        sync(enabled)
