"""FP8 GEMMs for the transformer-block linears: `torch._scaled_mm` on Hopper+, a faithful emulation elsewhere.

`convert_to_float8(model, recipe)` turns the `nn.Linear`s inside `model.blocks` into `Float8Linear` in place by
swapping the class (as LoRA does), so parameters keep their objects and names: init, FSDP, DCP/HF checkpoints
and the optimizer see the same model. Blocks 0 and n-1, the embedding and the head stay bf16 (the layers most
sensitive to quantization, as in NVIDIA's and torchao's recipes).

Per GEMM, with per-tensor scales `s = fp8_max / (amax * 2**margin)`:
  forward  y  = x @ W^T     x, W in e4m3 (range for activations/weights), bf16 out, bias added in bf16
  backward dx = g @ W       g in e5m2 (gradients need range more than precision), W reused from forward
           dW = g^T @ x     x reused from forward: x and W are saved in fp8 (half bf16's activation memory)
"current" scaling takes amax of the tensor at hand; "delayed" (Transformer Engine) takes the max over the last
`amax_history` amaxes, recorded in non-persistent buffers (not in state_dict, so checkpoints of existing runs and
DCP are unaffected), and uses the current amax only while the history is empty. Values beyond the scaled range
saturate to +-fp8_max (delayed scaling can lag a growing amax), never inf/NaN.

Real path: `torch._scaled_mm(a, b, scale_a=, scale_b=, out_dtype=, use_fast_accum=)` (same schema in torch 2.4
through 2.13; the scales are the *dequantization* factors 1/s). cuBLASLt wants A row-major, B column-major and
every dimension a multiple of 16; a call whose shapes do not fit (a tiny model, an odd token count) falls back
to emulation for that call only. Emulation quantizes with the same scales and saturation, multiplies the fp8
values (exact in fp32) with an fp32 accumulator and applies 1/(s_a*s_b) afterwards: what the tensor core
computes, up to accumulation order (and fast accumulation in the forward GEMM on Hopper).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from scaletrain.log import get_logger

if TYPE_CHECKING:
    from scaletrain.model.build import Decoder

log = get_logger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale


@dataclass
class Float8Recipe:
    scaling: str = "current"
    """"current" (per-tensor amax of this call) or "delayed" (max over the amax history)."""
    amax_history: int = 16
    """Delayed scaling: window of past amaxes; the scale comes from the max over it."""
    margin: int = 0
    """scale = fp8_max / (amax * 2**margin): headroom against amax growth."""
    emulate: bool | None = None
    """None: real FP8 GEMMs where fp8_supported(device), emulation otherwise; True/False force one path."""

    def __post_init__(self):
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"Float8Recipe.scaling={self.scaling!r}: must be 'current' or 'delayed'")
        if self.amax_history < 1 or self.margin < 0:
            raise ValueError("Float8Recipe: amax_history must be >= 1 and margin >= 0")


def fp8_supported(device) -> bool:
    """True on a CUDA device of compute capability >= 8.9 (Ada, Hopper, Blackwell) with torch._scaled_mm."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.version.hip:  # ROCm's fp8 formats differ by chip (fnuz on MI300): emulate rather than guess
        return False
    return _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index):
    return torch.cuda.get_device_capability(index)


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """fp32 scale mapping |x| <= amax onto the fp8 range: fp8_max / (amax * 2**margin)."""
    return torch.finfo(fp8_dtype).max / (amax.float().clamp(min=_EPS) * 2.0**margin)


def quantize(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """t * scale in fp8, saturating at +-fp8_max (a plain cast gives inf for e5m2 and may give NaN on CUDA)."""
    fmax = torch.finfo(fp8_dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q / scale in `dtype`."""
    return (q.float() / scale).to(dtype)


def _fits_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_cuda and all(d % 16 == 0 for d in (*a.shape, b.shape[1]))


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    real: bool,
    fast_accum: bool,
) -> torch.Tensor:
    """(a/scale_a) @ (b/scale_b) for fp8 a [M, K], b [K, N], in out_dtype; real FP8 GEMM when asked and it fits."""
    if real and (_fits_scaled_mm(a, b) or not a.is_cuda):
        return torch._scaled_mm(
            a.contiguous(),
            b.t().contiguous().t(),
            scale_a=scale_a.reciprocal().reshape(()),
            scale_b=scale_b.reciprocal().reshape(()),
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    return ((a.float() @ b.float()) * (scale_a * scale_b).reciprocal()).to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """x2d [M, K] @ weight^T [K, N] with all three GEMMs in fp8; `mod` holds the recipe and amax history."""

    @staticmethod
    def forward(ctx, x, weight, mod, out_dtype, real):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes here are chosen, not autocast's
            sx, sw = mod._scale("x", x, E4M3), mod._scale("w", weight, E4M3)
            xq, wq = quantize(x, sx, E4M3), quantize(weight, sw, E4M3)
            out = _gemm(xq, wq.t(), sx, sw, out_dtype, real, fast_accum=True)
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.mod, ctx.real, ctx.dtypes = mod, real, (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        xq, wq, sx, sw = ctx.saved_tensors
        dx = dw = None
        with torch.autocast(grad.device.type, enabled=False):
            sg = ctx.mod._scale("g", grad, E5M2)
            gq = quantize(grad.reshape(-1, grad.shape[-1]), sg, E5M2)
            if ctx.needs_input_grad[0]:
                dx = _gemm(gq, wq, sg, sw, grad.dtype, ctx.real, fast_accum=False).to(ctx.dtypes[0])
            if ctx.needs_input_grad[1]:  # a frozen (LoRA base) weight skips its GEMM
                w_dtype = ctx.dtypes[1] if ctx.dtypes[1] in (torch.float32, torch.bfloat16) else torch.float32
                dw = _gemm(gq.t(), xq, sg, sx, w_dtype, ctx.real, fast_accum=False).to(ctx.dtypes[1])
        return dx, dw, None, None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (see the module docstring); same parameters and state_dict."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Float8Recipe | None = None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8(recipe or Float8Recipe())

    def _init_fp8(self, recipe: Float8Recipe) -> None:
        self.fp8_recipe = recipe
        n = recipe.amax_history if recipe.scaling == "delayed" else 1
        for kind in ("x", "w", "g"):  # most recent amax first; zeros = no history yet
            self.register_buffer(f"fp8_amax_{kind}", torch.zeros(n, device=self.weight.device), persistent=False)

    def reset_fp8_state(self) -> None:
        """Forget the amax history (a cold start: the trainer's reset after warm-up calls this via init_weights)."""
        for kind in ("x", "w", "g"):
            getattr(self, f"fp8_amax_{kind}").zero_()

    @torch.no_grad()
    def _scale(self, kind: str, t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        amax = t.abs().amax().float()
        hist = getattr(self, f"fp8_amax_{kind}")
        use = amax
        if self.fp8_recipe.scaling == "delayed":
            prev = hist.max()
            use = torch.where(prev > 0, prev, amax)  # no sync: the first call falls back to the current amax
        if self.training:  # evaluation must not shift the training run's scales
            if hist.numel() > 1:
                hist.copy_(torch.roll(hist, 1))
            hist[0] = amax
        return amax_to_scale(use, fp8_dtype, self.fp8_recipe.margin)

    def _use_real(self, device: torch.device) -> bool:
        emulate = self.fp8_recipe.emulate
        return fp8_supported(device) if emulate is None else not emulate

    def _fp8_linear(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        out = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self, out_dtype, self._use_real(x.device))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fp8_linear(x)

    def extra_repr(self) -> str:
        r = self.fp8_recipe
        return f"{super().extra_repr()}, fp8={r.scaling}" + (f"(h{r.amax_history})" if r.scaling == "delayed" else "")


def _lora_class():
    from scaletrain.model.lora import LoraLinear

    class Float8LoraLinear(Float8Linear, LoraLinear):
        """A LoRA-wrapped linear whose frozen base GEMM runs in FP8; the adapter stays in bf16."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._fp8_linear(x) + self._lora_adapter(x)

    return Float8LoraLinear


Float8LoraLinear = _lora_class()


def _init_weights_and_fp8_state(self, seed: int = 0) -> None:
    # Bound per instance: the trainer's init and its reset after warm-up (part.init_weights) also clear the
    # amax histories, so warm-up leaves no trace and meta-built buffers (to_empty: garbage) start at zero.
    # The wrapped init (LoRA binds its own) is kept as a bound method so deepcopy rebinds it to the copy.
    orig = self.__dict__["_fp8_wrapped_init"]
    orig(seed) if orig is not None else type(self).init_weights(self, seed)
    for m in self.modules():
        if isinstance(m, Float8Linear):
            m.reset_fp8_state()


def convert_to_float8(model: nn.Module, recipe: Float8Recipe, skip_first_last: bool = True) -> int:
    """Make the nn.Linear modules inside `model.blocks` Float8Linear in place; return how many were converted.

    Works on a GPT, a Llama or a pipeline stage of either (blocks keep their global index, so "first" and "last"
    are blocks 0 and cfg.n_layers-1 of the whole model). LoRA-wrapped linears get an FP8 base GEMM; other Linear
    subclasses and tensor-parallel (DTensor) weights are left alone with a warning. Call before activation
    checkpointing, compile and FSDP.
    """
    from scaletrain.model.lora import LoraLinear

    blocks = cast("Decoder", model).blocks
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", None) or len(blocks)
    skip = {"0", str(n_layers - 1)} if skip_first_last else set()
    converted, skipped = 0, []
    for bname, block in blocks.items():
        if bname in skip:
            continue
        for name, m in block.named_modules():
            if not isinstance(m, nn.Linear) or isinstance(m, Float8Linear):
                continue
            if type(m) not in (nn.Linear, LoraLinear) or type(m.weight).__name__ == "DTensor":
                skipped.append(f"blocks.{bname}.{name}")
                continue
            m.__class__ = Float8LoraLinear if isinstance(m, LoraLinear) else Float8Linear
            cast(Float8Linear, m)._init_fp8(recipe)  # the class swap above made it one
            converted += 1
    if skipped:
        log.warning(f"convert_to_float8: left in high precision (unsupported kind): {', '.join(skipped)}")
    if converted and hasattr(type(model), "init_weights") and "_fp8_wrapped_init" not in model.__dict__:
        model.__dict__["_fp8_wrapped_init"] = model.__dict__.get("init_weights")
        # torch stubs type Module.__setattr__ for tensors and modules only; a bound method is fine at run time.
        model.init_weights = types.MethodType(_init_weights_and_fp8_state, model)  # type: ignore[assignment]
    return converted
