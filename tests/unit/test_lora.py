"""LoRA: frozen base, adapter-only gradients/optimizer/checkpoints, exact start, exact merge, training works."""

from __future__ import annotations

import copy

import pytest
import torch

from scaletrain.config import resolve
from scaletrain.model.gpt import GPT
from scaletrain.model.lora import apply_lora, init_lora, is_lora_param, lora_parameters, merge_lora
from scaletrain.model.loss import loss_sum

ALL = "lora.targets=['qkv','proj','fc1','fc2']"


def _cfg(*extra):
    return resolve(
        "gpt3-proxy",
        overrides=[
            "model.vocab_size=1024",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            "model.seq_len=32",
            "lora.rank=4",
            *extra,
        ],
    )


def _pair(cfg, b_std=0.0):
    base = GPT(cfg.model, seed=7)
    model = apply_lora(copy.deepcopy(base), cfg.lora)
    init_lora(model, 7, b_std)
    return base, model


def _tokens(n=2, s=32):
    return torch.randint(0, 1024, (n, s), generator=torch.Generator().manual_seed(0))


def test_b_zero_start_equals_base_and_base_names_unchanged():
    cfg = _cfg(ALL)
    base, model = _pair(cfg)
    x = _tokens()
    assert torch.equal(model(x), base(x))  # B = 0: exactly the base model, dropout or not
    names = set(model.state_dict())
    assert set(base.state_dict()) <= names  # blocks.0.attn.qkv.weight etc. keep their FQNs
    extra = sorted(names - set(base.state_dict()))
    assert extra and all(is_lora_param(n) for n in extra)
    assert "blocks.1.mlp.fc_lora.lora_a" in extra and "blocks.0.attn.proj_lora.lora_b" in extra


def test_gradients_flow_only_into_adapters():
    cfg = _cfg(ALL)
    _, model = _pair(cfg)
    x = _tokens()
    loss_sum(model(x), x).backward()
    for n, p in model.named_parameters():
        if is_lora_param(n):
            # B = 0: A gets no gradient yet (dL/dA = B^T ...), B does.
            assert p.grad is not None and (p.grad.abs().sum() > 0) == n.endswith("lora_b"), n
        else:
            assert not p.requires_grad and p.grad is None, n
    model.zero_grad(set_to_none=True)
    init_lora(model, 7, b_std=0.02)  # once B != 0 both adapter matrices learn
    loss_sum(model(x), x).backward()
    assert all(p.grad.abs().sum() > 0 for p in lora_parameters(model))
    assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_param(n))


def test_merged_model_matches_adapter_model():
    cfg = _cfg(ALL)
    base, model = _pair(cfg, b_std=0.05)
    model.eval()
    x = _tokens()
    with torch.no_grad():
        want = model(x)
        assert (want - base(x)).abs().max() > 1e-3  # the adapters do change the output
        merge_lora(model)
        got = model(x)
    assert set(model.state_dict()) == set(base.state_dict())
    assert not lora_parameters(model) and all(p.requires_grad for p in model.parameters())
    assert (got - want).abs().max().item() < 1e-5


def test_bad_targets_are_refused():
    from dataclasses import replace

    lora = _cfg().lora
    with pytest.raises(ValueError, match="unknown"):
        apply_lora(GPT(_cfg().model), replace(lora, targets=["q"]))
    with pytest.raises(ValueError, match="rank"):
        apply_lora(GPT(_cfg().model), replace(lora, rank=0))


# ---------------------------------------------------------------- through the trainer
def _trainer_cfg(corpus, run_dir, *extra):
    return resolve(
        "gpt3-proxy",
        overrides=[
            f"data.train_prefix={corpus.train_prefix}",
            f"data.valid_prefix={corpus.valid_prefix}",
            f"data.tokenizer={corpus.tokenizer}",
            "model.vocab_size=1024",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            "model.seq_len=64",
            "train.global_batch_size=8",
            "train.micro_batch_size=8",
            "train.dtype=fp32",
            "train.threads=1",
            "optim.lr=1e-2",
            "optim.warmup_samples=16",
            "optim.decay_samples=3200",
            "train.progress=false",
            "lora.rank=4",
            ALL,
            f"train.run_dir={run_dir}",
            *extra,
        ],
    )


def _trainer(corpus, run_dir, *extra):
    from scaletrain.train.engine import Trainer

    t = Trainer(_trainer_cfg(corpus, run_dir, *extra), run_dir)
    t.init()
    return t


def test_trainer_optimizes_only_adapters_and_loss_drops(excerpt_corpus, tmp_path):
    t = _trainer(excerpt_corpus, tmp_path)
    opt_params = {id(p) for g in t.optimizers[0].param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in lora_parameters(t.model)}
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not is_lora_param(n)}
    torch.manual_seed(0)  # adapter dropout draws from the global generator, which the trainer does not seed
    before = t.evaluate()
    losses = [t.train_step()["loss"] for _ in range(12)]
    after = t.evaluate()
    # A random base with a frozen tied head leaves the adapters little to learn (frozen, eval stays put).
    assert after < before - 0.02, (before, after, losses)
    assert all(torch.equal(p, frozen[n]) for n, p in t.model.named_parameters() if n in frozen)


def test_checkpoint_holds_only_adapters_and_resume_continues_identically(excerpt_corpus, tmp_path):
    from scaletrain.checkpoint import safe_load, store

    t = _trainer(excerpt_corpus, tmp_path / "a")
    for _ in range(3):
        t.train_step()
    t.save_checkpoint({})
    ref = [t.train_step()["loss"] for _ in range(3)]
    t.evaluate()
    ref_model = copy.deepcopy(t.model).eval()
    path = store.complete_checkpoints(tmp_path / "a" / "checkpoints")[-1]
    keys = set(safe_load.read_metadata(path).state_dict_metadata)
    model_keys = sorted(k[6:] for k in keys if k.startswith("model."))
    assert model_keys == sorted(n for n, _ in t.model.named_parameters() if is_lora_param(n))
    optim_state = [k for k in keys if k.startswith("optim.state.")]
    assert optim_state and all(".lora_a." in k or ".lora_b." in k for k in optim_state)

    r = _trainer(excerpt_corpus, tmp_path / "b", f"checkpoint.resume={path}")
    assert r.step == 3
    assert [r.train_step()["loss"] for _ in range(3)] == ref  # bitwise: base from the seed, adapters + moments

    # `scaletrain export` of a LoRA checkpoint writes merged weights; they reproduce the adapter model.
    from scaletrain.checkpoint.hf import import_hf
    from scaletrain.cli.main import main

    t.save_checkpoint({})
    assert main(["export", str(tmp_path / "a"), "--hf", str(tmp_path / "hf")]) == 0
    _, sd = import_hf(tmp_path / "hf")
    plain = GPT(t.cfg.model)
    plain.load_state_dict(sd, strict=False)
    plain.tie_weights()
    x = _tokens(2, 64)
    with torch.no_grad():
        assert (plain.eval()(x) - ref_model(x)).abs().max().item() < 1e-5
