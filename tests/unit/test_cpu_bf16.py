"""bf16 GEMMs emulated in fp32 on CPUs without a bf16 GEMM kernel (train/cpu_bf16.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from scaletrain.train import cpu_bf16
from scaletrain.train.cpu_bf16 import Bf16GemmsInFp32, bf16_gemm_context


@pytest.fixture
def forced(monkeypatch):
    def force(mode: str | None):
        if mode is None:
            monkeypatch.delenv(cpu_bf16.ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_bf16.ENV, mode)
        cpu_bf16.native_bf16_gemm.cache_clear()

    yield force
    cpu_bf16.native_bf16_gemm.cache_clear()


def _bf16(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).bfloat16()


@pytest.mark.parametrize(
    "op,args",
    [
        (torch.mm, lambda: (_bf16(17, 33), _bf16(33, 9))),
        (torch.addmm, lambda: (_bf16(9), _bf16(17, 33), _bf16(33, 9))),
        (torch.bmm, lambda: (_bf16(3, 17, 33), _bf16(3, 33, 9))),
        (torch.baddbmm, lambda: (_bf16(3, 17, 9), _bf16(3, 17, 33), _bf16(3, 33, 9))),
    ],
    ids=["mm", "addmm", "bmm", "baddbmm"],
)
def test_each_gemm_is_the_fp32_product_of_the_bf16_operands_rounded_once(op, args):
    operands = args()
    with Bf16GemmsInFp32():
        got = op(*operands)
    want = op(*(t.float() for t in operands)).bfloat16()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # torch's own bf16 kernel (reference loop or oneDNN) computes the same product up to summation order.
    torch.testing.assert_close(got.float(), op(*operands).float(), rtol=2e-2, atol=2e-2)


def test_fp32_gemms_pass_through_untouched():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with Bf16GemmsInFp32():
        assert torch.equal(a @ b, torch.mm(a, b))


def test_autocast_training_step_matches_torch_bf16_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32)

    def grads(emulate: bool):
        model.zero_grad()
        with Bf16GemmsInFp32() if emulate else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss_e, grads_e = grads(True)
    loss_n, grads_n = grads(False)
    assert loss_e == pytest.approx(loss_n, rel=1e-2)
    for ge, gn in zip(grads_e, grads_n):
        assert ge.dtype == torch.float32  # master-weight gradients stay fp32, as under plain autocast
        torch.testing.assert_close(ge, gn, rtol=5e-2, atol=5e-3)


def test_the_mode_is_entered_only_for_bf16_on_a_cpu_without_bf16_gemms(forced):
    cpu = torch.device("cpu")
    forced("emulated")
    assert isinstance(bf16_gemm_context(cpu, "bf16"), Bf16GemmsInFp32)
    assert cpu_bf16.gemm_mode() == "emulated"
    assert isinstance(bf16_gemm_context(cpu, "fp32"), contextlib.nullcontext)
    assert isinstance(bf16_gemm_context(cpu, "bf16", compiled=True), contextlib.nullcontext)
    assert isinstance(bf16_gemm_context(torch.device("cuda", 0), "bf16"), contextlib.nullcontext)
    forced("native")
    assert isinstance(bf16_gemm_context(cpu, "bf16"), contextlib.nullcontext)
    forced("sometimes")
    with pytest.raises(ValueError, match=cpu_bf16.ENV):
        cpu_bf16.native_bf16_gemm()


def test_the_device_probe_times_bf16_gemms_the_way_the_run_computes_them(forced, monkeypatch):
    from scaletrain.train.device_probe import gemm_flops

    seen = []

    class Counting(Bf16GemmsInFp32):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setattr(cpu_bf16, "Bf16GemmsInFp32", Counting)
    forced("emulated")
    gemm_flops(torch.bfloat16, n=16, repeats=2, window_s=0.0)
    assert torch.ops.aten.mm.default in seen
    seen.clear()
    gemm_flops(torch.float32, n=16, repeats=2, window_s=0.0)
    forced("native")
    gemm_flops(torch.bfloat16, n=16, repeats=2, window_s=0.0)
    assert seen == []


def test_cpu_flash_attention_runs_widened_forward_and_backward():
    import torch.nn.functional as F

    q0, k0, v0 = (_bf16(2, 2, 32, 16 + i)[..., :16] for i in range(3))
    with Bf16GemmsInFp32():
        out = F.scaled_dot_product_attention(q0, k0, v0, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(
        out, F.scaled_dot_product_attention(q0.float(), k0.float(), v0.float(), is_causal=True).bfloat16()
    )

    def grads(emulate: bool):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        with Bf16GemmsInFp32() if emulate else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            (o.float() * torch.linspace(-1, 1, 16)).sum().backward()
        return [t.grad for t in (q, k, v)]

    for ge, gn in zip(grads(True), grads(False)):
        assert ge.dtype == torch.bfloat16
        torch.testing.assert_close(ge.float(), gn.float(), rtol=3e-2, atol=3e-2)


def test_fp8_linears_keep_their_own_gemms_under_the_mode():
    from scaletrain.config import resolve
    from scaletrain.model.build import build_model
    from scaletrain.model.fp8 import convert_to_float8, float8_linears

    over = ["model.vocab_size=256", "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=16"]
    model = build_model(resolve("gpt3-proxy", overrides=over).model)
    model.init_weights(0)
    convert_to_float8(model, "tensorwise", emulate=True)
    assert float8_linears(model)
    x = torch.randint(0, 256, (2, 16))
    with Bf16GemmsInFp32(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
        loss.backward()  # torchao's FP8 tensors support no dtype cast: the mode must leave them alone
    assert torch.isfinite(loss)
