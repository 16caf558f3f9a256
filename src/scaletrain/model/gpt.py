"""The MLPerf gpt3 decoder (= Hugging Face GPT-2 architecture at any size), single-device and plain.

Learned absolute positions, pre-LayerNorm (eps from config) plus a final LayerNorm, tanh GELU, biases on every
linear except the tied output layer, no dropout, N(0, init_std) init, vocabulary padded for fast GEMMs.
Parallelism is applied to this module from outside (`scaletrain.parallel`); nothing here knows about devices or
ranks. The few seams it offers for that are plain: heads are counted from the local qkv width, attention goes
through a swappable `core`, positions can be passed in, and a pipeline stage is this class with the modules it
does not own set to None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.init import normal_


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over [batch, heads, seq, head_dim] (flash/efficient kernels where available)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal multi-head self-attention through `F.scaled_dot_product_attention` (flash/efficient kernels)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        # Output rows are ordered (head, q|k|v, head_dim), Megatron's layout: a row shard holds whole heads, so
        # tensor parallelism splits qkv with a plain column-parallel linear. (HF GPT-2's c_attn is (q|k|v, head).)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=True)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.core = causal_attention  # context parallelism swaps in a sequence-sharded implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads count from the local width, so a tensor-parallel shard of qkv (fewer heads) works unchanged.
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = self.core(q, k, v)
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


class Embeddings(nn.Module):
    """Token embedding plus learned absolute position embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        s = tokens.shape[1]
        if positions is None:
            if s > self.seq_len:
                raise ValueError(f"sequence of {s} tokens exceeds model.seq_len={self.seq_len}")
            positions = torch.arange(s, device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class GPT(nn.Module):
    """GPT-3-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary.

    A pipeline stage is a GPT with `embed` None (not the first stage: input is hidden states), and/or `ln_f` and
    `head` None (not the last stage: output is hidden states). The output layer is tied to the token embedding;
    on a last stage that does not hold the embedding, `head.weight` is a copy kept equal by the trainer.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        # ModuleDict keyed by index (not ModuleList) so pipeline stages can drop blocks and keep FQNs stable.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.head.weight = self.embed.tok.weight  # tied, no bias
        self.init_weights(seed)

    def tie_weights(self) -> None:
        """Point the output layer at the embedding matrix again (`to_empty` from meta replaces each separately)."""
        if self.embed is not None and self.head is not None and not self.head_is_tied:
            self.head.weight = self.embed.tok.weight

    @property
    def head_is_tied(self) -> bool:
        """True when the output layer shares the embedding Parameter (always, except on a pipeline's last stage)."""
        return self.embed is not None and self.head is not None and self.head.weight is self.embed.tok.weight

    def init_weights(self, seed: int = 0) -> None:
        """MLPerf gpt3 init: every weight and embedding N(0, init_std), biases 0, LayerNorm (1, 0).

        Values depend only on (seed, parameter name, element index), never on sharding or on which pipeline
        stage holds a parameter (scaletrain.model.init), so every parallel layout starts from the same weights.
        Called again after building on the meta device and materialising, so it must touch every parameter.
        The small std also keeps CPU training clear of denormal gradients (PyTorch's N(0, 1) embedding init
        tied to the head slows fp32 CPU training several-fold).
        """
        std = self.cfg.init_std
        for name, module in self.named_modules():
            # Names as in the plain model: checkpoint and compile wrappers must not change a parameter's stream.
            name = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head:
                    if self.head_is_tied:
                        continue
                    name = "embed.tok"  # an untied stage copy starts equal to the embedding it mirrors
                normal_(module.weight, std, seed, f"{name}.weight")
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, padded_vocab] (or hidden states from/to a pipeline stage without embed/head)."""
        x = self.embed(tokens, positions) if self.embed is not None else tokens
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x
        assert self.ln_f is not None  # a pipeline cut drops ln_f and head together
        return self.head(self.ln_f(x))
