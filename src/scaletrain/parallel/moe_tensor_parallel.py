"""Tensor parallelism of MoE layers: each tp rank routes the tokens of its own sequence shard.

Routing is per token, so under sequence parallelism (required with MoE, parallel/layout.py) a tp rank needs no
other rank's tokens to route its own: torchtitan's expert-tensor-parallel degree 1, where the all-gather of the
MoE input and the later split of the tokens over tp ranks cancel. Per MoE layer:

- The MoE input stays this rank's local sequence shard (a plain tensor), and so does its output, which is added to
  the residual stream of the same shard.
- Router: its gate is replicated over tp (Replicate DTensors, like the sequence-parallel norms); the scores use the
  local weight whose gradient is marked Partial, so it is summed over the tp ranks' tokens where DTensor sums the
  norms' gradients.
- Auxiliary loss: the Switch loss is not additive over token shards (a product of two means), so each rank takes
  the tp group's summed assignment counts (Megatron-LM's scheme) and its own scores: the ranks' losses then sum to
  the loss of the whole sequence, and each rank's share carries the gradient of its own tokens. The trainer sums
  the shares over tp ranks like every rank's statistics (train/moe_stats.py).
- Routed experts: left to expert parallelism, whose group holds whole tp groups (ep a multiple of tp), so every
  expert's gradient sums the tokens of all tp ranks (parallel/expert_parallel.py scales it accordingly).
- Shared experts: column- then row-parallel like a dense MLP (an all-gather of the shard in, a reduce-scatter out).

Capacity (model.moe.capacity_factor > 0) is then applied per rank's token shard, not per sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.model.moe import MoE, Router, moe_layers

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel.style import ParallelStyle


def _local_partial(t: torch.Tensor) -> torch.Tensor:
    """The local view of a replicated DTensor whose gradient is this rank's partial sum (plain tensors as they are)."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])


class SequenceShardRouter(Router):
    """A Router whose replicated gate sees only this rank's tokens (module docstring)."""

    def gate_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.gate.bias
        return _local_partial(self.gate.weight), _local_partial(bias) if bias is not None else None


class SequenceShardMoE(MoE):
    """An MoE layer routing this tp rank's sequence shard, with the auxiliary loss shared out (module docstring)."""

    tp_group: dist.ProcessGroup

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's share of the Switch loss of the tp group's tokens: the shares sum to `MoE.balance_loss` of
        the whole sequence."""
        total = counts.detach().clone()
        dist.all_reduce(total, group=self.tp_group)
        tokens = scores.shape[0] * dist.get_world_size(self.tp_group)
        probs = scores if self.router.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        frac = total.float() / max(1, tokens * self.top_k)
        return self.n_experts * (frac * probs.sum(dim=0) / max(1, tokens)).sum()


def moe_block_plan(block: nn.Module, residual, sublayer_plan) -> dict[str, ParallelStyle]:
    """The tensor-parallel styles of a block's MoE `mlp`: local shard in and out, shared experts as a dense MLP.

    `sublayer_plan(block, sub, col, row, residual)` is tensor_parallel.py's plan of one column/row-parallel pair.
    """
    from torch.distributed.tensor.parallel import PrepareModuleInput

    plan: dict[str, ParallelStyle] = {
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(residual,), use_local_output=True)
    }
    if block.get_submodule("mlp").shared is not None:
        plan.update(sublayer_plan(block, "mlp.shared", "fc", "proj", residual))
    return plan


def shard_moe_routing(model: nn.Module, tp_mesh) -> None:
    """Replicate every MoE router's gate over `tp_mesh` and switch the layers to sequence-shard routing."""
    from torch.distributed.tensor import distribute_module

    for moe in moe_layers(model):
        distribute_module(moe.router.gate, tp_mesh)  # no partition function: every parameter Replicate
        moe.router.__class__ = SequenceShardRouter
        moe.__class__ = SequenceShardMoE
        moe.tp_group = tp_mesh.get_group()
