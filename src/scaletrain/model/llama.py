"""The Llama decoder (= Hugging Face `LlamaForCausalLM`), single-device and plain, with GPT's parallelism seams.

RMSNorm (eps from config) before attention and MLP plus a final one, rotary positions (HF convention: rotate_half,
base `cfg.rope_base`, optionally Llama 3.1's "llama3" frequency scaling), grouped-query attention, SwiGLU MLP, no
biases, untied output layer, N(0, init_std) init. Llama 2 and Llama 3.1 (model.arch "llama", "llama31") are this
one class; they differ only in the rotary frequencies.
It offers the seams `scaletrain.parallel` uses on GPT, under the same names, so tensor, pipeline, context and data
parallelism apply unchanged: `embed.tok`, `blocks.<i>.{ln1,attn.qkv,attn.proj,attn.core,ln2,mlp.fc,mlp.proj}`,
`ln_f`, `head`, heads counted from the local qkv width, and a pipeline stage is this class with modules set to None.

Two fused weights have row orders chosen so that a contiguous 1/tp row shard (column-parallel linear) stays whole:

* `attn.qkv` rows are (kv_group, [q_0 .. q_{r-1}, k, v], head_dim) with r = n_heads / n_kv_heads: group g holds
  its r query heads (HF q heads g*r .. g*r+r-1), then HF k head g, then v head g. A shard is whole KV groups
  (needs n_kv_heads % tp == 0). `checkpoint/hf/llama.py` converts to and from HF's q_proj/k_proj/v_proj.
* `mlp.fc` rows are (ffn_index, gate|up): row 2i is HF gate_proj row i, row 2i+1 is up_proj row i. Any tp that
  divides d_ff keeps each gate row with its up row, so SwiGLU needs no communication.

Rotary positions are global token positions. They come from `forward(..., positions=)` when given, else from the
attention core when it shards the sequence (context parallelism's core has a `positions(s, device)` method),
else arange(s). Resolving them inside attention means a pipeline stage without the embedding, fed only hidden
states, still rotates with the right positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.gpt import causal_attention
from scaletrain.model.init import normal_

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


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; K/V heads are repeated before the core."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per key/value head
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.core = causal_attention  # context parallelism swaps in a sequence-sharded implementation
        self.rope = Rope.of(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        r, hd = self.n_rep, self.head_dim
        # Groups count from the local width, so a tensor-parallel shard of qkv (fewer groups) works unchanged.
        y = self.qkv(x).view(b, s, -1, r + 2, hd)
        g = y.shape[2]
        q = y[:, :, :, :r].reshape(b, s, g * r, hd).transpose(1, 2)  # head g*r+j: HF's query head order
        k, v = y[:, :, :, r].transpose(1, 2), y[:, :, :, r + 1].transpose(1, 2)  # [b, g, s, hd]
        if positions is None:
            core_positions = getattr(self.core, "positions", None)
            positions = core_positions(s, x.device) if core_positions else torch.arange(s, device=x.device)
        cos, sin = rope_cos_sin(positions, hd, q.dtype, self.rope)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if r > 1:
            # Repeat K/V to one per query head (HF's repeat_kv order): every core, the context-parallel one
            # included, then sees plain multi-head attention.
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        out = self.core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: proj(silu(gate(x)) * up(x)), gate and up fused into `fc` with interleaved rows (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.ffn_size, bias=False)
        self.proj = nn.Linear(cfg.ffn_size, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)), RMSNorms."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if positions is None else self.attn(self.ln1(x), positions=positions))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token embedding only (positions are rotary, applied in attention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.d_model)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [batch, seq, d]; `positions` is accepted for GPT's signature and unused here."""
        if positions is None and tokens.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds model.seq_len={self.seq_len}")
        return self.tok(tokens)


class UntiedDecoder(nn.Module):
    """What Llama, GPT-OSS and DeepSeek-V3 share: `embed` -> `blocks` -> `ln_f` -> `head`, an untied output layer,
    and pipeline stages as the same class with `embed` and/or `ln_f` + `head` set to None (subclasses build them)."""

    tied_embeddings = False  # read by pipeline.TiedEmbeddingSync: no gradient to share between first and last stage
    embed: Embeddings | None
    blocks: nn.ModuleDict
    ln_f: nn.RMSNorm | None
    head: nn.Linear | None

    def tie_weights(self) -> None:
        """No-op: the output layer is untied (kept so callers can treat every model alike)."""

    @property
    def head_is_tied(self) -> bool:
        """Always False: the output layer is its own matrix."""
        return False

    def plain_modules(self):
        """(name, module) pairs under the plain model's names: activation-checkpoint and compile wrappers must not
        change a parameter's init stream (scaletrain.model.init draws from the name)."""
        for name, module in self.named_modules():
            yield name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), module

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


class Llama(UntiedDecoder):
    """Llama-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary.

    A pipeline stage is a Llama with `embed` None (input is hidden states) and/or `ln_f` and `head` None (output
    is hidden states). The output layer is never tied to the embedding.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.n_heads % cfg.kv_heads or cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(
                f"llama needs n_kv_heads | n_heads | d_model and an even head_dim, got "
                f"d_model={cfg.d_model} n_heads={cfg.n_heads} n_kv_heads={cfg.kv_heads}"
            )
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        # ModuleDict keyed by index (not ModuleList) so pipeline stages can drop blocks and keep FQNs stable.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.init_weights(seed)

    def init_weights(self, seed: int = 0) -> None:
        """Every linear and embedding weight N(0, init_std), RMSNorm weights 1.

        Values depend only on (seed, parameter name, element index) (scaletrain.model.init), so every parallel
        layout starts from the same weights; must touch every parameter (called again after `to_empty`).
        """
        std = self.cfg.init_std
        for name, module in self.plain_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                normal_(module.weight, std, seed, f"{name}.weight")
