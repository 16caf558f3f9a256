"""The MLPerf gpt3 decoder (= Hugging Face GPT-2 architecture at any size), single-device and plain.

The shared decoder of model/common.py as gpt3's facts configure it: learned absolute positions (`embed.pos`),
pre-LayerNorm (eps from config) plus a final LayerNorm, multi-head attention (every head its own key/value group,
so `attn.qkv` rows are Megatron's (head, q|k|v, head_dim)), biases on every linear except the output layer, which
is tied to the token embedding, no dropout, N(0, init_std) init, vocabulary padded for fast GEMMs. Its own part is
the MLP: two biased linears around tanh GELU. Parallelism is applied from outside (`scaletrain.parallel`) through
model/common.py's seams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.common import Decoder

__all__ = ["GPT", "MLP"]


class MLP(nn.Module):
    """Two biased linears around tanh-approximated GELU (GPT-2's `gelu_new`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_size, bias=True)
        self.proj = nn.Linear(cfg.ffn_size, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPT(Decoder):
    """GPT-3-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary.

    A pipeline stage is a GPT with `embed` None and/or `ln_f` and `head` None (model.common.Decoder). The output
    layer is tied to the token embedding; on a last stage that does not hold the embedding, `head.weight` is a
    copy kept equal by the trainer.
    """

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """GPT's GELU MLP in every block."""
        return MLP(cfg)
