"""Global gradient-norm clipping over plain tensors and DTensors of any layout, across pipeline stages."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def align_grad_placements(params) -> None:
    """Give every DTensor gradient its parameter's placements.

    DTensor's embedding backward returns a replicated gradient for a vocabulary-sharded weight; sharding it like
    the weight is a local slice (no communication) and keeps the norm, clipping and optimizer on one layout.
    """
    for p in params:
        g = p.grad
        if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def total_grad_norm(params, pp_group=None, exclude=None) -> float:
    """L2 norm of all gradients as if the model were on one device.

    DTensor gradients (FSDP/TP shards) are reduced over their shard dims only, never counted twice along
    replicated dims; one collective per distinct (mesh, placements), not per parameter. With pipeline
    parallelism the squared norms of the stages are summed over `pp_group`. `exclude(p)` drops duplicates
    (a pipeline's second copy of a tied matrix).
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None or (exclude is not None and exclude(p)):
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else "plain"
        groups.setdefault(key, []).append(g)
    device = next((_local(gs[0]).device for gs in groups.values()), torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        sq = sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return float(sq.sqrt())


@torch.no_grad()
def clip_grads_(params, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)) (torch's clip_grad_norm_ rule)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef)
