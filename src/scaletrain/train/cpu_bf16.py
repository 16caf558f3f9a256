"""bf16 GEMMs on CPUs without a bf16 GEMM kernel: bf16 operands, fp32 arithmetic, bf16 result.

torch's CPU bf16 GEMM is fast only where oneDNN has native bf16 instructions (AVX512-BF16, AMX). Elsewhere (an
AVX2-only AMD EPYC, say) it falls back to a reference loop: 1.3 GFLOP/s against 140 GFLOP/s in fp32 on the same
two cores, so one step of the default gpt3 proxy took a minute instead of about a second. A bf16 GEMM on hardware
that has one multiplies bf16 operands and accumulates in fp32; `Bf16GemmsInFp32` computes exactly that: the bf16
operands are widened to fp32 (exact), multiplied by the fp32 kernel, and the result is rounded to bf16. Only the
order of the fp32 summation differs, as it differs between any two CPU kernels.

The mode intercepts the ATen GEMMs that autocast's bf16 linears, matmuls and einsums lower to, forward and
backward (the training engine enters it around both), on plain tensors and on DTensors alike (a DTensor's `.float()`
is a local cast). CPU flash attention (forward and backward) is widened the same way: its bf16 kernel computes in
fp32 internally but is 4x slower than the fp32 one on AVX2; its bf16 outputs are rounded back, its fp32 logsumexp
stays fp32.
"""

from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})
# CPU flash attention: which outputs are bf16 when the inputs are (the logsumexp is fp32 either way).
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),
}
ENV = "SCALETRAIN_CPU_BF16_GEMM"
""""native" or "emulated" forces the choice (tests exercise both on any CPU); unset, `native_bf16_gemm` decides."""


@lru_cache(maxsize=1)
def native_bf16_gemm() -> bool:
    """True when this CPU runs bf16 GEMMs natively (oneDNN's bf16 support: AVX512-BF16 or AMX), or $ENV says so."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("native", "emulated"):
        return forced == "native"
    if forced:
        raise ValueError(f"${ENV}={forced!r}: expected 'native' or 'emulated'")
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def gemm_mode() -> str:
    """How bf16 GEMMs run on this CPU: "native" or "emulated" (fp32 arithmetic on bf16 operands)."""
    return "native" if native_bf16_gemm() else "emulated"


def _widen(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


class Bf16GemmsInFp32(TorchDispatchMode):
    """Runs every bf16 CPU GEMM as an fp32 GEMM of the (exactly widened) bf16 operands, rounded back to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _GEMMS or func in _ATTENTION) and _bf16_on_cpu(args):
            widened = func(*map(_widen, args), **{k: _widen(v) for k, v in kwargs.items()})
            if func in _GEMMS:
                return widened.to(torch.bfloat16)
            rounded = _ATTENTION[func]
            return tuple(t.to(torch.bfloat16) if i in rounded else t for i, t in enumerate(widened))
        return func(*args, **kwargs)


def _bf16_on_cpu(args) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (
        any(t.dtype == torch.bfloat16 for t in tensors)
        and all(t.device.type == "cpu" for t in tensors)
        # Plain tensors and DTensors of them only: other subclasses (torchao's FP8 tensors) run their own GEMMs
        # and support no dtype cast.
        and all(_widenable(t) for t in tensors)
    )


def _widenable(t: torch.Tensor) -> bool:
    if type(t) is DTensor:
        t = t._local_tensor  # a DTensor can wrap an FP8 tensor (FP8 tensor parallelism)
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def bf16_gemm_context(device: torch.device, dtype: str, compiled: bool = False) -> contextlib.AbstractContextManager:
    """The emulation mode for a bf16 run on a CPU without native bf16 GEMMs, else a no-op context.

    A compiled model is left alone: inductor lowers its GEMMs itself, and a Python dispatch mode would stop it
    from tracing them."""
    if device.type != "cpu" or dtype != "bf16" or compiled or native_bf16_gemm():
        return contextlib.nullcontext()
    return Bf16GemmsInFp32()
