"""Multi-head latent attention (scaletrain.model.mla): shapes, causality, and a from-the-paper reference computation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from scaletrain.config import MLAConfig, ModelConfig
from scaletrain.model.mla import MLA


def _cfg(q_lora_rank: int = 12) -> ModelConfig:
    mla = MLAConfig(kv_lora_rank=8, q_lora_rank=q_lora_rank, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
    return ModelConfig(arch="llama", d_model=32, n_heads=3, seq_len=16, mla=mla, rope_theta=100.0)


def _mla(q_lora_rank: int = 12, seed: int = 0) -> MLA:
    torch.manual_seed(seed)
    m = MLA(_cfg(q_lora_rank)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)  # large enough that rotary angles and the softmax matter
    return m


def _reference(m: MLA, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2 paper form, head by head: rotary keys as complex pairs (DeepSeek's view_as_complex), explicit
    causal softmax; shares no code with the module beyond its weights."""
    b, s, _ = x.shape
    nope, r, vd, h = m.nope, m.rope_dim, m.v_dim, 3
    if m.q_proj is not None:
        q = x @ m.q_proj.weight.T
    else:
        c = x @ m.q_a_proj.weight.T
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * m.q_a_layernorm.weight
        q = c @ m.q_b_proj.weight.T
    q = q.view(b, s, h, nope + r)
    kv_a = x @ m.kv_a_proj_with_mqa.weight.T
    lat, k_pe = kv_a[..., : m.kv_lora_rank], kv_a[..., m.kv_lora_rank :]
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * m.kv_a_layernorm.weight
    kv = (lat @ m.kv_b_proj.weight.T).view(b, s, h, nope + vd)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    rot = torch.polar(torch.ones(s, r // 2, dtype=torch.float64), torch.arange(s).double()[:, None] * inv_freq)

    def rotate(t: torch.Tensor) -> torch.Tensor:  # [b, s, ..., r] adjacent pairs as complex numbers
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], r // 2, 2).contiguous())
        shape = (1, s) + (1,) * (t.dim() - 3) + (r // 2,)
        return torch.view_as_real(z * rot.view(shape)).flatten(-2)

    q_full = torch.cat((q[..., :nope], rotate(q[..., nope:])), dim=-1)
    k_rope = rotate(k_pe)  # [b, s, r], one for all heads
    out = torch.empty(b, s, h, vd, dtype=x.dtype)
    for head in range(h):
        k_full = torch.cat((kv[:, :, head, :nope], k_rope), dim=-1)
        scores = q_full[:, :, head] @ k_full.transpose(1, 2) / math.sqrt(nope + r)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, head] = scores.softmax(-1) @ kv[:, :, head, nope:]
    return out.reshape(b, s, h * vd) @ m.proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [12, 0])
def test_mla_matches_the_paper_form(q_lora_rank):
    m = _mla(q_lora_rank)
    assert (m.q_proj is None) == bool(q_lora_rank)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    y = m(x)
    assert y.shape == (2, 7, 32)
    # Rotary angles are computed in fp32 (as HF does), hence 1e-6 rather than float64's precision.
    torch.testing.assert_close(y, _reference(m, x), rtol=1e-6, atol=1e-6)


def test_mla_shapes_follow_the_config():
    m = MLA(_cfg())
    assert m.q_a_proj.weight.shape == (12, 32) and m.q_b_proj.weight.shape == (3 * 10, 12)
    assert m.kv_a_proj_with_mqa.weight.shape == (8 + 4, 32)  # latent + one shared rotary key
    assert m.kv_b_proj.weight.shape == (3 * (6 + 5), 8)  # per head: nope key + value
    assert m.proj.weight.shape == (32, 3 * 5)
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_mla_is_causal_and_positions_matter():
    m = _mla()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    y = m(x)
    x2 = x.clone()
    x2[:, 5:] += 1.0  # change the future only
    y2 = m(x2)
    torch.testing.assert_close(y2[:, :5], y[:, :5], rtol=0, atol=0)
    assert not torch.allclose(y2[:, 5:], y[:, 5:])
    # Shifting every position by the same offset leaves relative positions, hence the output, unchanged.
    shifted = m(x, positions=torch.arange(9) + 3)
    torch.testing.assert_close(shifted, y, rtol=1e-6, atol=1e-6)
    # ...but positions do reach the scores: reversed positions change it.
    assert not torch.allclose(m(x, positions=torch.arange(9).flip(0)), y)


def test_mla_rejects_a_config_without_latent():
    with pytest.raises(ValueError, match="kv_lora_rank > 0"):
        MLA(ModelConfig(arch="llama", d_model=32, n_heads=4))
    with pytest.raises(ValueError, match="YaRN"):
        MLA(replace(_cfg(), rope_scaling="yarn", rope_factor=4.0))
