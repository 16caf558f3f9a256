"""The MLPerf gpt3 decoder (= Hugging Face GPT-2 architecture at any size), single-device and plain.

Learned absolute positions, pre-LayerNorm (eps from config) plus a final LayerNorm, tanh GELU, biases on every
linear except the tied output layer, no dropout, N(0, init_std) init, vocabulary padded for fast GEMMs.
Parallelism is applied to this module from outside (later issues); nothing here knows about devices or ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.data.samples import IGNORE_INDEX  # the label convention is the data's; the loss honours it


class Attention(nn.Module):
    """Causal multi-head self-attention through `F.scaled_dot_product_attention` (flash/efficient kernels)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads count from the local weight, so a tensor-parallel shard of qkv (fewer heads) works unchanged.
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """Two biased linears around tanh-approximated GELU (GPT-2's `gelu_new`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_size, bias=True)
        self.proj = nn.Linear(cfg.ffn_size, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-3-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        # ModuleDict keyed by index (not ModuleList) so pipeline stages can drop blocks and keep FQNs stable.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.init_weights()

    def init_weights(self) -> None:
        """MLPerf gpt3 init: every weight and embedding N(0, init_std), biases 0, LayerNorm (1, 0).

        Called again after building on the meta device and materialising, so it must touch every parameter.
        The small std also keeps CPU training clear of denormal gradients (PyTorch's N(0, 1) embedding init
        tied to the head slows fp32 CPU training several-fold).
        """
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence of {s} tokens exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(s, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks.values():
            x = block(x)
        # Tied output layer, no bias: logits share the input embedding matrix.
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy over unmasked labels (fp32), so callers can normalise by any token count."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
