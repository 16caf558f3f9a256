"""Megatron-style tensor parallelism (+ sequence parallelism) on the plain GPT, through DTensor's parallelize_module.

Per block: qkv and fc are column-parallel (each rank holds whole heads / a slice of the MLP width), proj layers are
row-parallel. With sequence parallelism the LayerNorms and residual stream are split along the sequence, so the
row-parallel all-reduce becomes a reduce-scatter and the column-parallel input an all-gather (same bytes, no
replicated LayerNorm work). The embedding is vocabulary-parallel and the tied output layer column-parallel with
vocabulary-sharded logits that `loss_parallel()` consumes without ever gathering them.
"""

from __future__ import annotations

import sys
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


def _fp8_styles(linear: nn.Module) -> bool:
    """Whether `linear` takes torchao's FP8 styles: a tensorwise FP8 linear without a LoRA adapter.

    Those styles cast the module input to FP8 before the sequence-parallel all-gather, so the gather moves FP8
    bytes; a LoRA adapter must see the bf16 input, and torchao has them for tensorwise scaling only. Other FP8
    linears (rowwise, LoRA bases) take the plain styles and cast inside their own forward.
    """
    from scaletrain.model.lora import LoraLinear

    fp8 = sys.modules.get("scaletrain.model.fp8")  # not loaded: no FP8 linears (and torchao may be absent)
    return fp8 is not None and not isinstance(linear, LoraLinear) and fp8.is_tensorwise(linear)


def _prepare_float8_input(**kwargs) -> ParallelStyle:
    """torchao's PrepareFloat8ModuleInput, casting to the autocast dtype before quantizing.

    torchao quantizes whatever arrives: under autocast that is the fp32 norm output, while the same linear without
    tensor parallelism (model/fp8.py's Float8Linear) and FSDP's bf16 parameters quantize bf16 activations.
    Casting first keeps one rounding path for every layout (measured: TP2 FP8 runs moved ~1e-3 in loss without it).
    """
    import torch
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    class _Prepare(PrepareFloat8ModuleInput):
        def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
            if isinstance(input, torch.Tensor) and torch.is_autocast_enabled(input.device.type):
                input = input.to(torch.get_autocast_dtype(input.device.type))
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

    return _Prepare(**kwargs)


def _sublayer_plan(block: nn.Module, sub: str, col: str, row: str, residual) -> dict[str, ParallelStyle]:
    """Styles of `sub` (attn or mlp: input layout change, a column- then a row-parallel linear) of one block."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    sublayer = block.get_submodule(sub)
    plan: dict[str, ParallelStyle] = {}
    if _fp8_styles(sublayer.get_submodule(col)):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        plan[sub] = _prepare_float8_input(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), fwd_config_submodule_fqn=col
        )
        plan[f"{sub}.{col}"] = Float8ColwiseParallel()
    else:
        plan[sub] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
        plan[f"{sub}.{col}"] = ColwiseParallel()
    if _fp8_styles(sublayer.get_submodule(row)):
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

        plan[f"{sub}.{row}"] = Float8RowwiseParallel(output_layouts=residual)
    else:
        plan[f"{sub}.{row}"] = RowwiseParallel(output_layouts=residual)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """Shard `model` (a GPT, Llama or GPT-OSS, or a pipeline stage of one) over the 1-D `tp_mesh` in place.

    Llama has the same module names (fused `attn.qkv` in whole KV groups, fused SwiGLU `mlp.fc` with gate and
    up rows interleaved, see model/common.py), so one plan fits both: its RMSNorms take the LayerNorms' place
    and its untied head is column-parallel like the tied one.

    FP8 linears (model/fp8.py, converted before) take torchao's Float8 styles where they can (`_fp8_styles`).
    MoE MLPs route each rank's sequence shard (parallel/moe_tensor_parallel.py); GPT-OSS's attention sinks are
    split by head with the heads, and Qwen3's QK-norms are replicated over the heads they normalise. Keeps the output layer tied to the embedding when the module holds both. Inputs stay plain tensors:
    token ids replicated, hidden states between pipeline stages as each rank's local sequence shard (SP) or whole.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
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
    from scaletrain.model.moe import MoE
    from scaletrain.parallel.moe_tensor_parallel import moe_block_plan, shard_moe_routing

    for block in model.blocks.values():
        block_plan = _sublayer_plan(block, "attn", "qkv", "proj", residual)
        if isinstance(block.get_submodule("mlp"), MoE):
            block_plan.update(moe_block_plan(block, residual, _sublayer_plan))
        else:
            block_plan.update(_sublayer_plan(block, "mlp", "fc", "proj", residual))
        if sequence_parallel:
            block_plan["ln1"] = SequenceParallel()
            block_plan["ln2"] = SequenceParallel()
        else:
            # Replicated DTensors rather than plain tensors: one optimizer path (foreach) for every parameter.
            block_plan["ln1"] = ReplicateParallel()
            block_plan["ln2"] = ReplicateParallel()
        for qk in ("q_norm", "k_norm"):
            if getattr(block.get_submodule("attn"), qk, None) is not None:
                # Qwen3's QK-norm sees [batch, heads, seq, head_dim] with the heads split by tp: each rank
                # normalises its heads with the whole weight, whose gradient is summed over the ranks.
                block_plan[f"attn.{qk}"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(block, tp_mesh, block_plan)
        sinks = getattr(block.get_submodule("attn"), "sinks", None)
        if sinks is not None:  # one logit per head: each rank keeps its heads' (model/common.py)
            block.get_submodule("attn").sinks = nn.Parameter(distribute_tensor(sinks.data, tp_mesh, [Shard(0)]))
    shard_moe_routing(model, tp_mesh)
    if tied:
        # Both styles sharded the same [vocab, d] matrix along the vocabulary; re-point the head at the one copy.
        assert model.head is not None and model.embed is not None  # tied: both exist
        model.head.weight = model.embed.tok.weight
