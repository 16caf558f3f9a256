"""LoRA (Hu et al. 2021) applied from outside a plain decoder: frozen base, trainable low-rank adapters.

`apply_lora(model, cfg)` gives each targeted projection `W` an adapter so that its output becomes
`base(x) + (alpha/r) * B(A(dropout(x)))`, with A [r, in] and B [out, r]. The base `nn.Linear` keeps its module and
parameter names (`blocks.0.attn.qkv.weight`), so Hugging Face import/export and base checkpoints are unaffected;
only its class becomes `LoraLinear`, whose forward adds the adapter. The adapter is a *sibling* module
(`blocks.0.attn.qkv_lora.lora_a`), not a child of the linear: DTensor's Colwise/RowwiseParallel partition every
parameter of the module they style, and nested adapter weights would be sharded like the base weight.
`scaletrain.parallel.lora.shard_lora` gives the adapters their own tensor-parallel placements.

Init is layout independent like the base's (`model/init.py`): A ~ N(0, 1/(3·in)) (the variance of loralib's and
PEFT's kaiming-uniform A) from the counter-based stream of the adapter's FQN, B = 0, so the adapted model starts
exactly equal to the base model and every parallel layout starts from the same adapters.
"""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.architectures import LORA_TARGETS
from scaletrain.model.init import normal_, param_key

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from scaletrain.model.build import Decoder

SUFFIX = "_lora"  # adapter of `attn.qkv` is `attn.qkv_lora`


def is_lora_param(name: str) -> bool:
    """True for an adapter parameter's FQN (last component `lora_a` or `lora_b`), whatever wrappers add."""
    return name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")


def _clean(name: str) -> str:
    # The plain model's names: init streams must not depend on checkpoint or compile wrappers (as GPT.init_weights).
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


class LoraAdapter(nn.Module):
    """The trainable pair (lora_a [r, in], lora_b [out, r]); `forward(x)` is (alpha/r)·B(A(dropout(x)))."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float,
        kind: str,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.rank, self.scale, self.p, self.kind = rank, alpha / rank, float(dropout), kind
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self._dropout_seed = 0
        self._gen: torch.Generator | None = None

    def reset(self, seed: int, name: str, b_std: float = 0.0) -> None:
        """Layout-independent init of adapter `name` (its FQN): A Gaussian, B zero (or N(0, b_std) for tests)."""
        normal_(self.lora_a, 1.0 / math.sqrt(3 * self.lora_a.shape[1]), seed, f"{name}.lora_a")
        if b_std > 0:
            normal_(self.lora_b, b_std, seed, f"{name}.lora_b")
        else:
            with torch.no_grad():
                self.lora_b.zero_()
        self._dropout_seed = param_key(seed, f"{name}.dropout") & ((1 << 62) - 1)
        self._gen = None

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor) and any(p.is_replicate() for p in x.placements):
            # A replicated input must get the same mask on every tensor-parallel peer, or the replicated A
            # would receive different gradients per rank and drift apart. DTensor's own RNG tracker covers only
            # CUDA, so draw the mask from a generator seeded alike on all peers (they call this in lockstep).
            local = x.to_local()
            if self._gen is None or self._gen.device != local.device:
                self._gen = torch.Generator(device=local.device).manual_seed(self._dropout_seed)
            keep = torch.rand(local.shape, generator=self._gen, device=local.device) >= self.p
            local = local * keep.to(local.dtype) / (1.0 - self.p)
            return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
        return F.dropout(x, self.p, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(self._dropout(x), self.lora_a)
        if _is_partial(h):
            # Row-parallel adapter (A sharded on its input dim): reduce the r-wide partial sums before B,
            # r numbers per token instead of the output width.
            from torch.distributed.tensor import Replicate

            h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
        return F.linear(h, self.lora_b) * self.scale


def _is_partial(t: torch.Tensor) -> TypeGuard[DTensor]:
    return any(p.is_partial() for p in getattr(t, "placements", ()))


class LoraLinear(nn.Linear):
    """An nn.Linear (same parameters, same names) whose output adds its sibling adapter's."""

    _lora_adapter: LoraAdapter  # set in the instance __dict__ by apply_lora (not a child module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under tensor parallelism x is the DTensor the style's input hook made and the base output a DTensor;
        # the adapter's placements (parallel/lora.py) make its output land on the base output's placement.
        return F.linear(x, self.weight, self.bias) + self._lora_adapter(x)


def adapters(model: nn.Module):
    """(FQN, LoraAdapter) pairs of `model`, names as in the plain model."""
    return [(_clean(n), m) for n, m in model.named_modules() if isinstance(m, LoraAdapter)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters of `model` (what the optimizer trains when LoRA is on)."""
    return [p for n, p in model.named_parameters() if is_lora_param(n)]


def init_lora(model: nn.Module, seed: int, b_std: float = 0.0) -> None:
    """(Re)initialise every adapter of `model` from (seed, FQN); no-op for a model without adapters."""
    for name, adapter in adapters(model):
        adapter.reset(seed, name, b_std)


def freeze_base(model: nn.Module) -> None:
    """requires_grad only on adapter parameters (again after steps that recreate parameters, e.g. TP styles)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


def _init_weights_with_lora(self, seed: int = 0) -> None:
    # Bound per instance by apply_lora, so the trainer's init/reset (part.init_weights) also resets adapters.
    type(self).init_weights(self, seed)
    init_lora(self, seed, getattr(self, "_lora_b_std", 0.0))


def apply_lora(model: nn.Module, lora_cfg, b_std: float = 0.0) -> nn.Module:
    """Add adapters to `model`'s targeted projections in every block (in place), freeze the rest, return it.

    Call on the plain model (meta or real device) before tensor parallelism, FSDP, checkpointing or compile.
    Adapters are initialised when the model's own `init_weights(seed)` runs (the trainer calls it after
    materialising); on an already materialised model call `init_lora(model, seed)`. `b_std` > 0 starts B
    non-zero (tests: then adapter gradients and layouts differ from step 1). Raises ValueError for a target no
    block has or a model without `blocks`.
    """
    if lora_cfg.rank <= 0:
        raise ValueError(f"lora.rank={lora_cfg.rank}: must be > 0 to apply LoRA")
    unknown = [t for t in lora_cfg.targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"lora.targets: unknown {unknown}; choose from {sorted(LORA_TARGETS)}")
    for bname, block in cast("Decoder", model).blocks.items():
        for target in lora_cfg.targets:
            path, kind = LORA_TARGETS[target].module, LORA_TARGETS[target].tp
            parent_path, leaf = path.rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            base = getattr(parent, leaf, None)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"lora.targets: {target!r} matches no linear in blocks.{bname}")
            if isinstance(base, LoraLinear):
                raise ValueError(f"blocks.{bname}.{path} already has a LoRA adapter")
            adapter = LoraAdapter(
                base.in_features,
                base.out_features,
                lora_cfg.rank,
                lora_cfg.alpha,
                lora_cfg.dropout,
                kind,
                device=base.weight.device,
                dtype=base.weight.dtype,
            )
            setattr(parent, leaf + SUFFIX, adapter)
            base.__class__ = LoraLinear
            base.__dict__["_lora_adapter"] = adapter  # a plain reference: not a child module, see docstring
    freeze_base(model)
    # torch stubs type Module.__setattr__ for tensors and modules only; plain attributes are fine at run time.
    model._lora_b_std = b_std  # type: ignore[assignment]
    if hasattr(type(model), "init_weights"):
        model.init_weights = types.MethodType(_init_weights_with_lora, model)  # type: ignore[assignment]
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += (alpha/r)·B·A) and remove the adapters, in place.

    For a plain (unsharded) model; afterwards it is an ordinary model with every parameter trainable again and
    the same eval-mode outputs. A model without adapters is returned unchanged.
    """
    for module in list(model.modules()):
        for leaf, child in list(module.named_children()):
            if not isinstance(child, LoraLinear):
                continue
            adapter = child.__dict__.pop("_lora_adapter")
            delta = (adapter.lora_b.float() @ adapter.lora_a.float()) * adapter.scale
            child.weight.add_(delta.to(child.weight.dtype))
            child.__class__ = nn.Linear  # type: ignore[assignment]  # the class swap back; mypy keeps LoraLinear
            delattr(module, leaf + SUFFIX)
    if "init_weights" in model.__dict__:
        del model.init_weights
    model.__dict__.pop("_lora_b_std", None)
    for p in model.parameters():
        p.requires_grad_(True)
    return model
