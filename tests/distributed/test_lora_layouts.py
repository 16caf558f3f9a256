"""LoRA trains identically on FSDP, TP (with and without SP) and CP as in one process: losses and gradient norms.

Adapters on all four projections (column- and row-parallel bases), fp32, dropout 0 so the runs are
deterministic; B starts at 0, so from step 2 on both A and B learn and every adapter placement is exercised.
"""

from __future__ import annotations

import pytest
from launch import run_ranks

STEPS = 10
TOL = 1e-5


def _overrides(corpus_paths, extra):
    train, valid, tok = corpus_paths
    return [
        f"data.train_prefix={train}",
        f"data.valid_prefix={valid}",
        f"data.tokenizer={tok}",
        "model.vocab_size=1024",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.seq_len=32",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "train.dtype=fp32",
        "train.threads=1",
        "optim.lr=3e-3",
        "optim.warmup_samples=32",
        "optim.decay_samples=3200",
        "train.progress=false",
        "optim.grad_clip=0.05",
        "lora.rank=4",
        "lora.alpha=8",
        "lora.dropout=0",
        "lora.targets=['qkv','proj','fc1','fc2']",
        *extra,
    ]


def lora_run(rank, world_size, corpus_paths, extra, run_dir, steps=STEPS):
    """`steps` LoRA steps (+ one evaluation) under the layout in `extra`; losses, grad norms, adapter checks."""
    import torch

    from scaletrain.config import resolve
    from scaletrain.model.lora import is_lora_param
    from scaletrain.train.engine import Trainer

    cfg = resolve("gpt3-proxy", overrides=_overrides(corpus_paths, extra) + [f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg, run_dir)
    trainer.init()
    out = [trainer.train_step() for _ in range(steps)]
    eval_loss = trainer.evaluate()
    model = trainer.model
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    # Replicated adapter matrices must stay equal on every rank (dropout masks shared, gradients equal).
    replicated = {}
    for n, p in model.named_parameters():
        if is_lora_param(n) and hasattr(p, "placements") and all(pl.is_replicate() for pl in p.placements):
            replicated[n] = p.to_local().detach().double().sum().item()
    b_moved = max(
        float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().abs().max())
        for n, p in model.named_parameters()
        if n.endswith("lora_b")
    )
    trainer.finish({})
    return {
        "losses": [r["loss"] for r in out],
        "grad_norms": [r["grad_norm"] for r in out],
        "eval": eval_loss,
        "layout": trainer.layout.describe(),
        "trainable": trainable,
        "replicated": replicated,
        "b_moved": b_moved,
        "dtype": str(torch.get_default_dtype()),
    }


@pytest.fixture(scope="module")
def corpus_paths(excerpt_corpus):
    return (str(excerpt_corpus.train_prefix), str(excerpt_corpus.valid_prefix), str(excerpt_corpus.tokenizer))


@pytest.fixture(scope="module")
def reference(corpus_paths, tmp_path_factory):
    return lora_run(0, 1, corpus_paths, [], str(tmp_path_factory.mktemp("ref")))


LAYOUTS = {
    "fsdp": ["parallel.dp_shard=2"],
    "tp_sp": ["parallel.tp=2"],
    "tp_no_sp": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "cp": ["parallel.cp=2"],
}


def test_reference_trains_only_adapters(reference):
    assert reference["trainable"] and all(n.endswith(("lora_a", "lora_b")) for n in reference["trainable"])
    assert reference["b_moved"] > 1e-3  # B left zero: A never learns and the layouts compare nothing
    assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, corpus_paths, reference, tmp_path):
    results = run_ranks(lora_run, 2, corpus_paths, LAYOUTS[name], str(tmp_path), timeout=120)
    for got in results:
        loss_diff = max(abs(a - b) for a, b in zip(reference["losses"], got["losses"]))
        norm_diff = max(abs(a - b) for a, b in zip(reference["grad_norms"], got["grad_norms"]))
        print(f"{name}: max |loss diff| {loss_diff:.2e}, max |grad norm diff| {norm_diff:.2e}")
        assert loss_diff < TOL, f"{name}: losses {got['losses']} vs {reference['losses']}"
        assert norm_diff < TOL, f"{name}: grad norms {got['grad_norms']} vs {reference['grad_norms']}"
        assert abs(got["eval"] - reference["eval"]) < TOL
        assert got["trainable"] == reference["trainable"]
    assert results[0]["replicated"] == results[1]["replicated"]


def test_tp_dropout_keeps_replicated_adapters_in_sync(corpus_paths, tmp_path):
    # With dropout, the replicated input of a column-parallel adapter must be masked alike on both TP ranks.
    results = run_ranks(lora_run, 2, corpus_paths, ["parallel.tp=2", "lora.dropout=0.1"], str(tmp_path), 4, timeout=120)
    assert results[0]["replicated"] and results[0]["replicated"] == results[1]["replicated"]
    assert results[0]["losses"] == results[1]["losses"]
