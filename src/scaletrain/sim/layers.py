"""The per-layer inventory: every GEMM and attention op of a decoder, from which parameters, model FLOPs, GEMM
shapes (hence time) and activation memory all derive (Calculon's `llm/layers.py` Layer list is the model).

One transformer layer is a fixed list of `Gemm`s (QKV, attention output, fc1, fc2, then the LoRA adapters' A and
B of each targeted projection) around one `Attention` op, plus the `Saved` tensors that are not GEMM inputs
(norm inputs, Q/K/V, the attention output, the MLP activation's input). Outside the layers: the token (and for
GPT-3 position) embedding, the final norm and the output layer (`logits`, tied to the embedding for GPT-3).

Counting conventions, shared with the trainer's MFU (`scaletrain.model.flops`, tied to this file by a test):
2 FLOPs per multiply-add, forward + backward = 3x forward for trained weights, 2x for frozen ones (input gradient
only), full s^2 attention (no causal halving), no recomputation. Parameters count biases and norms so the total
equals the real torch modules' count; the GEMM matrices alone are what the time and memory models shard.
Torch-free; built from shape numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from scaletrain import architectures
from scaletrain.architectures import Architecture

LORA_DROPOUT_BYTES = 3
"""Per element of an adapted projection's input: the adapter's dropout output (bf16) and its 1-byte mask (MLPerf's
LoRA rules fix adapter dropout at 0.1, so it is always on)."""


@dataclass(frozen=True)
class ModelShape:
    """What the inventory needs to know about a model: its widths and how it is trained (LoRA)."""

    arch: str
    """model.arch; its structure (gated MLP, biases, norms, tied head) comes from scaletrain/architectures.py."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    """Padded vocabulary rows."""
    positions: int = 0
    """Learned position rows (GPT-3: the model's seq_len); 0 for rotary positions."""
    lora_rank: int = 0
    lora_targets: tuple = ("qkv", "proj")

    @property
    def facts(self) -> Architecture:
        """The architecture's structure (scaletrain/architectures.py)."""
        return architectures.get(self.arch)

    @property
    def gated(self) -> bool:
        """SwiGLU: fc1 computes gate and up (2·ffn wide), three matrices in all."""
        return self.facts.gated_mlp

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden // self.heads


@dataclass(frozen=True)
class Gemm:
    """One weight matmul y[M, N] = x[M, K] · W[K, N] of a layer, M being tokens; N and K are unsplit widths."""

    name: str
    n: int
    k: int
    tp: str
    """How tensor parallelism splits it: "col" (N split; input replicated), "row" (K split), "none"."""
    trainable: bool
    """Weight gradient computed (3x forward FLOPs) or frozen (2x: input gradient only)."""
    fp8: bool = False
    """Runs in FP8 when the layout asks for FP8 (transformer-layer base GEMMs, not adapters or the output layer)."""
    bias: bool = False
    shares_input: bool = False
    """Its 16-bit input is a tensor another op keeps anyway (the attention output), so only an FP8 copy is extra."""
    adapter_of: str = ""
    """For a LoRA A/B: the projection it adapts; an A keeps its dropout output for backward."""

    @property
    def params(self) -> int:
        """Weights plus bias."""
        return self.n * self.k + (self.n if self.bias else 0)

    def forward_flops(self) -> float:
        """Forward FLOPs per token."""
        return 2.0 * self.n * self.k

    def local_params(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds: a column split shares out N and its bias, a row split K
        (its bias stays whole); "none" is replicated."""
        n = self.n // tp if self.tp == "col" else self.n
        k = self.k // tp if self.tp == "row" else self.k
        return n * k + (n if self.bias else 0)

    def mnk(self, tokens: int, tp: int) -> tuple[int, int, int]:
        """(M, N, K) on one GPU for `tokens` rows under tensor-parallel degree `tp`."""
        n = self.n // tp if self.tp == "col" else self.n
        k = self.k // tp if self.tp == "row" else self.k
        return tokens, n, k

    def saved_bytes(self, fp8: bool) -> tuple[str, float]:
        """(group, bytes per token) of its input kept for the weight gradient; group "rep" is what TP leaves whole
        (only sequence parallelism splits it), "shard" what TP splits."""
        group = "shard" if self.tp == "row" else "rep"
        if self.adapter_of:
            # Adapter A keeps its (dropped-out) input; B's input is rank-wide, negligible.
            return group, (LORA_DROPOUT_BYTES * self.k if self.name.endswith(".a") else 0.0)
        if not self.trainable:
            return group, 0.0  # a frozen GEMM computes only dY·W^T: it keeps no input
        use_fp8 = fp8 and self.fp8
        if self.shares_input:
            return group, float(self.k if use_fp8 else 0)
        return group, float(self.k * (1 if use_fp8 else 2))


@dataclass(frozen=True)
class Attention:
    """The attention core (QK^T, softmax, AV): FLOPs grow with the sequence, no weights."""

    heads: int
    kv_heads: int
    head_dim: int

    def forward_flops(self, seq: int) -> float:
        """Forward FLOPs per token: QK^T and AV are s·heads·head_dim multiply-adds each (full s^2, Megatron's count)."""
        return 2.0 * 2 * seq * self.heads * self.head_dim

    def saved_bytes(self, tp: int) -> float:
        """16-bit bytes per token flash attention keeps (Q, K, V and its output), before the split by `tp`; with tp
        above the key/value heads each rank keeps one replicated KV head. The s^2 scores are never stored."""
        hq = self.heads * self.head_dim
        kv = max(self.kv_heads, tp) * self.head_dim
        return float(2 * hq + 2 * 2 * kv + 2 * hq)


@dataclass(frozen=True)
class Saved:
    """A tensor outside GEMM inputs and attention kept for backward, per token (16-bit)."""

    name: str
    group: str
    """"rep" (hidden-wide, whole under TP unless SP) or "shard" (split by TP)."""
    bytes: float
    dropout: bool = False
    """A hidden dropout mask: only with dropout on (neither MLPerf model uses it)."""


class Inventory:
    """The ops of a model: `layer` (GEMMs of one transformer layer), `attention`, `saved`, and the outer ones."""

    def __init__(self, shape: ModelShape):
        self.shape = s = shape
        h, f, hd = s.hidden, s.ffn, s.head_dim
        qkv = (s.heads + 2 * s.kv_heads) * hd
        fc1 = f * (2 if s.gated else 1)
        bias, lora = s.facts.biases, s.lora_rank > 0
        base = (
            Gemm("qkv", qkv, h, "col", not lora, fp8=True, bias=bias),
            Gemm("proj", h, h, "row", not lora, fp8=True, bias=bias, shares_input=True),
            Gemm("fc1", fc1, h, "col", not lora, fp8=True, bias=bias),
            Gemm("fc2", h, f, "row", not lora, fp8=True, bias=bias),
        )
        adapters: list[Gemm] = []
        if lora:
            by_name = {g.name: g for g in base}
            for target in s.lora_targets:
                g, r = by_name[target], s.lora_rank
                # A (in -> r) splits like the base's input, B (r -> out) like its output.
                adapters.append(
                    Gemm(f"{target}.a", r, g.k, "row" if g.tp == "row" else "none", True, adapter_of=target)
                )
                adapters.append(
                    Gemm(f"{target}.b", g.n, r, "col" if g.tp == "col" else "none", True, adapter_of=target)
                )
        self.base: tuple[Gemm, ...] = base
        self.adapters: tuple[Gemm, ...] = tuple(adapters)
        self.layer: tuple[Gemm, ...] = base + self.adapters
        self.attention = Attention(s.heads, s.kv_heads, hd)
        self.saved = (
            Saved("norm1 input", "rep", 2 * h),
            Saved("norm2 input", "rep", 2 * h),
            Saved("hidden dropout masks", "rep", 2 * h, dropout=True),
            Saved("mlp activation input", "shard", 2 * fc1),
        )
        self.norm_params = s.facts.norm_weights * h  # per norm: LayerNorm weight + bias, RMSNorm weight
        self.logits = Gemm("logits", s.vocab, h, "col", not lora)

    @cached_property
    def layer_matrix_params(self) -> int:
        """Weight-matrix elements of one layer's base GEMMs (no biases, norms or adapters): what TP/FSDP shard."""
        return sum(g.n * g.k for g in self.base)

    @cached_property
    def layer_params(self) -> int:
        """All base parameters of one layer: matrices, biases and the two norms."""
        return sum(g.params for g in self.base) + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding plus learned positions."""
        return (self.shape.vocab + self.shape.positions) * self.shape.hidden

    @property
    def head_params(self) -> int:
        """Untied output layer weights (0 when tied to the embedding)."""
        return 0 if self.shape.facts.tied_head else self.logits.n * self.logits.k

    @cached_property
    def params(self) -> int:
        """Base-model parameters (tied head counted once, padded vocabulary rows included; no adapters)."""
        s = self.shape
        return s.layers * self.layer_params + self.norm_params + self.embedding_params + self.head_params

    @cached_property
    def adapter_params(self) -> int:
        """LoRA adapter parameters over all layers."""
        return self.shape.layers * sum(g.params for g in self.adapters)

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer state: the adapters under LoRA, else all."""
        return self.adapter_params if self.shape.lora_rank > 0 else self.params

    def rank_params(self, tp: int, layers: int, first: bool, last: bool) -> int:
        """Base parameters one tensor-parallel rank of a pipeline stage holds before any data-parallel sharding:
        `layers` layers, plus the vocabulary-parallel token embedding (and learned positions, whole) on the first
        stage, the final norm and the output layer on the last (GPT-3 ties it to the embedding, but a last stage
        without the embedding keeps its own copy). Norms are replicated over TP."""
        s = self.shape
        total = layers * (sum(g.local_params(tp) for g in self.base) + 2 * self.norm_params)
        if first:
            total += s.vocab // tp * s.hidden + s.positions * s.hidden
        if last:
            total += self.norm_params
            if not s.facts.tied_head or not first:
                total += self.logits.local_params(tp)
        return total

    def forward_flops(self, seq: int) -> dict[str, float]:
        """Forward model FLOPs per token by kind: "gemm" (base layer weights), "attn", "logits"."""
        n = self.shape.layers
        return {
            "gemm": n * sum(g.forward_flops() for g in self.base),
            "attn": n * self.attention.forward_flops(seq),
            "logits": self.logits.forward_flops(),
        }

    def flops_per_token(self, seq: int) -> float:
        """Training model FLOPs per token: 3x forward for trained GEMMs and attention, 2x for frozen GEMMs."""
        n = self.shape.layers
        gemms = [*((g, n) for g in self.layer), (self.logits, 1)]
        total = sum(count * g.forward_flops() * (3 if g.trainable else 2) for g, count in gemms)
        return total + 3 * n * self.attention.forward_flops(seq)

    def gemm_shapes(self, tokens: int, tp: int) -> list[tuple[int, int, int]]:
        """(M, N, K) of one layer's forward GEMMs for `tokens` rows on one GPU under TP degree `tp`."""
        return [g.mnk(tokens, tp) for g in self.layer]

    def saved_per_token(self, tp: int, fp8: bool, dropout: bool) -> tuple[float, float]:
        """Bytes per token one layer keeps for backward as (replicated, sharded): the first group is hidden-wide
        tensors TP leaves whole (only SP splits them), the second what TP splits by `tp` (not yet divided)."""
        rep, shard = 0.0, self.attention.saved_bytes(tp)
        for x in self.saved:
            if x.dropout and not dropout:
                continue
            if x.group == "rep":
                rep += x.bytes
            else:
                shard += x.bytes
        for g in self.layer:
            group, b = g.saved_bytes(fp8)
            if group == "rep":
                rep += b
            else:
                shard += b
        return rep, shard
