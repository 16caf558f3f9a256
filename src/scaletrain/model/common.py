"""The decoder parts every architecture shares: attention cores, grouped-query attention, dense MLPs, the pre-norm
block, the token embedding and the decoder around them.

An architecture is a `Decoder` subclass that picks, per layer, its attention (`Decoder.attention`) and its MLP
(`Decoder.mlp`); everything else follows from its facts in scaletrain/architectures.py:

* norms: LayerNorm (`norm_weights` 2) or RMSNorm, eps model.ln_eps, before attention and MLP and after the last
  block (`Block`, `Decoder.ln_f`);
* positions: a learned position table (`learned_positions`, GPT) or rotary positions applied in attention;
* attention (`Attention`): fused `qkv` with grouped key/value heads, biases (`biases`), per-head RMSNorm on queries
  and keys before rotary (`qk_norm`, Qwen3), attention sinks and a sliding window (model.attn_sinks,
  model.sliding_window: GPT-OSS);
* the output layer: tied to the token embedding (`tied_head`) or its own matrix.

What is not shared stays with its architecture: GPT's GELU MLP (model/gpt.py), latent attention (model/mla.py),
the Mixture-of-Experts layer (model/moe.py) and GPT-OSS's choice between it and a clamped SwiGLU.

Seams `scaletrain.parallel` relies on, under the same names for every architecture: `embed.tok` (and `embed.pos`),
`blocks.<i>.{ln1, attn.qkv, attn.proj, attn.core, attn.sinks, ln2, mlp.fc, mlp.proj}`, `ln_f`, `head`; heads are
counted from the local qkv width; `blocks` is a ModuleDict keyed by index so a pipeline stage (this class with
`embed` and/or `ln_f` + `head` set to None and some blocks removed) keeps its parameter names.

`attn.qkv` rows are (kv_group, [q_0 .. q_{r-1}, k, v], head_dim) with r = n_heads / n_kv_heads: group g holds its
r query heads (HF query heads g*r .. g*r+r-1), then HF key head g, then value head g, so a contiguous 1/tp row
shard (column-parallel linear) holds whole key/value groups. With r = 1 this is Megatron's (head, q|k|v, head_dim).
`mlp.fc` of a SwiGLU interleaves its rows (row 2i gate i, row 2i+1 up i), so any tp dividing d_ff keeps a gate row
with its up row. checkpoint/hf/ converts both to and from Hugging Face's separate projections.

Rotary positions are global token positions: from `forward(..., positions=)` when given, else from the attention
core when it shards the sequence (context parallelism's core has a `positions(s, device)` method), else arange(s).
Resolving them inside attention lets a pipeline stage fed only hidden states rotate with the right positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain import architectures
from scaletrain.architectures import Architecture
from scaletrain.config import ModelConfig
from scaletrain.model.init import normal_
from scaletrain.model.rope import Rope, rope_cos_sin, rotate_half

__all__ = [
    "causal_attention",
    "sink_attention",
    "is_sliding",
    "token_positions",
    "Attention",
    "swiglu",
    "SwiGLU",
    "Block",
    "Embeddings",
    "Decoder",
]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over [batch, heads, seq, head_dim] (flash/efficient kernels where available)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention over [batch, heads, seq, head_dim] with an optional sliding window (key j is visible from
    query i when i - window < j <= i) and optional per-head sink logits [heads]; HF GPT-OSS's eager attention.

    A sink joins each softmax row as an extra column that is dropped after the softmax, so a head can put weight
    on nothing."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    i = torch.arange(s, device=q.device)
    visible = i[None, :] <= i[:, None]
    if window > 0:
        visible = visible & (i[None, :] > i[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        scores = torch.cat([scores, sink], dim=-1)
    # Subtracting the row max before the softmax keeps bf16 from overflowing (HF does the same).
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def is_sliding(cfg: ModelConfig, layer: int) -> bool:
    """Whether block `layer` uses the sliding window (model.sliding_window_pattern: the last of every run of that
    many layers has full attention; GPT-OSS's 2 makes even layers sliding)."""
    p = cfg.sliding_window_pattern
    return cfg.sliding_window > 0 and (p == 0 or (layer + 1) % p != 0)


def token_positions(core: Callable, s: int, device: torch.device) -> torch.Tensor:
    """Global positions [s] of this rank's tokens: the sequence-sharding core's (context parallelism), else 0..s-1."""
    core_positions = getattr(core, "positions", None)
    return core_positions(s, device) if core_positions else torch.arange(s, device=device)


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads, shaped by the architecture's facts and the model config:
    rotary positions unless positions are learned, biases, QK-norm, attention sinks and a sliding window.

    Key/value heads are repeated to one per query head before the core (HF's repeat_kv order), so every core, the
    context-parallel one included, sees plain multi-head attention. `core` is SDPA's causal attention, swappable
    by context parallelism; a layer with sinks or a window computes its softmax explicitly (`sink_attention`, as
    HF's eager path does), which a swapped core cannot replace.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        facts = architectures.get(cfg.arch)
        self.head_dim = hd = cfg.head_size
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per key/value head
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * hd, bias=facts.biases)
        self.proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=facts.biases)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attn_sinks else None
        # Qwen3's QK-norm: one RMSNorm over each head's features, shared by all heads, before rotary positions.
        self.q_norm: nn.RMSNorm | None = nn.RMSNorm(hd, eps=cfg.ln_eps) if facts.qk_norm else None
        self.k_norm: nn.RMSNorm | None = nn.RMSNorm(hd, eps=cfg.ln_eps) if facts.qk_norm else None
        self.window = cfg.sliding_window if is_sliding(cfg, layer) else 0
        self.core: Callable = causal_attention  # context parallelism swaps in a sequence-sharded implementation
        self.rope: Rope | None = None if facts.learned_positions else Rope.of(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        r, hd = self.n_rep, self.head_dim
        # Groups count from the local width, so a tensor-parallel shard of qkv (fewer groups) works unchanged.
        y = self.qkv(x).view(b, s, -1, r + 2, hd)
        g = y.shape[2]
        q = y[:, :, :, :r].reshape(b, s, g * r, hd).transpose(1, 2)  # head g*r+j: HF's query head order
        k, v = y[:, :, :, r].transpose(1, 2), y[:, :, :, r + 1].transpose(1, 2)  # [b, g, s, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if positions is None:
                positions = token_positions(self.core, s, x.device)
            cos, sin = rope_cos_sin(positions, hd, q.dtype, self.rope)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if r > 1:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        out = self.attend(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[batch, heads, seq, head_dim] outputs: the core, or the explicit softmax with sinks and/or window."""
        if self.sinks is None and not self.window:
            return self.core(q, k, v)
        if self.core is not causal_attention:  # a swapped core (context parallelism) would be bypassed
            raise NotImplementedError("a replaced attention core with attention sinks or a sliding window")
        sinks = self.sinks
        if sinks is not None and hasattr(sinks, "to_local"):  # tensor parallel: this rank's heads' sinks
            sinks = sinks.to_local()
        return sink_attention(q, k, v, self.window, sinks)


def swiglu(h: torch.Tensor, limit: float = 0.0, alpha: float = 1.702) -> torch.Tensor:
    """SwiGLU of interleaved gate/up columns `h` [..., 2f] -> [..., f]: silu(gate) * up, or GPT-OSS's clamped
    variant when `limit` > 0: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""
    gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
    if limit <= 0:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP: `fc` (gate and up rows interleaved, module docstring) and `proj`."""

    def __init__(self, d_model: int, width: int, bias: bool = False, limit: float = 0.0, alpha: float = 1.702):
        super().__init__()
        self.fc = nn.Linear(d_model, 2 * width, bias=bias)
        self.proj = nn.Linear(width, d_model, bias=bias)
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(swiglu(self.fc(x), self.limit, self.alpha))


def norm(cfg: ModelConfig) -> nn.Module:
    """The architecture's norm over d_model: LayerNorm (weight and bias) or RMSNorm (weight only), eps model.ln_eps."""
    if architectures.get(cfg.arch).norm_weights == 2:
        return nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
    return nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)); `attn` takes optional global positions."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = attn
        self.ln2 = norm(cfg)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if positions is None else self.attn(self.ln1(x), positions=positions))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token embedding `tok`, plus a learned position embedding `pos` when the architecture has one (GPT)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        learned = architectures.get(cfg.arch).learned_positions
        self.pos: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model) if learned else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [batch, seq, d]; `positions` (global, [seq]) index the learned table when there is one."""
        s = tokens.shape[1]
        if positions is None and s > self.seq_len:
            raise ValueError(f"sequence of {s} tokens exceeds model.seq_len={self.seq_len}")
        x = self.tok(tokens)
        if self.pos is None:
            return x
        if positions is None:
            positions = torch.arange(s, device=tokens.device)
        return x + self.pos(positions)


class Decoder(nn.Module):
    """`embed` -> `blocks` -> `ln_f` -> `head`, built from the architecture's facts and its `attention`/`mlp` choices.

    `forward(tokens)` returns logits over the padded vocabulary. A pipeline stage is the same class with `embed`
    None (input is hidden states) and/or `ln_f` and `head` None (output is hidden states). With a tied head the
    output layer shares the embedding matrix; on a last stage that does not hold the embedding, `head.weight` is a
    copy the trainer keeps equal.
    """

    embed: Embeddings | None
    blocks: nn.ModuleDict
    ln_f: nn.Module | None
    head: nn.Linear | None

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)
        # ModuleDict keyed by index (not ModuleList) so pipeline stages can drop blocks and keep FQNs stable.
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, self.attention(cfg, i), self.mlp(cfg, i)) for i in range(cfg.n_layers)}
        )
        self.ln_f = norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.tie_weights()
        self.init_weights(seed)

    @property
    def facts(self) -> Architecture:
        """The architecture's structural facts (scaletrain.architectures)."""
        return architectures.get(self.cfg.arch)

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Block `layer`'s attention (the seam an architecture overrides): grouped-query `Attention` by default."""
        return Attention(cfg, layer)

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Block `layer`'s MLP (the seam an architecture overrides): a SwiGLU of model.d_ff by default."""
        return SwiGLU(cfg.d_model, cfg.ffn_size, bias=architectures.get(cfg.arch).biases)

    @property
    def tied_embeddings(self) -> bool:
        """Read by pipeline.TiedEmbeddingSync: whether first and last stage share a gradient (tied head)."""
        return self.facts.tied_head

    def tie_weights(self) -> None:
        """Point a tied output layer at the embedding matrix again (`to_empty` from meta replaces each separately);
        a no-op for an untied one."""
        if self.facts.tied_head and self.embed is not None and self.head is not None and not self.head_is_tied:
            self.head.weight = self.embed.tok.weight

    @property
    def head_is_tied(self) -> bool:
        """True when the output layer shares the embedding Parameter (a tied head, except on a pipeline's last
        stage without the embedding)."""
        return self.embed is not None and self.head is not None and self.head.weight is self.embed.tok.weight

    def plain_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) pairs under the plain model's names: activation-checkpoint and compile wrappers must not
        change a parameter's init stream (scaletrain.model.init draws from the name)."""
        for name, module in self.named_modules():
            yield name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), module

    def init_weights(self, seed: int = 0) -> None:
        """Every matrix, embedding and sink N(0, init_std), biases 0, norms weight 1 (and bias 0); a module with its
        own `init_weights(std, seed, prefix)` (the MoE layer) initialises its parameters itself.

        Values depend only on (seed, parameter name, element index), never on sharding or on which pipeline stage
        holds a parameter (scaletrain.model.init), so every parallel layout starts from the same weights. Called
        again after building on the meta device and materialising, so it touches every parameter and buffer.
        The small std also keeps CPU training clear of denormal gradients.
        """
        std = self.cfg.init_std
        own: list[str] = []  # prefixes of modules that initialised themselves
        for name, module in self.plain_modules():
            if any(name.startswith(p) for p in own):
                continue
            if module is not self and callable(getattr(module, "init_weights", None)):
                module.init_weights(std, seed, name)  # type: ignore[operator]
                own.append(name + ".")
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                bias = getattr(module, "bias", None)  # LayerNorm's; RMSNorm has none
                if bias is not None:
                    nn.init.zeros_(bias)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head and self.facts.tied_head:
                    if self.head_is_tied:
                        continue
                    name = "embed.tok"  # an untied stage copy starts equal to the embedding it mirrors
                normal_(module.weight, std, seed, f"{name}.weight")
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Attention) and module.sinks is not None:
                normal_(module.sinks, std, seed, f"{name}.sinks")

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, padded_vocab] (or hidden states from/to a pipeline stage without embed/head).

        `positions` (global token positions [seq]) default to what each attention core reports, else arange.
        """
        x = self.embed(tokens, positions) if self.embed is not None else tokens
        for block in self.blocks.values():
            x = block(x) if positions is None else block(x, positions=positions)
        if self.head is None:
            return x
        assert self.ln_f is not None  # a pipeline cut drops ln_f and head together
        return self.head(self.ln_f(x))
