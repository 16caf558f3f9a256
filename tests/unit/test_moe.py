"""The Mixture-of-Experts layer (scaletrain.model.moe) against a per-token reference, and its balancing machinery."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scaletrain.config import ModelConfig, MoEConfig
from scaletrain.model.common import swiglu
from scaletrain.model.moe import MoE, moe_aux_loss, update_biases


def _cfg(arch: str = "llama", d: int = 16, **moe) -> ModelConfig:
    m = dict(n_experts=8, top_k=2, d_ff_expert=12)
    return ModelConfig(arch=arch, n_layers=1, d_model=d, n_heads=2, d_ff=24, moe=MoEConfig(**{**m, **moe}))


def _moe(seed: int = 0, arch: str = "llama", swiglu_limit: float = 0.0, **moe) -> MoE:
    cfg = _cfg(arch, **moe)
    cfg.swiglu_limit = swiglu_limit
    layer = MoE(cfg)
    layer.init_weights(0.3, seed, "moe")
    with torch.no_grad():  # nonzero biases, so the reference checks where they enter
        for p in (layer.router.gate.bias, layer.experts.b_in, layer.experts.b_out):
            if p is not None:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + 1))
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: scores, top-k, weights, each chosen expert's SwiGLU, plus the shared experts."""
    r, ex = layer.router, layer.experts
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        logits = r.gate(flat[t])
        scores = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
        chosen = (scores + r.expert_bias).topk(r.top_k).indices
        w = scores[chosen]
        if r.norm_topk:
            w = w / w.sum()
        for e, we in zip(chosen.tolist(), (w * r.route_scale).tolist()):
            h = flat[t] @ ex.w_in[e].T + (ex.b_in[e] if ex.b_in is not None else 0)
            y = swiglu(h, ex.limit, ex.alpha) @ ex.w_out[e].T + (ex.b_out[e] if ex.b_out is not None else 0)
            out[t] += we * y
        if layer.shared is not None:
            out[t] += layer.shared(flat[t])
    return out.view(x.shape)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(score_func="sigmoid", route_scale=2.5, n_shared=1),
        dict(norm_topk=False, top_k=3),
        dict(arch="gpt3", router_bias=True, swiglu_limit=0.5),  # biased experts (as GPT-OSS), clamped SwiGLU
    ],
)
def test_matches_a_per_token_reference(kw):
    torch.manual_seed(0)
    layer = _moe(**kw)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference(layer, x), atol=1e-5)


def test_grouped_mm_path_matches_the_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    layer = _moe(arch="gpt3", router_bias=True, swiglu_limit=0.5, n_experts=6, top_k=3)
    x = torch.randn(3, 7, 16, requires_grad=True)
    outs, grads = [], []
    for grouped in (False, True):
        layer.experts.use_grouped_mm = grouped
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in layer.experts.parameters()])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_gradients_reach_the_router_and_every_used_expert():
    layer = _moe(n_shared=1, aux_loss_coef=0.01)
    x = torch.randn(4, 8, 16)
    (layer(x).pow(2).sum() + layer.aux_loss).backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0
    used = layer.tokens_per_expert > 0
    per_expert = layer.experts.w_in.grad.abs().sum(dim=(1, 2))
    assert (per_expert[used] > 0).all() and (per_expert[~used] == 0).all()
    assert layer.shared.fc.weight.grad.abs().sum() > 0


def test_all_tokens_forced_to_one_expert_and_empty_experts():
    layer = _moe(top_k=1, norm_topk=False)
    with torch.no_grad():
        layer.router.expert_bias[5] = 100.0  # selection bias wins for every token; weights stay unbiased
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out = layer(x)
    counts = layer.tokens_per_expert
    assert counts[5] == 12 and counts.sum() == 12  # the seven other experts are empty
    assert torch.allclose(out, _reference(layer, x), atol=1e-5)


def test_group_limited_routing_picks_only_from_allowed_groups():
    layer = _moe(n_experts=8, top_k=2, n_groups=4, topk_groups=1, score_func="sigmoid")
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        # Group 2 (experts 4, 5) has the best pair sum (0.6 + 0.6); expert 0 alone scores highest.
        layer.router.expert_bias.copy_(torch.tensor([0.9, 0.0, 0.0, 0.0, 0.6, 0.6, 0.0, 0.0]))
        _, experts, _ = layer.router(torch.randn(5, 16))
    assert sorted(set(experts.flatten().tolist())) == [4, 5]
    layer.router.n_groups = 1  # plain top-k takes expert 0
    with torch.no_grad():
        _, experts, _ = layer.router(torch.randn(5, 16))
    assert (experts == 0).any(dim=1).all()


def test_aux_loss_on_a_hand_computed_case():
    layer = _moe(n_experts=2, top_k=1, aux_loss_coef=0.5)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0, 0] = 1.0  # logit of expert 0 = x[0]; expert 1's is 0
    x = torch.zeros(4, 16)
    x[:, 0] = torch.tensor([math.log(3.0), math.log(3.0), math.log(3.0), -math.log(3.0)])
    layer(x)
    # p0 = 3/4 for three tokens (they pick expert 0), 1/4 for the last (picks 1): f = (3/4, 1/4),
    # P = ((3 * 3/4 + 1/4) / 4, (3 * 1/4 + 3/4) / 4) = (5/8, 3/8); loss = 2 * (3/4 * 5/8 + 1/4 * 3/8) = 9/8.
    assert layer.tokens_per_expert.tolist() == [3, 1]
    assert torch.isclose(layer.aux_loss, torch.tensor(0.5 * 9 / 8))
    assert torch.isclose(moe_aux_loss(torch.nn.Sequential(layer, torch.nn.ReLU())), torch.tensor(0.5 * 9 / 8))


def test_bias_update_moves_toward_balance():
    layer = _moe(bias_update_rate=0.1)
    with torch.no_grad():
        layer.router.expert_bias[3] = 100.0
        layer(torch.randn(2, 4, 16))
        layer(torch.randn(2, 4, 16))  # counts accumulate over micro-batches until the update
    counts = layer._pending_counts.clone()
    update_biases(torch.nn.Sequential(layer))
    bias = layer.router.expert_bias
    assert counts[3] == 16 and bias[3] == pytest.approx(100.0 - 0.1)  # over-loaded: down
    assert all(bias[e] == pytest.approx(0.1) for e in range(8) if counts[e] < counts.float().mean())  # under: up
    assert layer._pending_counts is None
    with torch.no_grad():
        layer.eval()(torch.randn(2, 4, 16))  # evaluation forwards do not count toward balancing
    assert layer._pending_counts is None
    layer.update_bias(torch.full((8,), 5))  # balanced global counts (as data parallelism passes them): no move
    assert bias[3] == pytest.approx(100.0 - 0.1)
    off = _moe()
    off.router.expert_bias[3] = 1.0
    off(torch.randn(1, 4, 16))
    off.update_bias()  # bias_update_rate 0: never moves
    assert off.router.expert_bias[3] == 1.0


def test_capacity_drops_the_latest_tokens_of_an_overloaded_expert():
    layer = _moe(capacity_factor=1.0, top_k=1, n_experts=4)
    with torch.no_grad():
        layer.router.expert_bias[2] = 100.0  # all 8 tokens choose expert 2; capacity = ceil(8 * 1 / 4) = 2
    assert layer.capacity(8) == 2
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        out = layer(x)
        full = _reference(layer, x)
    assert layer.tokens_per_expert[2] == 8 and layer.dropped == 6
    assert torch.allclose(out[0, :2], full[0, :2], atol=1e-6)  # the first two tokens (in token order) are kept
    assert (out[0, 2:] == 0).all()  # the rest lose their routed output
    layer.capacity_factor = 0.0  # no capacity: nothing dropped
    with torch.no_grad():
        assert torch.allclose(layer(x), full, atol=1e-5) and layer.dropped == 0


def test_swiglu_variants():
    h = torch.randn(3, 8)
    gate, up = h[:, 0::2], h[:, 1::2]
    assert torch.allclose(swiglu(h), F.silu(gate) * up)
    g = gate.clamp(max=0.5)
    assert torch.allclose(swiglu(h, 0.5, 1.702), (up.clamp(-0.5, 0.5) + 1) * g * torch.sigmoid(1.702 * g))
