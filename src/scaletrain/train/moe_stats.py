"""The trainer's side of Mixture-of-Experts layers: auxiliary loss in the gradient, bias updates, router statistics.

Auxiliary loss. Each MoE layer's `aux_loss` (coefficient applied, model/moe.py) joins the training objective as
the mean over the step's micro-batches (and context shards) of the sum over layers; the logged LM loss stays the
cross-entropy alone. Its gradient is injected at the layer's output by a forward hook (Megatron-LM's
MoEAuxLossAutoScaler): backward passes the output gradient through and gives aux_loss the gradient 1/accum,
which the data-parallel average turns into that mean. So it reaches every pipeline stage's layers without
threading losses through the pipeline schedule, and no layout changes it.

Statistics. Each layer's `tokens_per_expert` and aux loss are summed over the step's forwards, counted when
that forward's backward passes the hook's node: so exactly once per micro-batch, whatever else runs the module
(an activation-checkpoint recompute). A pipeline stage's metadata inference (torch.distributed.pipelining runs
a forward and a backward on uninitialised tensors at the first step after an evaluation) is excluded by
`ignore_pipeline_inference`. After the optimizer step `finish_step`
sums them, with the aux losses, over every rank (tensor-parallel peers route their own sequence shards, so they
count too: parallel/moe_tensor_parallel.py), feeds the totals to
`MoE.update_bias` (auxiliary-loss-free balancing, when model.moe.bias_update_rate > 0: every rank moves its
biases alike) and returns the metrics.jsonl keys: moe_aux_loss, and per expert of the token assignments summed
over the MoE layers their min and max (moe_tokens_per_expert_min / _max), plus moe_max_load, the largest ratio
over layers of an expert's assignments to the layer's mean.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.model.moe import MoE

_LAYER = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


class _InjectAux(torch.autograd.Function):
    """Identity on `out`; backward also gives `aux` the gradient `scale` and calls `record()`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float, record) -> torch.Tensor:
        ctx.scale, ctx.record = scale, record
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.record()
        return grad, grad.new_full(ctx.aux_shape, ctx.scale, dtype=torch.float32), None, None


def _layers(parts: list[nn.Module]) -> list[tuple[int, MoE]]:
    """(global block index, MoE layer) of every MoE layer in the parts, from the module names."""
    out = []
    for part in parts:
        for name, mod in part.named_modules():
            if isinstance(mod, MoE):
                match = _LAYER.search(name)
                if match is None:
                    raise ValueError(f"MoE layer {name!r} is not under blocks.<index>")
                out.append((int(match.group(1)), mod))
    return out


class MoEStats:
    """Hooks on this rank's MoE layers (module docstring); inert for a dense model (`active` False)."""

    def __init__(self, parts: list[nn.Module], n_layers: int, n_experts: int, accum: int, device: torch.device):
        self.layers = _layers(parts)
        self.n_layers, self.n_experts, self.device = n_layers, n_experts, device
        self.scale = 1.0 / accum
        self._counts = torch.zeros(n_layers, max(n_experts, 1), dtype=torch.float64, device=device)
        self._aux = torch.zeros((), dtype=torch.float64, device=device)
        self._recording = True
        for index, moe in self.layers:
            moe.register_forward_hook(self._hook(index))

    @property
    def active(self) -> bool:
        """Whether the model has MoE layers (on any stage: a dense-only stage of an MoE model still reports)."""
        return self.n_experts > 0

    def _hook(self, index: int):
        def hook(mod: MoE, args, out: torch.Tensor) -> torch.Tensor:
            if not mod.training or not out.requires_grad:
                return out
            counts, aux = mod.tokens_per_expert, mod.aux_loss.detach()

            def record() -> None:
                if not self._recording:
                    return
                self._counts[index] += counts.to(self._counts)
                self._aux += aux.double()

            return _InjectAux.apply(out, mod.aux_loss, self.scale, record)

        return hook

    def ignore_pipeline_inference(self, stages: list) -> None:
        """Record nothing while a PipelineStage infers its tensor metadata (wraps its private inference methods,
        where this torch version has them); nothing for a model without MoE layers."""
        for stage in stages if self.layers else []:
            for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
                method = getattr(stage, name, None)
                if method is not None:
                    setattr(stage, name, self._paused(method))

    def _paused(self, method):
        def run(*args, **kwargs):
            self._recording = False
            try:
                return method(*args, **kwargs)
            finally:
                self._recording = True

        return run

    def reset(self) -> None:
        """Forget what the forwards since the last step recorded (after the warm-up)."""
        self._counts.zero_()
        self._aux.zero_()
        for _, moe in self.layers:
            moe._pending_counts = None

    def finish_step(self, world_size: int, units: int) -> dict[str, float]:
        """After the optimizer step: global totals, bias updates and the step's router metrics.

        `units`: micro-batches x context shards of the global batch (what the aux loss is averaged over).
        """
        if not self.active:
            return {}
        flat = torch.cat([self._counts.flatten(), self._aux.view(1)])
        if world_size > 1:
            dist.all_reduce(flat)
        counts, aux = flat[:-1].view_as(self._counts), float(flat[-1]) / max(units, 1)
        for index, moe in self.layers:
            moe.update_bias(counts[index])
        self.reset()
        moe_rows = counts[counts.sum(1) > 0]
        if moe_rows.numel() == 0:
            return {"moe_aux_loss": aux}
        per_expert = moe_rows.sum(0)
        load = (moe_rows.max(1).values / moe_rows.mean(1)).max()
        return {
            "moe_aux_loss": aux,
            "moe_tokens_per_expert_min": float(per_expert.min()),
            "moe_tokens_per_expert_max": float(per_expert.max()),
            "moe_max_load": float(load),
        }
