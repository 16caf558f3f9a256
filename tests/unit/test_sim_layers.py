"""The simulator's per-layer inventory (sim/layers.py) against the real torch modules and the trainer's FLOPs."""

from dataclasses import fields

import pytest
import torch
from torch import nn

from scaletrain.architectures import LORA_TARGETS
from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.model import flops
from scaletrain.model.build import build_model
from scaletrain.model.lora import apply_lora
from scaletrain.sim.layers import Inventory, ModelShape
from scaletrain.sim.workload import Workload, model_shape, workload_from_config

TINY = {
    "gpt": [
        "model.arch=gpt3",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.seq_len=32",
        "model.vocab_size=200",
    ],
    "llama-gqa": [
        "model.arch=llama",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=96",
        "model.seq_len=32",
        "model.vocab_size=200",
    ],
}
LORA = [
    ("gpt", ["lora.rank=4"]),
    ("llama-gqa", ["lora.rank=2", 'lora.targets=["qkv", "proj", "fc1", "fc2"]']),
    ("gpt", ["lora.rank=3", 'lora.targets=["fc1", "fc2"]']),
]


def _cfg(kind: str, extra=()):
    return resolve("gpt3-proxy", overrides=[*TINY[kind], *extra])


def _torch_counts(cfg):
    with torch.device("meta"):
        model = build_model(cfg.model)
        if cfg.lora.rank > 0:
            apply_lora(model, cfg.lora)
    params = list(model.parameters())  # deduplicated: GPT-3's tied head counts once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_inventory_parameters_equal_the_real_modules(kind):
    cfg = _cfg(kind)
    inv = Inventory(model_shape(cfg))
    total, trainable = _torch_counts(cfg)
    assert inv.params == total == trainable
    assert inv.trainable_params == total


@pytest.mark.parametrize("kind,extra", LORA)
def test_inventory_lora_parameters_equal_the_real_adapters(kind, extra):
    cfg = _cfg(kind, extra)
    inv = Inventory(model_shape(cfg))
    total, trainable = _torch_counts(cfg)
    assert inv.params + inv.adapter_params == total
    assert inv.trainable_params == inv.adapter_params == trainable > 0


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("gpt3-175b", []),
        ("llama2-70b", []),
        ("llama2-70b-lora", []),
        ("llama2-70b-lora", ['lora.targets=["qkv", "proj", "fc1", "fc2"]']),
        ("gpt3-proxy", ["lora.rank=8"]),
        ("llama2-7b", ["model.seq_len=8192"]),
        ("llama31-8b", []),
        ("llama31-405b", []),
    ],
)
def test_inventory_flops_equal_the_trainers(preset, extra):
    cfg = resolve(preset, overrides=extra)
    m, lo = cfg.model, cfg.lora
    inv = Inventory(model_shape(cfg))
    assert inv.params == flops.num_params(m)
    assert inv.flops_per_token(m.seq_len) == pytest.approx(
        flops.flops_per_token(m, lora_rank=lo.rank, lora_targets=tuple(lo.targets)), rel=1e-12
    )
    fwd = flops.forward_flops_per_token(m)
    for kind, value in inv.forward_flops(m.seq_len).items():
        assert value == pytest.approx(fwd[kind], rel=1e-12)
    if lo.rank > 0:
        assert inv.adapter_params == flops.lora_params(m, lo.rank, tuple(lo.targets))
    w = workload_from_config(cfg)
    assert w.flops_per_token == inv.flops_per_token(m.seq_len) and w.inventory.params == inv.params


@pytest.mark.parametrize("kind", sorted(TINY))
def test_each_lora_target_names_one_linear_whose_fans_are_the_inventorys_gemm(kind):
    cfg = _cfg(kind, ["lora.rank=2", f"lora.targets={list(LORA_TARGETS)}"])
    with torch.device("meta"):
        model = apply_lora(build_model(cfg.model), cfg.lora)
    block = model.blocks["0"]
    inv = Inventory(model_shape(cfg))
    gemms = {g.name: g for g in inv.layer}
    for t in LORA_TARGETS.values():
        linear, adapter = block.get_submodule(t.module), block.get_submodule(t.module + "_lora")
        assert isinstance(linear, nn.Linear) and adapter.kind == gemms[t.name].tp == t.tp
        assert (linear.in_features, linear.out_features) == (gemms[t.name].k, gemms[t.name].n)
        assert gemms[f"{t.name}.a"].params + gemms[f"{t.name}.b"].params == sum(p.numel() for p in adapter.parameters())


def test_a_lora_target_the_model_lacks_is_one_line_and_exit_2(capsys):
    moe = ModelShape("gpt_oss", 2, 64, 4, 2, 96, 200, experts=4, top_k=2, lora_rank=8, lora_targets=("fc1",))
    with pytest.raises(ValueError, match=r"^lora.targets: 'fc1' adapts no projection of model.arch='gpt_oss'"):
        Inventory(moe)
    set_lora = ["--set", "lora.rank=8", "--set", 'lora.targets=["fc1"]']
    assert main(["predict", "--model", "gpt-oss-20b", "--gpu", "h100", "--gpus", "8", *set_lora]) == 2
    err = capsys.readouterr().err.strip()
    assert "adapts no projection" in err and "\n" not in err


def test_a_workload_holds_the_model_shape_and_declares_none_of_its_fields():
    w = workload_from_config(_cfg("gpt"))
    assert [f.name for f in fields(Workload)] == ["shape", "seq_len", "name"]
    assert w.inventory.shape is w.shape
    assert not [f.name for f in fields(ModelShape) if hasattr(w, f.name)]


def test_gemm_shapes_split_by_tensor_parallelism():
    inv = Inventory(model_shape(resolve("llama2-70b-lora")))
    # Llama 2 70B: h 8192, 64 heads / 8 KV heads of 128, SwiGLU 28672; LoRA rank 16 on qkv and proj.
    assert inv.gemm_shapes(4096, 4) == [
        (4096, (8192 + 2 * 1024) // 4, 8192),
        (4096, 8192, 8192 // 4),
        (4096, 2 * 28672 // 4, 8192),
        (4096, 8192, 28672 // 4),
        (4096, 16, 8192),
        (4096, 10240 // 4, 16),
        (4096, 16, 8192 // 4),
        (4096, 8192, 16),
    ]
    assert [g.trainable for g in inv.layer] == [False] * 4 + [True] * 4


def test_saved_bytes_reproduce_korthikanti_34_sbh():
    inv = Inventory(model_shape(resolve("gpt3-175b")))
    h = 12288
    assert inv.saved_per_token(1, fp8=False, dropout=True) == (10 * h, 24 * h)
    assert inv.saved_per_token(1, fp8=False, dropout=False) == (8 * h, 24 * h)
