"""FP8 linears (model/fp8.py): quantization, scaling recipes, Float8Linear numerics, conversion, training, config.

Everything here runs the emulation (and, where this torch has a CPU kernel, the real `torch._scaled_mm` path);
the GPU benchmark checks real FP8 GEMMs on Hopper.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

from scaletrain.config import ConfigError, resolve
from scaletrain.model.build import build_model
from scaletrain.model.fp8 import (E4M3, E5M2, Float8LoraLinear, Float8Linear, Float8Recipe, _gemm, amax_to_scale,
                                  convert_to_float8, dequantize, fp8_supported, quantize)


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("dtype,mantissa", [(E4M3, 3), (E5M2, 2)])
def test_round_trip_error_is_half_an_ulp(dtype, mantissa):
    g = torch.Generator().manual_seed(0)
    # Magnitudes over 10 binades below amax: all land in fp8's normal range after scaling.
    x = torch.sign(torch.randn(4096, generator=g)) * 3.0 * 2.0 ** (-10 * torch.rand(4096, generator=g))
    scale = amax_to_scale(x.abs().amax(), dtype)
    q = quantize(x, scale, dtype)
    assert q.dtype == dtype
    rel = ((dequantize(q, scale) - x).abs() / x.abs()).max()
    assert rel <= 2.0 ** -(mantissa + 1) * 1.0001  # round to nearest: half the relative spacing
    assert rel > 2.0 ** -(mantissa + 3)  # and really quantized (not a pass-through)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_instead_of_overflowing(dtype):
    fmax = torch.finfo(dtype).max
    scale = amax_to_scale(torch.tensor(1.0), dtype)
    q = quantize(torch.tensor([-100.0, -1.0, 0.0, 1.0, 100.0, 1e30]), scale, dtype).float()
    assert torch.equal(q, torch.tensor([-fmax, -fmax, 0.0, fmax, fmax, fmax]))


def test_scale_from_amax_and_margin():
    assert float(amax_to_scale(torch.tensor(2.0), E4M3)) == 448.0 / 2
    assert float(amax_to_scale(torch.tensor(2.0), E5M2, margin=1)) == 57344.0 / 4
    assert torch.isfinite(amax_to_scale(torch.tensor(0.0), E4M3))  # all-zero input: finite scale


def test_current_scaling_uses_this_calls_amax():
    lin = Float8Linear(16, 16, recipe=Float8Recipe("current"))
    for amax in (1.0, 8.0, 2.0):
        t = torch.tensor([amax, -amax / 2])
        assert float(lin._scale("x", t, E4M3)) == 448.0 / amax
    assert lin.fp8_amax_x.tolist() == [2.0]


def test_delayed_scaling_uses_history_max_and_rolls():
    lin = Float8Linear(16, 16, recipe=Float8Recipe("delayed", amax_history=3))
    seen = []
    for amax in (1.0, 8.0, 2.0, 3.0, 0.5, 0.25):
        seen.append(448.0 / float(lin._scale("x", torch.tensor([amax]), E4M3)))
    # First call: empty history, so this call's amax; then the max over the previous 3 amaxes (8 rolls out).
    assert seen == pytest.approx([1.0, 1.0, 8.0, 8.0, 8.0, 3.0], rel=1e-6)
    assert lin.fp8_amax_x.tolist() == [0.25, 0.5, 3.0]  # most recent first, window of 3
    lin.eval()
    lin._scale("x", torch.tensor([100.0]), E4M3)
    assert lin.fp8_amax_x.tolist() == [0.25, 0.5, 3.0]  # evaluation does not record
    assert "fp8_amax_x" not in lin.state_dict()  # non-persistent: checkpoints unchanged


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_float8_linear_matches_fp32_linear_within_fp8_error(scaling):
    torch.manual_seed(0)
    ref = nn.Linear(64, 96)
    lin = Float8Linear(64, 96, recipe=Float8Recipe(scaling, emulate=True))
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(4, 32, 64, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    for _ in range(2):  # the second step uses the delayed history
        for p in (*ref.parameters(), *lin.parameters(), x, x8):
            p.grad = None
        g = torch.randn(4, 32, 96)
        y, y8 = ref(x), lin(x8)
        y.backward(g)
        y8.backward(g)
        # Measured: forward 0.036 (e4m3 x e4m3), input/weight grads 0.059 (e5m2 gradient); fp32 would be ~1e-7.
        assert 0.01 < _rel(y8, y) < 0.06
        assert 0.02 < _rel(x8.grad, x.grad) < 0.1
        assert 0.02 < _rel(lin.weight.grad, ref.weight.grad) < 0.1
        assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)  # bias in high precision


def test_autocast_bf16_output_and_fp32_master_grads():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    lin = Float8Linear(64, 32)
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(2, 16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert _rel(y, ref(x)) < 0.06


def test_real_scaled_mm_path_equals_emulation():
    if fp8_supported("cpu"):
        pytest.fail("fp8_supported must be False off CUDA")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(96, 64, generator=g)
    sa, sb = amax_to_scale(a.abs().amax(), E5M2), amax_to_scale(b.abs().amax(), E4M3)
    aq, bq = quantize(a, sa, E5M2), quantize(b, sb, E4M3)
    emulated = _gemm(aq, bq.t(), sa, sb, torch.float32, real=False, fast_accum=False)
    try:  # the CUDA arguments, layouts and scale convention through the CPU kernel (torch >= 2.13 has one)
        real = _gemm(aq, bq.t(), sa, sb, torch.float32, real=True, fast_accum=False)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no CPU torch._scaled_mm here: {e}")
    assert _rel(real, emulated) < 1e-5
    assert _rel(emulated, a @ b.t()) < 0.1


def _model(preset, n_layers=4):
    over = ["model.vocab_size=1024", f"model.n_layers={n_layers}", "model.d_model=64", "model.n_heads=4",
            "model.seq_len=32"]
    cfg = resolve(preset, overrides=over + (["model.n_kv_heads=2"] if "llama" in preset else []))
    return cfg, build_model(cfg.model)


@pytest.mark.parametrize("preset", ["gpt3-proxy", "llama-proxy"])
def test_convert_middle_blocks_keeps_names_and_parameters(preset):
    cfg, model = _model(preset)
    ref = copy.deepcopy(model)
    params = dict(model.named_parameters())
    x = torch.randint(0, 1024, (2, 32))
    assert convert_to_float8(model, Float8Recipe()) == 2 * 4  # blocks 1, 2: qkv, proj, mlp in/out each
    assert dict(model.named_parameters()) == params  # the same objects under the same names
    assert list(model.state_dict()) == list(ref.state_dict())
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert [n for n, k in kinds.items() if k is Float8Linear] == [
        f"blocks.{b}.{leaf}" for b in (1, 2) for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    assert type(model.head) is nn.Linear and not isinstance(model.embed.tok, Float8Linear)
    assert 0 < _rel(model(x), ref(x)) < 0.05
    assert convert_to_float8(model, Float8Recipe()) == 0  # idempotent
    assert convert_to_float8(copy.deepcopy(ref), Float8Recipe(), skip_first_last=False) == 4 * 4


def test_unsupported_linear_is_left_alone_with_a_warning(capsys):
    class OtherLinear(nn.Linear):
        pass

    _, model = _model("gpt3-proxy")
    model.blocks["1"].mlp.fc.__class__ = OtherLinear
    assert convert_to_float8(model, Float8Recipe()) == 2 * 4 - 1
    assert type(model.blocks["1"].mlp.fc) is OtherLinear
    assert capsys.readouterr().err == (
        "scaletrain: warning: convert_to_float8: left in high precision (unsupported kind): blocks.1.mlp.fc\n")


def test_pipeline_stage_keeps_global_first_last_and_lora_base_gemm():
    from scaletrain.parallel.pipeline import cut_stage
    cfg, model = _model("gpt3-proxy")
    assert convert_to_float8(cut_stage(model, 1, 2), Float8Recipe()) == 4  # blocks 2, 3: 3 is the last
    from scaletrain.model.lora import apply_lora, init_lora
    cfg = resolve("gpt3-proxy", overrides=["lora.rank=4", "lora.targets=['qkv','fc2']"])
    apply_lora(model, cfg.lora)
    init_lora(model, 0, b_std=0.02)
    assert convert_to_float8(model, Float8Recipe()) == 8
    qkv = model.blocks["1"].attn.qkv
    assert type(qkv) is Float8LoraLinear
    model(torch.randint(0, 1024, (2, 32))).float().square().mean().backward()
    assert qkv.weight.grad is None and model.blocks["1"].attn.qkv_lora.lora_a.grad.abs().sum() > 0


def test_init_weights_resets_amax_history_after_meta_build():
    cfg, _ = _model("gpt3-proxy")
    with torch.device("meta"):
        model = build_model(cfg.model)
    convert_to_float8(model, Float8Recipe("delayed"))
    model.to_empty(device="cpu")
    lin = model.blocks["1"].mlp.fc
    lin.fp8_amax_x.fill_(float("nan"))  # to_empty leaves garbage
    model.init_weights(3)
    assert lin.fp8_amax_x.abs().sum() == 0 and lin.fp8_amax_x.numel() == 16
    assert torch.isfinite(model(torch.randint(0, 1024, (2, 32)))).all()


def _train(corpus, tmp_path, tag, *extra, steps=100):
    from scaletrain.train.engine import Trainer
    over = [f"data.train_prefix={corpus.train_prefix}", f"data.valid_prefix={corpus.valid_prefix}",
            f"data.tokenizer={corpus.tokenizer}", "model.vocab_size=1024", "model.n_layers=4", "model.d_model=64",
            "model.n_heads=2", "model.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=16",
            "train.dtype=bf16", "train.threads=1", "train.eval_interval_samples=100000", "optim.lr=2e-3",
            "optim.warmup_samples=160", "optim.decay_samples=3200", "train.progress=false",
            "train.target_eval_loss=0.1", f"train.max_steps={steps}", f"train.run_dir={tmp_path / tag}", *extra]
    trainer = Trainer(resolve("gpt3-proxy", overrides=over), tmp_path / tag)
    trainer.init()
    n_fp8 = sum(isinstance(m, Float8Linear) for m in trainer.model.modules())
    losses = np.array([trainer.train_step()["loss"] for _ in range(steps)])
    trainer.finish({})
    return losses, n_fp8


@pytest.mark.slow
def test_fp8_training_tracks_bf16(excerpt_corpus, tmp_path):
    """FP8 (both recipes) follows bf16 step by step at first and settles where bf16 runs settle.

    Bounds come from measured spreads (4 layers, d64, 100 steps, losses ~6.9 -> ~5.3):
    * Early steps 0-7, same weights and batches: |FP8 - bf16| <= 3e-4 (quantization error only; reordered
      accumulation moves bf16 by ~1e-6 here). Bound 1.5e-3. Scales off by 256x (saturated GEMMs) give 9e-3.
    * After that the curves decorrelate (every later batch sees different gradients), so only the level they
      settle at is comparable: the mean loss over steps 50-99. bf16 seeds 1234/7/99/5 scatter over 0.215, 15%
      of the loss drop (~1.47); FP8 minus bf16 of the same seed was -0.066 / -0.143 (current / delayed, seed
      1234) and -0.037 / -0.085 (seed 7). The old bound (final loss within 2%) sat inside that scatter: delayed
      ends 2.06% below bf16. Bound: 25% of the drop, the widest seed-to-seed scatter widened by ~1.7x.
    FP8 confined to blocks 1-2 of 4 barely moves the loss, so milder breakage (no scaling at all, e5m2 for
    activations) stays inside these bounds; test_float8_linear_matches_fp32_linear_* checks the GEMM error.
    """
    base, n = _train(excerpt_corpus, tmp_path, "bf16")
    drop = base[0] - base[50:].mean()
    assert n == 0 and drop > 1.0  # bf16 trains at all
    for recipe in ("current", "delayed"):
        fp8, n = _train(excerpt_corpus, tmp_path, recipe, "train.fp8=true", f"train.fp8_recipe={recipe}")
        assert n == 8  # blocks 1, 2 of 4
        early = np.abs(fp8[:8] - base[:8]).max()
        assert early < 1.5e-3, (recipe, early)
        gap = fp8[50:].mean() - base[50:].mean()
        assert abs(gap) < 0.25 * drop, (recipe, gap, drop)
        assert not np.array_equal(fp8, base)  # FP8 really ran


def test_config_validation_messages():
    assert resolve("gpt3-proxy", overrides=["train.fp8=true"]).train.fp8_recipe == "current"
    cases = {("train.fp8_recipe=rowwise",): "train.fp8_recipe='rowwise': must be 'current' or 'delayed'",
             ("train.fp8=true", "train.dtype=fp32"): "train.fp8 needs train.dtype='bf16'",
             ("train.fp8=true", "parallel.tp=2"): "train.fp8 with parallel.tp > 1 is not supported yet"}
    for over, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve("gpt3-proxy", overrides=list(over))


def fsdp_run(rank, world_size, corpus, extra, run_dir, steps=5):
    """`steps` fp8 (current) steps under the layout in `extra`: losses and the checkpointable state's keys."""
    from types import SimpleNamespace
    losses, n = _train(SimpleNamespace(**corpus), run_dir, f"r{world_size}", "train.fp8=true",
                       "train.micro_batch_size=8", *extra, steps=steps)
    return {"losses": losses.tolist(), "n_fp8": n}


@pytest.mark.slow
def test_fp8_under_fsdp_on_two_ranks_tracks_one_process(excerpt_corpus, tmp_path):
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "distributed"))
    from launch import run_ranks
    corpus = {k: getattr(excerpt_corpus, k) for k in ("train_prefix", "valid_prefix", "tokenizer")}
    one = fsdp_run(0, 1, corpus, [], tmp_path)
    # FSDP2 hands Float8Linear its all-gathered bf16 weight as a plain tensor inside forward; each rank scales
    # its own half of the batch, so losses are close to, not equal to, the single process's.
    two = run_ranks(fsdp_run, 2, corpus, ["parallel.dp_shard=2"], tmp_path, timeout=240)
    assert two[0]["n_fp8"] == 8 and two[0]["losses"] == two[1]["losses"]
    # Measured: max |diff| 9e-5 over 5 steps (bf16 FSDP parameters vs autocast of fp32 ones, per-rank amax).
    assert np.abs(np.array(two[0]["losses"]) - one["losses"]).max() < 2e-3, (two[0]["losses"], one["losses"])
