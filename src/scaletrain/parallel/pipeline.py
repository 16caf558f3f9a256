"""Pipeline parallelism with torch.distributed.pipelining: stage modules cut from the plain GPT, and a schedule.

Layers are split evenly over pp * pp_virtual stages; the embedding goes with the first stage and the final
LayerNorm and output layer with the last one. Where the stages do not divide the layers but do divide layers + 2,
the split is Megatron's `account_for_embedding_in_pipeline_split` + `account_for_loss_in_pipeline_split` (NVIDIA's
llama31_405b layout: 126 layers in pp8 x vp8 = 64 stages): the embedding and the loss count as a layer each, so the
first and the last stage hold one block fewer. `parallel.pp_first_layers` / `pp_last_layers` (Megatron's
`--decoder-first/last-pipeline-num-layers`) or `parallel.pp_stage_layers` set the stages' blocks unevenly
(`Layout.stage_blocks`, the simulator's `stage_split`); an end stage may hold none, only the embedding or the
output layer. Stage s of an interleaved pipeline lives on pipeline rank s % pp
(the "loop" placement), so rank 0 holds stages 0, pp, 2pp, ... and the last stage is on rank pp - 1.
The output layer is tied to the embedding; on different ranks they are two copies that the trainer keeps equal
by summing their gradients (`TiedEmbeddingSync`), as Megatron-LM does.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import stage_sizes

if TYPE_CHECKING:
    from scaletrain.model.build import Decoder


def stage_ids(pp_rank: int, pp: int, pp_virtual: int) -> list[int]:
    """Global indices of the stages pipeline rank `pp_rank` holds (loop placement)."""
    return [pp_rank + v * pp for v in range(pp_virtual)]


def stage_layers(n_layers: int, num_stages: int, stage: int, sizes: list[int] | None = None) -> range:
    """Block indices of `stage`: by `sizes` (blocks per stage, e.g. `Layout.stage_blocks`), else the default split
    (`stage_sizes`). Empty for an end stage given no blocks."""
    if sizes is None:
        sizes = stage_sizes(n_layers, num_stages)
        if sizes is None:
            raise ValueError(f"{num_stages} pipeline stages divide neither {n_layers} layers nor {n_layers} + 2")
    if len(sizes) != num_stages or sum(sizes) != n_layers:
        raise ValueError(f"stage sizes {sizes}: need {num_stages} counts summing to the {n_layers} layers")
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def cut_stage(model: nn.Module, stage: int, num_stages: int, sizes: list[int] | None = None) -> nn.Module:
    """A copy of `model` (build it on the meta device) keeping only what stage `stage` owns; `sizes`: blocks per
    stage (`stage_layers`; None = the default split).

    Block FQNs stay those of the full model (blocks.<i>), so stage parameters have the same names, init streams
    and checkpoint keys as in the one-process model. A first (last) stage given no blocks keeps only the embedding
    (the final norm and the output layer).
    """
    full = cast("Decoder", model)
    stage_model = copy.deepcopy(full)
    keep = {str(i) for i in stage_layers(full.cfg.n_layers, num_stages, stage, sizes)}
    for name in list(stage_model.blocks.keys()):
        if name not in keep:
            del stage_model.blocks[name]
    first, last = stage == 0, stage == num_stages - 1
    if not last:
        stage_model.ln_f = None
        stage_model.head = None
    elif not first and full.head_is_tied:
        # The head's own copy of the tied matrix (deepcopy kept the tie; cut it before dropping the embedding).
        assert stage_model.head is not None and stage_model.embed is not None  # tied: both exist
        stage_model.head.weight = nn.Parameter(torch.empty_like(stage_model.embed.tok.weight))
    if not first:
        stage_model.embed = None
    return stage_model


def build_schedule(stages: list, schedule: str, n_microbatches: int, loss_fn):
    """The torch.distributed.pipelining schedule over this rank's `stages` (PipelineStage objects)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    # scale_grads=False: loss_fn already divides by the global label count, as the non-pipelined path does.
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    if len(stages) != 1:
        raise ValueError(f"pipeline schedule {schedule!r} runs one stage per rank, got {len(stages)}")
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def make_stage(stage_model: nn.Module, stage: int, num_stages: int, device: torch.device, pp_group):
    """Wrap a (parallelized, materialised) stage module as a PipelineStage; shapes are inferred at first step."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(stage_model, stage, num_stages, device, group=pp_group)


class TiedEmbeddingSync:
    """Sums the gradients of the embedding (first stage) and its copy in the output layer (last stage).

    After the sum both copies see the same gradient and, from equal starting values, stay equal under AdamW.
    One process group per pair (first, last) of pipeline ranks that share every other mesh coordinate.
    Build it after every wrapper (TP, FSDP) has replaced the parameters.
    """

    def __init__(self, mesh, parts: list[nn.Module], pp: int):
        self.param: torch.Tensor | None = None  # this rank's copy of the tied matrix (embedding or head)
        self.copy: torch.Tensor | None = None  # the head's copy, which must not count twice in the gradient norm
        self.group = None
        # An untied model (Llama) has nothing to share; every rank builds the same model, so all skip alike.
        if pp == 1 or not getattr(parts[0], "tied_embeddings", True):
            return
        pp_dim = mesh.mesh_dim_names.index("pp")
        ranks = mesh.mesh.movedim(pp_dim, -1).reshape(-1, pp)
        me = dist.get_rank()
        for row in ranks.tolist():
            # Every rank must call new_group for every group, in the same order.
            group = dist.new_group([row[0], row[-1]])
            if me in (row[0], row[-1]):
                self.group = group
        for part in cast("list[Decoder]", parts):
            if part.embed is not None:
                self.param = part.embed.tok.weight
            elif part.head is not None:
                self.param = self.copy = part.head.weight

    def __call__(self) -> None:
        """All-reduce (sum) the tied matrix's gradient between the first and last stage; call before clipping."""
        if self.group is None or self.param is None or self.param.grad is None:
            return
        grad = self.param.grad
        if (
            isinstance(grad, DTensor)
            and isinstance(self.param, DTensor)
            and tuple(grad.placements) != tuple(self.param.placements)
        ):
            # DTensor's embedding backward leaves a vocabulary-parallel weight's gradient replicated; shard it
            # like the weight (a local slice, no communication) so both stages reduce matching shards.
            grad = grad.redistribute(grad.device_mesh, self.param.placements)
            self.param.grad = grad
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)

    def is_duplicate(self, param: torch.Tensor) -> bool:
        """True for the last stage's copy of the tied matrix."""
        return self.copy is not None and param is self.copy
