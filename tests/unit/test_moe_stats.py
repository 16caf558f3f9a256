"""The trainer's MoE hooks (train/moe_stats.py): the auxiliary loss reaches the gradient as the mean over
micro-batches, recomputation and evaluation record nothing, and the step's statistics and bias updates come from
the counted forwards."""

from __future__ import annotations

import torch

from scaletrain.config import resolve
from scaletrain.model.build import build_model
from scaletrain.model.moe import moe_aux_loss, moe_layers
from scaletrain.train.moe_stats import MoEStats

TINY = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=12",
    "model.vocab_size=300",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff_expert=16",
    "model.sliding_window=4",
    "model.seq_len=8",
    "model.moe.aux_loss_coef=0.5",
    "model.moe.bias_update_rate=0.1",
]


def _model():
    cfg = resolve("gpt-oss-20b", overrides=TINY).model
    model = build_model(cfg)
    with torch.no_grad():
        model.init_weights(7)
    return cfg, model


def test_aux_loss_gradient_is_the_mean_over_micro_batches_and_stats_count_each_forward_once():
    torch.manual_seed(0)
    batches = [torch.randint(0, 300, (2, 8)) for _ in range(2)]
    cfg, hooked = _model()
    stats = MoEStats([hooked], cfg.n_layers, cfg.moe.n_experts, accum=2, device=torch.device("cpu"))
    _, plain = _model()
    auxes, counts = [], torch.zeros(cfg.n_layers, cfg.moe.n_experts)
    for x in batches:
        hooked(x).float().pow(2).mean().backward()
        out = plain(x).float().pow(2).mean()
        aux = moe_aux_loss(plain)
        auxes.append(float(aux.detach()))
        counts += torch.stack([m.tokens_per_expert.float() for m in moe_layers(plain)])
        (out + aux / 2).backward()
    with torch.no_grad():  # evaluation-like forwards record nothing
        hooked(batches[0])
    for (name, a), b in zip(hooked.named_parameters(), plain.parameters()):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6), name
    record = stats.finish_step(world_size=1, units=2)
    assert abs(record["moe_aux_loss"] - sum(auxes) / 2) < 1e-6
    per_expert = counts.sum(0)
    assert record["moe_tokens_per_expert_min"] == per_expert.min()
    assert record["moe_tokens_per_expert_max"] == per_expert.max()
    assert per_expert.sum() == 2 * 2 * 8 * 2 * 2  # micro-batches x batch x seq x top_k x MoE layers
    # Bias update from exactly those counts: sign(mean - count) x rate per layer.
    for i, m in enumerate(moe_layers(hooked)):
        expected = 0.1 * torch.sign(counts[i].mean() - counts[i])
        assert torch.allclose(m.router.expert_bias, expected)
    assert stats.finish_step(world_size=1, units=2) == {"moe_aux_loss": 0.0}  # reset after a step


def test_dense_model_has_no_stats():
    cfg = resolve("gpt3-proxy", overrides=["model.n_layers=2", "model.d_model=32", "model.n_heads=4"]).model
    model = build_model(cfg)
    stats = MoEStats([model], cfg.n_layers, cfg.moe.n_experts, accum=1, device=torch.device("cpu"))
    assert not stats.active and stats.finish_step(world_size=1, units=1) == {}
