"""Expert parallelism: each EP rank holds n_experts / ep routed experts; token rows reach them by all-to-all.

torchtitan's scheme (its `ExpertParallel` style and `_token_dispatch` / `_token_combine`), on `MoE.experts`
only, so routing, the auxiliary loss, capacity and `combine` stay the one-process code of model/moe.py:

- Weights: `w_in`, `w_out` (and `b_in`, `b_out`) become DTensors sharded on the experts dim over the "ep" mesh
  (Shard(0)). DTensor rather than plain local slices because the layout-independent init, distributed
  checkpoints, the global gradient norm and the dry run's shard report then all see the global [n_experts, ...]
  tensor, and FSDP2 shards them further over "efsdp" as it does tensor-parallel weights (both meshes are slices
  of one expert DeviceMesh, layout.py).
- Forward: `MoE.dispatch` hands the experts every (token, expert) row of this rank sorted by global expert, with
  per-expert counts. The counts are exchanged first (all-to-all of [ep, local experts]), then the rows go to the
  rank owning their expert (`all_to_all_single` with those split sizes), are reordered expert-major, run through
  the local experts, reordered back and returned by the reverse all-to-all, so `combine` gets its rows in the
  order it sent them. Both all-to-alls are differentiable (backward is the opposite all-to-all).
- Gradients: an expert's gradient sums the tokens of all ep ranks, so it must be divided by the whole dp x cp
  world (as every other gradient), while FSDP divides it by the (dp_replicate x) efsdp ranks alone. torchtitan
  sets FSDP's gradient divide factor; that uses a PREMUL_SUM reduction gloo lacks, so here the local weights'
  gradients are scaled by efsdp / (dp_shard x cp) = tp / ep on their way back instead (exact for powers of two):
  1/ep without tensor parallelism; with it, the tp ranks of an ep group hold shards of the same sequences, whose
  gradients add up rather than average.

Apply after tensor parallelism and before activation checkpointing, compile and FSDP (parallelize.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.model.moe import GroupedExperts, moe_layers


class _AllToAll(torch.autograd.Function):
    """Differentiable `all_to_all_single` of rows: backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows `x` split by `in_splits` (one chunk per rank of `group`) exchanged; returns the received rows."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _LocalExperts:
    """The local shards of a `GroupedExperts`' weights, run by GroupedExperts' own forward code."""

    # GroupedExperts' methods read only these attributes; mypy cannot see that this duck type fits them.
    forward: Any = GroupedExperts.forward
    _grouped: Any = GroupedExperts._grouped
    _forward_loop: Any = GroupedExperts._forward_loop
    _forward_grouped: Any = GroupedExperts._forward_grouped

    def __init__(self, experts: GroupedExperts, grad_scale: float):
        def local(t):
            if t is None:
                return None
            return _ScaleGrad.apply(t.to_local() if hasattr(t, "to_local") else t, grad_scale)

        self.w_in, self.w_out = local(experts.w_in), local(experts.w_out)
        self.b_in, self.b_out = local(experts.b_in), local(experts.b_out)
        self.limit, self.alpha, self.use_grouped_mm = experts.limit, experts.alpha, experts.use_grouped_mm


class ExpertParallelExperts(GroupedExperts):
    """`GroupedExperts` whose weights are sharded over an EP group; `forward(x, counts)` keeps its contract
    (rows sorted by global expert, counts [n_experts] -> rows in the same order) and adds the all-to-alls."""

    ep_group: dist.ProcessGroup
    grad_scale: float

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ep = dist.get_world_size(group)
        n_local = counts.numel() // ep
        send = counts.view(ep, n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=group)  # recv[q, l]: rows rank q sends expert l
        in_splits = send.sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        rows = all_to_all_rows(x, out_splits, in_splits, group)  # source-major, expert-major inside a source
        # Reorder source-major -> expert-major (stable: inside an expert, sources in rank order, rows as sent).
        src_expert = torch.arange(ep * n_local, device=x.device).view(ep, n_local).flatten()
        owner = src_expert.remainder(n_local).repeat_interleave(recv.flatten().to(x.device))
        order = owner.argsort(stable=True)
        local = _LocalExperts(self, self.grad_scale)
        if rows.shape[0]:
            y = local.forward(rows[order], recv.sum(0))
        else:
            # No rows for any local expert: still connect the output to the received rows and the weights, so the
            # backward all-to-alls and FSDP's gradient reduce-scatter run on every rank (zero gradients here).
            weights = [w for w in (local.w_in, local.w_out, local.b_in, local.b_out) if w is not None]
            y = rows * 0 + sum(w.sum() * 0 for w in weights)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_rows(y[back], in_splits, out_splits, group)


def apply_expert_parallel(model: nn.Module, ep_mesh, tp: int = 1) -> None:
    """Shard every MoE layer's routed experts of `model` (meta or real) over the 1-D `ep_mesh` (module docstring);
    `tp` is the tensor-parallel degree whose ranks the ep group holds whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for moe in moe_layers(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]), param.requires_grad)
            experts.register_parameter(name, sharded)
        experts.__class__ = ExpertParallelExperts
        experts.ep_group = ep_mesh.get_group()
        experts.grad_scale = tp / ep_mesh.size()


def expert_fsdp(model: nn.Module, expert_dp_mesh, mp_policy, reshard_after_forward: bool) -> None:
    """fully_shard every MoE layer's experts over `expert_dp_mesh` (before the blocks: the block's unit then leaves
    them out)."""
    from torch.distributed.fsdp import fully_shard

    for moe in moe_layers(model):
        fully_shard(moe.experts, mesh=expert_dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
