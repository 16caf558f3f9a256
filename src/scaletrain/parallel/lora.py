"""Tensor-parallel placements of LoRA adapters, matching their base projection's Megatron split.

Column-parallel base (qkv, fc1: weight Shard(0), output sharded on the feature dim): A is replicated and B is
row-sharded like the base weight (Shard(0)), so B·A·x lands on exactly the base output's local columns with no
communication. Row-parallel base (proj, fc2: weight Shard(1), input sharded on the feature dim): A is sharded
on its input dim (Shard(1)) so A·x is a partial sum over ranks, B is replicated; the partial r-wide product is
reduced before B (r numbers per token instead of d), and the sum with the base output is redistributed by the
row-parallel style to its output placement (Replicate, or Shard(1) along the sequence under SP).

Under sequence parallelism the adapter sees what its base sees: the all-gathered (replicated) block input for
qkv/fc1, the head-/width-sharded activation for proj/fc2.
"""

from __future__ import annotations

from torch import nn

from scaletrain.model.lora import LoraAdapter, freeze_base


def shard_lora(model: nn.Module, tp_mesh) -> None:
    """Turn every adapter of `model` into DTensors on the 1-D `tp_mesh` (after apply_tensor_parallel).

    Also freezes the base again: parallel styles that distribute a module's parameters (SequenceParallel on
    the LayerNorms, for one) create new Parameters with requires_grad=True.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    freeze_base(model)
    if tp_mesh.size() == 1:
        return
    for module in model.modules():
        if not isinstance(module, LoraAdapter):
            continue
        a_place, b_place = (Replicate(), Shard(0)) if module.kind == "col" else (Shard(1), Replicate())
        for name, place in (("lora_a", a_place), ("lora_b", b_place)):
            p = getattr(module, name)
            setattr(
                module, name, nn.Parameter(distribute_tensor(p.data, tp_mesh, [place]), requires_grad=p.requires_grad)
            )
