"""Megatron-style tensor parallelism (+ sequence parallelism) on the plain GPT, through DTensor's parallelize_module.

Per block: qkv and fc are column-parallel (each rank holds whole heads / a slice of the MLP width), proj layers are
row-parallel. With sequence parallelism the LayerNorms and residual stream are split along the sequence, so the
row-parallel all-reduce becomes a reduce-scatter and the column-parallel input an all-gather (same bytes, no
replicated LayerNorm work). The embedding is vocabulary-parallel and the tied output layer column-parallel with
vocabulary-sharded logits that `loss_parallel()` consumes without ever gathering them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from scaletrain.model.build import Decoder


def ReplicateParallel() -> ParallelStyle:
    """Parallel style that keeps a module's parameters whole (Replicate DTensors) and its output a DTensor.

    Used for the position embedding, whose output is added to the vocabulary-parallel token embedding. A
    factory rather than a class so that the TP modules load only when tensor parallelism is used.
    """
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh):
            from torch.distributed.tensor import DTensor, Replicate, distribute_module

            def input_fn(mod, inputs, mesh):
                return tuple(
                    DTensor.from_local(t, mesh, (Replicate(),), run_check=False) if not isinstance(t, DTensor) else t
                    for t in inputs
                )

            return distribute_module(module, device_mesh, input_fn=input_fn)

    return _Style()


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """Shard `model` (a GPT or Llama, or a pipeline stage of one) over the 1-D `tp_mesh` in place.

    Llama has the same module names (fused `attn.qkv` in whole KV groups, fused SwiGLU `mlp.fc` with gate and
    up rows interleaved, see model/llama.py), so one plan fits both: its RMSNorms take the LayerNorms' place
    and its untied head is column-parallel like the tied one.

    Keeps the output layer tied to the embedding when the module holds both. Inputs stay plain tensors:
    token ids replicated, hidden states between pipeline stages as each rank's local sequence shard (SP) or whole.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if tp_mesh.size() == 1:
        return
    tied = getattr(model, "head_is_tied", False)
    residual = Shard(1) if sequence_parallel else Replicate()
    model = cast("Decoder", model)  # the attributes below are the decoder's, not nn.Module's
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, use_local_output=False)
        if getattr(model.embed, "pos", None) is not None:  # GPT's learned positions; Llama's are rotary
            plan["embed.pos"] = ReplicateParallel()
        # The sum is already laid out along the residual stream; hand later modules plain local tensors.
        plan["embed"] = PrepareModuleOutput(
            output_layouts=residual, desired_output_layouts=residual, use_local_output=True
        )
    if model.head is not None:
        plan["ln_f"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
        plan["head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    for block in model.blocks.values():
        block_plan = {
            "attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=residual),
            "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            block_plan["ln1"] = SequenceParallel()
            block_plan["ln2"] = SequenceParallel()
        else:
            # Replicated DTensors rather than plain tensors: one optimizer path (foreach) for every parameter.
            block_plan["ln1"] = ReplicateParallel()
            block_plan["ln2"] = ReplicateParallel()
        parallelize_module(block, tp_mesh, block_plan)
    if tied:
        # Both styles sharded the same [vocab, d] matrix along the vocabulary; re-point the head at the one copy.
        assert model.head is not None and model.embed is not None  # tied: both exist
        model.head.weight = model.embed.tok.weight
