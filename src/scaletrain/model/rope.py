"""Rotary positions (RoPE) as Hugging Face computes them: frequencies with Llama 3.1's and YaRN's scalings, the
rotate_half rotation, and cos/sin tables of global token positions.

Shared by the grouped-query attention of model/common.py (Llama, Qwen3, GPT-OSS) and by latent attention
(model/mla.py, which rotates adjacent pairs instead of halves but uses the same frequencies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scaletrain.config import ModelConfig

__all__ = ["ROPE_THETA", "Rope", "rotate_half", "rope_cos_sin"]

ROPE_THETA = 10000.0
"""Llama 2's rotary base (and HF's default); Llama 3.1's is 500,000 (scaletrain.architectures)."""


@dataclass(frozen=True)
class Rope:
    """Rotary frequencies of a model config: base, and the "llama3" scaling's parameters when `scaling` is set."""

    theta: float
    scaling: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_seq_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @classmethod
    def of(cls, cfg: ModelConfig) -> Rope:
        """The resolved rotary settings of `cfg` (architecture defaults filled in)."""
        return cls(
            cfg.rope_base,
            cfg.rope_kind,
            cfg.rope_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_seq_len,
            cfg.rope_beta_fast,
            cfg.rope_beta_slow,
            cfg.rope_yarn_truncate,
        )

    @property
    def attention_factor(self) -> float:
        """Scale on cos and sin: YaRN's 0.1 ln(factor) + 1 (HF's default attention_factor), else 1."""
        if self.scaling != "yarn" or self.factor <= 1:
            return 1.0
        return 0.1 * math.log(self.factor) + 1.0

    def inv_freq(self, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
        """fp32 inverse frequencies [head_dim/2], in the order of operations of HF's rope init functions.

        llama3: a wavelength 2*pi/f above original/low_freq_factor is stretched `factor` times, one below
        original/high_freq_factor is kept, and the band between blends the two linearly in original/wavelength.
        """
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        if self.scaling == "yarn":
            return self._yarn(inv_freq, head_dim)
        if self.scaling != "llama3":
            return inv_freq
        low_wavelen = self.original_seq_len / self.low_freq_factor
        high_wavelen = self.original_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        stretched = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * stretched / self.factor + smooth * stretched
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, stretched)

    def _yarn(self, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
        """YaRN (Peng et al. 2023) as HF's _compute_yarn_parameters: dimension pairs rotating more than beta_fast
        times over the original context keep their frequency, fewer than beta_slow are divided by `factor`, and
        a linear ramp in the pair index blends the two between."""

        def dim_of(rotations: float) -> float:
            return head_dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = (1 - ramp).to(inv_freq.device)
        return inv_freq / self.factor * (1 - keep) + inv_freq * keep


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF Llama's rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, dtype: torch.dtype, rope: Rope | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] of `positions`, computed in fp32 exactly as HF's LlamaRotaryEmbedding.

    Computed per call rather than cached in a buffer: buffers built on the meta device would come out of
    `to_empty` uninitialised, and the cost (seq x head_dim/2 products) is negligible next to the GEMMs. `rope`
    defaults to Llama 2's (base 10,000, no scaling).
    """
    inv_freq = (rope or Rope(ROPE_THETA)).inv_freq(head_dim, positions.device)
    with torch.autocast(device_type=positions.device.type, enabled=False):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if rope is None or rope.attention_factor == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        scale = rope.attention_factor
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
