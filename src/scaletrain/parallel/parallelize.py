"""Build this rank's part of the model for a layout: meta build, pipeline cut, then TP, CP, EP, AC, compile, FSDP/DDP.

The order is torchtitan's: module swaps on the plain model first (LoRA adapters, FP8 linears), tensor parallelism
next (it rewrites parameters into DTensors on the tp mesh), then
context parallelism (swaps the attention core), expert parallelism (shards routed experts over "ep"), activation checkpointing (wraps blocks), per-block
torch.compile, and data parallelism last (FSDP shards whatever the earlier steps produced). Only then is memory
allocated, shard by shard, and filled by the layout-independent init, so no rank ever holds the full model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.model.build import build_model
from scaletrain.parallel.activation_checkpoint import apply_activation_checkpoint
from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp
from scaletrain.parallel.layout import Layout
from scaletrain.parallel.pipeline import TiedEmbeddingSync, build_schedule, cut_stage, make_stage, stage_ids
from scaletrain.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from scaletrain.model.build import Decoder


@dataclass
class ParallelModel:
    """This rank's model parts and how to drive them."""

    parts: list[nn.Module]
    """The whole model (one part) or the pipeline stage modules this rank holds, in stage order."""
    stage_ids: list[int] = field(default_factory=lambda: [0])
    """Global stage index of each part."""
    stages: list = field(default_factory=list)
    """PipelineStage wrappers of the parts (empty without pipeline parallelism)."""
    tied: TiedEmbeddingSync | None = None
    """Keeps the embedding and a separate last-stage head copy equal (pipeline only)."""
    uses_fsdp_mixed_precision: bool = False
    """True when FSDP casts parameters to bf16 itself (then no autocast is needed)."""

    @property
    def has_first_stage(self) -> bool:
        """This rank feeds tokens in (holds the embedding)."""
        return 0 in self.stage_ids

    def has_last_stage(self, num_stages: int) -> bool:
        """This rank computes the loss (holds the output layer)."""
        return num_stages - 1 in self.stage_ids

    def parameters(self):
        """Every parameter of every part, each once."""
        seen = set()
        for part in self.parts:
            for p in part.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def build_meta_parts(cfg: Config, layout: Layout, pp_rank: int) -> tuple[list[nn.Module], list[int]]:
    """The plain (unparallelized) modules of pipeline rank `pp_rank`, on the meta device, and their stage ids."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    if layout.pp == 1:
        return [model], [0]
    ids = stage_ids(pp_rank, layout.pp, layout.pp_virtual)
    sizes = layout.stage_blocks(cfg.model.n_layers)  # the validated split (Layout.problems refuses one that fails)
    return [cut_stage(model, s, layout.num_stages, sizes) for s in ids], ids


def parallelize_part(part: nn.Module, cfg: Config, layout: Layout, mesh) -> None:
    """Apply LoRA, FP8, TP, CP, EP, activation checkpointing, compile and data parallelism to one part, in order."""
    if cfg.lora.rank > 0:
        # A structure change, so first (torchtitan's order); freezes every non-adapter parameter.
        from scaletrain.model.lora import apply_lora

        apply_lora(part, cfg.lora)
    if cfg.train.fp8:
        # On the plain (or LoRA) linears, before TP rewrites their weights (torchtitan's order); tensor parallelism
        # then picks torchao's FP8 styles for them, and FSDP gathers their weights in FP8 where torchao can.
        from scaletrain.model.fp8 import convert_to_float8

        fsdp = mesh is not None and layout.data_parallel_kind in ("fsdp", "hsdp")
        convert_to_float8(part, cfg.train.fp8_recipe, emulate=_emulate_fp8(cfg), fsdp_all_gather=fsdp)
    if mesh is not None and layout.tp > 1:
        apply_tensor_parallel(part, mesh["tp"], layout.sequence_parallel)
        if cfg.lora.rank > 0:
            from scaletrain.parallel.lora import shard_lora

            shard_lora(part, mesh["tp"])
    if mesh is not None and layout.cp > 1:
        from scaletrain.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(part, mesh["cp"])
    if mesh is not None and layout.ep > 1:
        from scaletrain.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(part, mesh["ep"], layout.tp)
    apply_activation_checkpoint(part, cfg.parallel.activation_checkpoint)
    if cfg.train.compile:
        blocks = cast("Decoder", part).blocks
        for name, block in list(blocks.items()):
            blocks[name] = cast(nn.Module, torch.compile(block))  # compiling a module returns a module
    kind = layout.data_parallel_kind
    if mesh is None or kind == "none":
        return
    if kind == "ddp":
        apply_ddp(part, mesh["dp_replicate"])
        return
    dp_mesh = mesh["dp_shard_cp"] if kind == "fsdp" else mesh[("dp_replicate", "dp_shard_cp")]
    param_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
    if layout.ep > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from scaletrain.parallel.expert_parallel import expert_fsdp

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        expert_mesh = mesh["efsdp"] if kind == "fsdp" else mesh["expert_dp"]
        expert_fsdp(part, expert_mesh, mp, cfg.parallel.fsdp_reshard_after_forward)
    apply_fsdp(part, dp_mesh, param_dtype, cfg.parallel.fsdp_reshard_after_forward)


def _emulate_fp8(cfg: Config) -> bool:
    """Whether FP8 GEMMs are emulated (CPU, pre-Ada GPUs): decided from the device the run trains on, since the
    model is converted on the meta device."""
    from scaletrain.model.fp8 import fp8_supported

    dev = cfg.train.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return not fp8_supported(torch.device(dev, 0) if dev == "cuda" else dev)


def parallelize(
    cfg: Config, layout: Layout, mesh, device: torch.device, seed: int, loss_fn=None
) -> tuple[ParallelModel, object | None]:
    """This rank's materialised, initialised model parts and, with pipeline parallelism, the schedule.

    `mesh` is None for a single process. `loss_fn(output, labels)` is what the last pipeline stage calls.
    """
    pp_rank = mesh["pp"].get_local_rank() if mesh is not None else 0
    parts, ids = build_meta_parts(cfg, layout, pp_rank)
    for part in cast("list[Decoder]", parts):
        parallelize_part(part, cfg, layout, mesh)
        part.to_empty(device=device)
        part.tie_weights()
        with torch.no_grad():
            part.init_weights(seed)
    pm = ParallelModel(
        parts=parts,
        stage_ids=ids,
        uses_fsdp_mixed_precision=(
            mesh is not None and layout.data_parallel_kind in ("fsdp", "hsdp") and cfg.train.dtype == "bf16"
        ),
    )
    schedule = None
    if layout.pp > 1:
        group = mesh["pp"].get_group()
        pm.stages = [make_stage(part, s, layout.num_stages, device, group) for part, s in zip(parts, ids)]
        n_micro = cfg.train.global_batch_size // layout.dp // cfg.train.micro_batch_size
        schedule = build_schedule(pm.stages, layout.pp_schedule, n_micro, loss_fn)
        pm.tied = TiedEmbeddingSync(mesh, parts, layout.pp)
    return pm, schedule
