"""FP8 training of the transformer-block linears through `torchao.float8` (a core dependency).

`convert_to_float8(model, recipe)` runs torchao's `convert_to_float8_training` on the plain model (before tensor
parallelism, like torchtitan), limited to the `nn.Linear`s inside `model.blocks`: blocks 0 and n-1, the
embedding and the output layer stay bf16 (the layers most sensitive to quantization). Parameters keep their names
and stay high-precision tensors (torchao casts them to FP8 per GEMM), so init, checkpoints and the optimizer see
the same model. Recipes map `train.fp8_recipe` onto torchao's:
  "tensorwise"  one dynamic scale per tensor, e4m3 for inputs and weights, e5m2 for gradients (cuBLAS tensorwise
                kernel); "current" is its former name and still accepted
  "rowwise"     one dynamic scale per row, e4m3 throughout, power-of-two scales (CUTLASS rowwise kernel)
Tensor parallelism uses torchao's Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput
(parallel/tensor_parallel.py) and FSDP2 gathers weights in FP8 with scales precomputed after each optimizer step
(`precompute_fp8_scales`); both exist for tensorwise scaling only, torchao's constraint, so rowwise runs with the
plain bf16 styles and all-gathers. Off FP8 hardware (CPU, pre-Ada GPUs) torchao's emulation runs the same casts
and dequantized fp32 matmuls (`emulate=True`).

Hand-written here, because torchao lacks it:
- autocast off CUDA: torchao's Float8Linear casts its input to the autocast dtype under CUDA autocast only, so
  under CPU autocast it would quantize the fp32 activations (and autocast would re-cast its FP8 operands);
  `Float8Linear` casts the input to the autocast dtype and runs torchao's GEMMs with autocast off, which is what
  torchao does on CUDA, so one process (autocast) quantizes the same bf16 inputs as FSDP's bf16 parameters do.
  parallel/tensor_parallel.py does the same for torchao's PrepareFloat8ModuleInput (`_prepare_float8_input`).
- LoRA: torchao swaps a module for a new Float8Linear and knows nothing of an adapter; `Float8LoraLinear` puts the
  sibling adapter back (model/lora.py), so the frozen base GEMM runs in FP8 and the adapter stays bf16.
- collectives on CPU: torchao all-gathers FP8 tensor-parallel inputs as float8 tensors, which gloo rejects
  ("Invalid scalar type"); for CPU tensors the same bytes go as uint8 (`_gather_fp8_bytes_on_cpu`, waited at once).
  CUDA tensors keep torchao's asynchronous float8 all-gather.
Not covered (torchao has no knob for it): activation amaxes are reduced over the tensor-parallel group only, so
under context parallelism each rank scales its own sequence chunk, as data-parallel ranks scale their own
micro-batches. The former hand-written GEMMs, quantizers and delayed (amax-history) scaling are gone: torchao has dynamic
scaling only, and its tensorwise recipe is what "current" scaling was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from scaletrain.log import get_logger
from scaletrain.model.lora import LoraLinear


class _ImportNoise(logging.Filter):
    """Drops exactly the import-time records that say nothing the user can act on; everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if record.name == "torchao" and msg.startswith("Failed to load ") and "torchao/_C" in msg:
            # torchao's CUDA kernel libraries (_C_mxfp8, _C_cutlass_90a, ...) on a CPU-only torch, where they cannot
            # exist; FP8 training needs none of them. On a CUDA or ROCm build a failed load stays visible.
            return torch.version.cuda is not None or torch.version.hip is not None
        if record.name == "torch.utils._pytree" and msg.startswith("%s is an Enum subclass"):
            # torch 2.13 deprecates registering an Enum as a pytree constant, which torchao's KernelPreference does.
            cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not getattr(cls, "__module__", "").startswith("torchao")
        return True


@contextlib.contextmanager
def _quiet_import():
    # torchao logs these through `logging` (not print or warnings) while it is imported: the filter sits on the two
    # loggers that emit them for the duration of the import only.
    loggers = [logging.getLogger(name) for name in ("torch.utils._pytree", "torchao")]
    noise = _ImportNoise()
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(noise)


with _quiet_import():  # ImportError without the [fp8] extra: callers report it
    from torchao.float8.float8_linear import Float8Linear as _TorchaoFloat8Linear


def _gather_fp8_bytes_on_cpu() -> None:
    """Route torchao's FP8 all-gathers of CPU tensors through uint8 (gloo has no float8 dtypes); see the docstring."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    table = float8_ops.FLOAT8_OPS_TABLE
    for op in (torch.ops.c10d_functional.all_gather_into_tensor, torch.ops._c10d_functional.all_gather_into_tensor):
        torchao_impl = table[op.default]
        if getattr(torchao_impl, "_scaletrain_cpu", False):
            continue

        def gather(aten_op, args, kwargs=None, _torchao_impl=torchao_impl):
            t = args[0]
            if t._data.device.type != "cpu":  # NCCL moves float8 itself, asynchronously
                return _torchao_impl(aten_op, args, kwargs)
            out = aten_op(t._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
            # Waited here: the pending result is a uint8 tensor, and its float8 view would not be the one waited on.
            out = torch.ops._c10d_functional.wait_tensor(out).view(t._data.dtype)
            return Float8TrainingTensor(out, t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role)

        gather._scaletrain_cpu = True  # type: ignore[attr-defined]
        table[op.default] = gather


_gather_fp8_bytes_on_cpu()

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

    from scaletrain.model.build import Decoder

log = get_logger(__name__)

RECIPES = ("tensorwise", "rowwise")
"""torchao recipe names train.fp8_recipe accepts (besides the alias "current")."""
ALIASES = {"current": "tensorwise"}
"""Former recipe names that still work: per-tensor scaling from this call's amax is torchao's tensorwise."""


class Float8Linear(_TorchaoFloat8Linear):
    """torchao's Float8Linear that also honours autocast off CUDA (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dev = input.device.type
        if dev != "cuda" and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return super().forward(input.to(torch.get_autocast_dtype(dev)))
        return super().forward(input)


class Float8LoraLinear(Float8Linear, LoraLinear):
    """A LoRA-wrapped linear whose frozen base GEMM runs in FP8; the sibling adapter stays in bf16."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return Float8Linear.forward(self, input) + self._lora_adapter(input)


def fp8_supported(device) -> bool:
    """True on a CUDA device of compute capability >= 8.9 (Ada, Hopper, Blackwell): real FP8 GEMMs there."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.version.hip:  # ROCm's fp8 formats differ by chip (fnuz on MI300): emulate rather than guess
        return False
    return _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index):
    return torch.cuda.get_device_capability(index)


def recipe_name(recipe: str) -> str:
    """The torchao recipe of a train.fp8_recipe value (aliases resolved); ValueError for an unknown one."""
    name = ALIASES.get(recipe, recipe)
    if name not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: must be one of {RECIPES} (or 'current', an alias of 'tensorwise')")
    return name


def float8_config(recipe: str, emulate: bool, fsdp_all_gather: bool = False) -> Float8LinearConfig:
    """torchao's Float8LinearConfig for `recipe`; FP8 all-gather under FSDP2 only where torchao has it (tensorwise)."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe_name(recipe))
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather and recipe_name(recipe) == "tensorwise"
    )


def is_tensorwise(module: nn.Module) -> bool:
    """True for a Float8Linear whose input, weight and gradient casts are all per-tensor (torchao's TP styles)."""
    from torchao.float8 import ScalingGranularity

    if not isinstance(module, _TorchaoFloat8Linear):
        return False
    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    return all(cc.scaling_granularity is ScalingGranularity.TENSORWISE for cc in casts)


def convert_to_float8(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    emulate: bool | None = None,
    fsdp_all_gather: bool = False,
    skip_first_last: bool = True,
) -> int:
    """Make the nn.Linear modules inside `model.blocks` FP8 (torchao) in place; return how many were converted.

    Works on a GPT, a Llama or a pipeline stage of either (blocks keep their global index, so "first" and "last"
    are blocks 0 and cfg.n_layers-1 of the whole model), on any device including meta. LoRA-wrapped linears get
    an FP8 base GEMM and keep their bf16 adapter; other Linear subclasses are left alone with a warning.
    `emulate` None: emulate unless the model's device has FP8 GEMMs. Call on the plain model, before tensor
    parallelism, activation checkpointing, compile and FSDP (`fsdp_all_gather`: the model will be fully_shard-ed).
    """
    from torchao.float8 import convert_to_float8_training

    blocks = cast("Decoder", model).blocks
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", None) or len(blocks)
    skip = {"0", str(n_layers - 1)} if skip_first_last else set()
    if emulate is None:
        emulate = not fp8_supported(next(model.parameters()).device)
    adapters, skipped = {}, []

    def wanted(mod: nn.Module, fqn: str) -> bool:
        parts = fqn.split(".")
        if len(parts) < 3 or parts[0] != "blocks" or parts[1] in skip or isinstance(mod, _TorchaoFloat8Linear):
            return False
        if type(mod) not in (nn.Linear, LoraLinear):
            skipped.append(fqn)
            return False
        if isinstance(mod, LoraLinear):
            adapters[fqn] = mod._lora_adapter
        return True

    before = set(float8_linears(model))
    convert_to_float8_training(model, module_filter_fn=wanted, config=float8_config(recipe, emulate, fsdp_all_gather))
    new = [fqn for fqn in float8_linears(model) if fqn not in before]
    for fqn in new:
        module = model.get_submodule(fqn)
        if fqn in adapters:
            module.__class__ = Float8LoraLinear
            module.__dict__["_lora_adapter"] = adapters[fqn]  # a plain reference, as apply_lora sets it
        else:
            module.__class__ = Float8Linear  # a subclass that adds no state: see the module docstring
    if skipped:
        log.warning(f"convert_to_float8: left in high precision (unsupported kind): {', '.join(sorted(set(skipped)))}")
    return len(new)


def float8_linears(model: nn.Module) -> list[str]:
    """FQNs of the FP8 linears of `model`."""
    return [n for n, m in model.named_modules() if isinstance(m, _TorchaoFloat8Linear)]


def precompute_fp8_scales(parts: list[nn.Module], trainable_only: bool = False) -> None:
    """Recompute the FP8 all-gather scales of FSDP2-sharded FP8 weights (one all-reduce); no-op without any.

    Call after every change of the weights (optimizer step, init, checkpoint load): FSDP casts each weight shard
    to FP8 with this precomputed scale before gathering it, and a stale scale would clip or waste range.
    `trainable_only`: skip parts whose FP8 weights are all frozen (a LoRA base: its scales never change).
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        linears = [m for m in part.modules() if isinstance(m, _TorchaoFloat8Linear)]
        if trainable_only and not any(m.weight.requires_grad for m in linears):
            continue
        if linears:
            precompute_float8_dynamic_scale_for_fsdp(part)
