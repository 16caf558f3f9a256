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
from typing import Any

from scaletrain import architectures
from scaletrain.architectures import LORA_TARGETS, Architecture

LORA_DROPOUT_BYTES = 3
"""Per element of an adapted projection's input: the adapter's dropout output (bf16) and its 1-byte mask (MLPerf's
LoRA rules fix adapter dropout at 0.1, so it is always on)."""


@dataclass(frozen=True)
class ModelShape:
    """What the inventory needs to know about a model: its widths and how it is trained (LoRA), in the notation of
    docs/perf-model.md (h, a, l, V). The simulator's one description of a model: a `Workload` holds one."""

    arch: str
    """model.arch; its structure (gated MLP, biases, norms, tied head) comes from scaletrain/architectures.py."""
    layers: int
    """l: transformer blocks."""
    hidden: int
    """h: model width."""
    heads: int
    """a: attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention); equals heads for GPT-3."""
    ffn: int
    """MLP inner width."""
    vocab: int
    """V: padded vocabulary rows."""
    positions: int = 0
    """Learned position rows (GPT-3: the model's seq_len); 0 for rotary positions."""
    lora_rank: int = 0
    """LoRA rank; 0 = full training."""
    lora_targets: tuple = ("qkv", "proj")
    """Projections with adapters (keys of architectures.LORA_TARGETS)."""
    head_size: int = 0
    """Per-head width; 0 = hidden / heads (GPT-OSS: 64 with hidden 2,880 and 64 heads)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 = every layer dense."""
    top_k: int = 0
    """Routed experts per token."""
    expert_ffn: int = 0
    """One expert's SwiGLU inner width (shared experts have the same)."""
    shared_experts: int = 0
    """Shared experts every token also passes through."""
    dense_layers: int = 0
    """Leading layers with a dense MLP of `ffn` (DeepSeek-V3: 3); the other layers are MoE when experts > 0."""
    router_bias: bool = False
    """The router has a bias per expert (GPT-OSS)."""
    q_rank: int = 0
    """MLA: query latent rank (0 = queries projected directly)."""
    kv_rank: int = 0
    """MLA: key/value latent rank; 0 = standard attention."""
    qk_nope: int = 0
    """MLA: per-head query/key width without rotary positions."""
    qk_rope: int = 0
    """MLA: per-head query/key width with rotary positions (the key part is shared by the heads)."""
    v_dim: int = 0
    """MLA: per-head value width."""
    window: int = 0
    """Sliding-window attention span in tokens (GPT-OSS: 128); 0 = every layer attends to the whole sequence."""
    window_layers: int = 0
    """Layers that use the sliding window (GPT-OSS: every other one, 12 of 24)."""
    sinks: bool = False
    """A learned attention-sink logit per head and layer (GPT-OSS)."""

    @property
    def moe(self) -> bool:
        """Some layers are Mixture-of-Experts."""
        return self.experts > 0

    @property
    def lora(self) -> bool:
        """Base frozen, LoRA adapters trained."""
        return self.lora_rank > 0

    @property
    def mla(self) -> bool:
        """Multi-head latent attention."""
        return self.kv_rank > 0

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
        return self.head_size or self.hidden // self.heads


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
    experts: int = 1
    """Weight copies: the routed experts of an MoE layer hold one [K, N] matrix each."""
    active: float = 1.0
    """Copies each token passes through: top-k for routed experts, else 1 (FLOPs count only these)."""

    @property
    def params(self) -> int:
        """Weights plus bias, every copy."""
        return self.experts * (self.n * self.k + (self.n if self.bias else 0))

    @property
    def active_params(self) -> int:
        """Weights plus bias one token uses."""
        return int(self.active * (self.n * self.k + (self.n if self.bias else 0)))

    def forward_flops(self) -> float:
        """Forward FLOPs per token (the copies it is routed to)."""
        return 2.0 * self.active * self.n * self.k

    def local_params(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds: a column split shares out N and its bias, a row split K
        (its bias stays whole); "none" is replicated."""
        n = self.n // tp if self.tp == "col" else self.n
        k = self.k // tp if self.tp == "row" else self.k
        return self.experts * (n * k + (n if self.bias else 0))

    def mnk(self, tokens: int, tp: int) -> tuple[int, int, int]:
        """(M, N, K) on one GPU for `tokens` rows under tensor-parallel degree `tp`; the routed experts' rows are the
        tokens times top-k (the whole grouped GEMM, whatever the experts' share of it)."""
        n = self.n // tp if self.tp == "col" else self.n
        k = self.k // tp if self.tp == "row" else self.k
        return int(tokens * self.active), n, k

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
            return group, float(self.active * self.k if use_fp8 else 0)
        return group, float(self.active * self.k * (1 if use_fp8 else 2))


@dataclass(frozen=True)
class Attention:
    """The attention core (QK^T, softmax, AV): FLOPs grow with the sequence, no weights."""

    heads: int
    kv_heads: int
    head_dim: int
    """Query/key width per head (MLA: the non-rotary plus the rotary part)."""
    v_dim: int = 0
    """Value (and output) width per head; 0 = head_dim."""

    @property
    def v_width(self) -> int:
        """Value width per head."""
        return self.v_dim or self.head_dim

    def forward_flops(self, seq: float) -> float:
        """Forward FLOPs per token: QK^T is s·heads·head_dim multiply-adds and AV s·heads·v_dim (full s^2, Megatron's
        count; a sliding-window layer passes its window as `seq`)."""
        return 2.0 * seq * self.heads * (self.head_dim + self.v_width)

    def saved_bytes(self, tp: int) -> float:
        """16-bit bytes per token flash attention keeps (Q, K, V and its output), before the split by `tp`; with tp
        above the key/value heads each rank keeps one replicated KV head. The s^2 scores are never stored."""
        kv = max(self.kv_heads, tp)
        return float(
            2 * self.heads * self.head_dim + 2 * kv * (self.head_dim + self.v_width) + 2 * self.heads * self.v_width
        )


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
        bias, lora = s.facts.biases, s.lora
        attn = self._attention_gemms(s, bias, not lora)
        dense_mlp = (
            Gemm("fc1", f * (2 if s.gated else 1), h, "col", not lora, fp8=True, bias=bias),
            Gemm("fc2", h, f, "row", not lora, fp8=True, bias=bias),
        )
        base = attn + (self._moe_gemms(s, bias) if s.moe else dense_mlp)
        adapters: list[Gemm] = []
        if lora:
            by_name = {g.name: g for g in base}
            for target in s.lora_targets:
                if target not in by_name or target not in LORA_TARGETS:
                    raise ValueError(
                        f"lora.targets: {target!r} adapts no projection of model.arch={s.arch!r} "
                        f"(its layers have {', '.join(by_name)})"
                    )
                # The adapted GEMM's own widths are the fans: A (in -> r) splits like its input, B (r -> out) like
                # its output, as architectures.LORA_TARGETS says tensor parallelism splits the projection.
                g, r, split = by_name[target], s.lora_rank, LORA_TARGETS[target].tp
                adapters.append(
                    Gemm(f"{target}.a", r, g.k, "row" if split == "row" else "none", True, adapter_of=target)
                )
                adapters.append(
                    Gemm(f"{target}.b", g.n, r, "col" if split == "col" else "none", True, adapter_of=target)
                )
        self.base: tuple[Gemm, ...] = base
        """The base GEMMs of the typical layer: the MoE layer of an MoE model, else the one dense layer."""
        self.dense_base: tuple[Gemm, ...] = attn + dense_mlp
        """The base GEMMs of a leading dense layer of an MoE model (`shape.dense_layers` of them)."""
        self.adapters: tuple[Gemm, ...] = tuple(adapters)
        self.layer: tuple[Gemm, ...] = base + self.adapters
        self.attention = Attention(
            s.heads, s.heads if s.mla else s.kv_heads, (s.qk_nope + s.qk_rope) if s.mla else hd, s.v_dim if s.mla else 0
        )
        mlp_in = sum(g.active * g.n for g in base if g.name.endswith("fc1"))
        self.saved = (
            Saved("norm1 input", "rep", 2 * h),
            Saved("norm2 input", "rep", 2 * h),
            Saved("hidden dropout masks", "rep", 2 * h, dropout=True),
            Saved("mlp activation input", "shard", 2 * mlp_in),
        )
        self.norm_params = s.facts.norm_weights * h  # per norm: LayerNorm weight + bias, RMSNorm weight
        # Per layer besides the two norms: MLA's latent norms (q only with a query latent), GPT-OSS's sink logits,
        # Qwen3's query and key norms (one head_dim weight each).
        self.extra_norm_params = (
            ((s.kv_rank + s.q_rank) if s.mla else 0) + (s.heads if s.sinks else 0) + (2 * hd if s.facts.qk_norm else 0)
        )
        self.logits = Gemm("logits", s.vocab, h, "col", not lora)

    @staticmethod
    def _attention_gemms(s: ModelShape, bias: bool, trained: bool) -> tuple[Gemm, ...]:
        """Query/key/value and output projections: fused QKV (grouped K/V), or MLA's latent down- and up-projections
        (Megatron's: the down-projections replicated over TP, the up-projections column-parallel)."""
        h, hd = s.hidden, s.head_dim
        if not s.mla:
            qkv = (s.heads + 2 * s.kv_heads) * hd
            return (
                Gemm("qkv", qkv, h, "col", trained, fp8=True, bias=bias),
                Gemm("proj", h, s.heads * hd, "row", trained, fp8=True, bias=bias, shares_input=True),
            )
        qk = s.qk_nope + s.qk_rope
        q = (
            (
                Gemm("q_down", s.q_rank, h, "none", trained, fp8=True),
                Gemm("q_up", s.heads * qk, s.q_rank, "col", trained, fp8=True),
            )
            if s.q_rank
            else (Gemm("q", s.heads * qk, h, "col", trained, fp8=True),)
        )
        return q + (
            Gemm("kv_down", s.kv_rank + s.qk_rope, h, "none", trained, fp8=True),
            Gemm("kv_up", s.heads * (s.qk_nope + s.v_dim), s.kv_rank, "col", trained, fp8=True),
            Gemm("proj", h, s.heads * s.v_dim, "row", trained, fp8=True, shares_input=True),
        )

    @staticmethod
    def _moe_gemms(s: ModelShape, bias: bool) -> tuple[Gemm, ...]:
        """Router, routed experts (every copy held, top-k used per token) and the shared experts (fused, always
        used). Expert weights are not split by TP here (expert parallelism shards whole experts)."""
        h, fe = s.hidden, s.expert_ffn or s.ffn
        out = [
            Gemm("router", s.experts, h, "none", True, bias=s.router_bias),
            Gemm("expert.fc1", 2 * fe, h, "none", True, fp8=True, bias=bias, experts=s.experts, active=s.top_k),
            Gemm("expert.fc2", h, fe, "none", True, fp8=True, bias=bias, experts=s.experts, active=s.top_k),
        ]
        if s.shared_experts:
            fs = fe * s.shared_experts
            out += [
                Gemm("shared.fc1", 2 * fs, h, "col", True, fp8=True),
                Gemm("shared.fc2", h, fs, "row", True, fp8=True),
            ]
        return tuple(out)

    def _kinds(self) -> list[tuple[int, tuple[Gemm, ...]]]:
        """(layers, base GEMMs) of each kind of layer: the leading dense ones of an MoE model, then the rest."""
        s = self.shape
        dense = min(s.dense_layers, s.layers) if s.moe else 0
        return [(n, g) for n, g in ((dense, self.dense_base), (s.layers - dense, self.base)) if n > 0]

    def attention_tokens(self, seq: int) -> float:
        """Keys each query attends to, averaged over the layers (sliding-window layers see at most the window)."""
        s = self.shape
        windowed = min(s.window_layers, s.layers) if s.window else 0
        return ((s.layers - windowed) * seq + windowed * min(seq, s.window)) / s.layers

    @cached_property
    def layer_matrix_params(self) -> int:
        """Weight-matrix elements of one layer's base GEMMs (no biases, norms or adapters): what TP/FSDP shard. For
        an MoE model with leading dense layers, the mean over the layers (the time and memory models treat the
        layers as equal)."""
        total = sum(n * sum(g.experts * g.n * g.k for g in gemms) for n, gemms in self._kinds())
        return round(total / self.shape.layers)

    @cached_property
    def layer_params(self) -> int:
        """All base parameters of one layer: matrices, biases, the two norms (and MLA's latent norms); the mean over
        the layers where they differ."""
        total = sum(n * sum(g.params for g in gemms) for n, gemms in self._kinds())
        return round(total / self.shape.layers) + 2 * self.norm_params + self.extra_norm_params

    @cached_property
    def active_params(self) -> int:
        """Parameters a token's FLOPs go through: the routed experts it is sent to (not all of them), the output
        layer, not the input embedding (a lookup). The convention of the published "active" counts: GPT-OSS 20B
        3.6B, DeepSeek-V3 37B. For a dense model: the parameters less the embedding."""
        s = self.shape
        layers = sum(n * sum(g.active_params for g in gemms) for n, gemms in self._kinds())
        norms = s.layers * (2 * self.norm_params + self.extra_norm_params) + self.norm_params
        head = self.logits.n * self.logits.k  # tied or not, the output GEMM runs
        return layers + norms + head

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
        layers = sum(n * sum(g.params for g in gemms) for n, gemms in self._kinds())
        norms = s.layers * (2 * self.norm_params + self.extra_norm_params) + self.norm_params
        return layers + norms + self.embedding_params + self.head_params

    @cached_property
    def adapter_params(self) -> int:
        """LoRA adapter parameters over all layers."""
        return self.shape.layers * sum(g.params for g in self.adapters)

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer state: the adapters under LoRA, else all."""
        return self.adapter_params if self.shape.lora else self.params

    def expert_rank_params(self, layers: int, ep: int = 1) -> int:
        """Routed-expert parameters one rank holds for `layers` layers when `ep` ranks share out the experts (whole
        experts each, not split by TP: Megatron's expert tensor parallelism of 1); the mean per layer where the leading
        layers are dense."""
        s = self.shape
        if not s.moe:
            return 0
        moe_share = (s.layers - min(s.dense_layers, s.layers)) / s.layers
        per_layer = sum(g.params for g in self.base if g.experts > 1) / max(ep, 1)
        return round(layers * moe_share * per_layer)

    def rank_params(self, tp: int, layers: int, first: bool, last: bool, ep: int = 1) -> int:
        """Base parameters one tensor-parallel rank of a pipeline stage holds before any data-parallel sharding:
        `layers` layers, plus the vocabulary-parallel token embedding (and learned positions, whole) on the first
        stage, the final norm and the output layer on the last (GPT-3 ties it to the embedding, but a last stage
        without the embedding keeps its own copy). Norms are replicated over TP. An MoE model's routed experts are
        shared out over `ep` ranks (`expert_rank_params`), its dense leading layers counted at their share."""
        s = self.shape
        if s.moe:
            dense = min(s.dense_layers, s.layers) / s.layers
            per = dense * sum(g.local_params(tp) for g in self.dense_base) + (1 - dense) * sum(
                g.local_params(tp) for g in self.base if g.experts == 1
            )
            total = round(layers * (per + 2 * self.norm_params + self.extra_norm_params))
            total += self.expert_rank_params(layers, ep)
        else:
            total = layers * (
                sum(g.local_params(tp) for g in self.base) + 2 * self.norm_params + self.extra_norm_params
            )
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
            "gemm": sum(count * sum(g.forward_flops() for g in gemms) for count, gemms in self._kinds()),
            "attn": n * self.attention.forward_flops(self.attention_tokens(seq)),
            "logits": self.logits.forward_flops(),
        }

    def flops_per_token(self, seq: int) -> float:
        """Training model FLOPs per token: 3x forward for trained GEMMs and attention, 2x for frozen GEMMs."""
        n = self.shape.layers
        gemms = [(g, count) for count, kind in self._kinds() for g in kind]
        gemms += [*((g, n) for g in self.adapters), (self.logits, 1)]
        total = sum(count * g.forward_flops() * (3 if g.trainable else 2) for g, count in gemms)
        return float(total) + 3 * n * self.attention.forward_flops(self.attention_tokens(seq))

    def gemm_shapes(self, tokens: int, tp: int) -> list[tuple[int, int, int]]:
        """(M, N, K) of one layer's forward GEMMs for `tokens` rows on one GPU under TP degree `tp`."""
        # The router and the routed experts see each tensor-parallel rank's own sequence shard (Megatron runs MoE
        # under sequence parallelism), the experts whole (expert tensor parallelism 1).
        return [g.mnk(tokens // tp if g.experts > 1 or g.name == "router" else tokens, tp) for g in self.layer]

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


def shape_of(m: Any, lora_rank: int = 0, lora_targets: tuple = ("qkv", "proj")) -> ModelShape:
    """The inventory's view of a model config `m` (a ModelConfig, duck-typed: sim imports no config types): widths,
    the MoE, MLA and sliding-window parts (zeros when off), and the LoRA rank and targets."""
    e, a = m.moe, m.mla
    extra: dict = {}
    if e.n_experts > 0:
        extra.update(
            experts=e.n_experts,
            top_k=e.top_k,
            expert_ffn=e.d_ff_expert or m.ffn_size,
            shared_experts=e.n_shared,
            dense_layers=e.first_dense,
            router_bias=e.router_bias,
        )
    if a.kv_lora_rank > 0:
        extra.update(
            q_rank=a.q_lora_rank,
            kv_rank=a.kv_lora_rank,
            qk_nope=a.qk_nope_head_dim,
            qk_rope=a.qk_rope_head_dim,
            v_dim=a.v_head_dim,
        )
    window = int(getattr(m, "sliding_window", 0) or 0)
    if window > 0:
        # model.sliding_window_pattern p: the last of every p layers attends to everything (0: none does).
        p = int(getattr(m, "sliding_window_pattern", 0) or 0)
        extra.update(window=window, window_layers=m.n_layers - (m.n_layers // p if p else 0))
    if getattr(m, "attn_sinks", False):
        extra.update(sinks=True)
    return ModelShape(
        arch=m.arch,
        layers=m.n_layers,
        hidden=m.d_model,
        heads=m.n_heads,
        kv_heads=m.kv_heads,
        ffn=m.ffn_size,
        vocab=m.padded_vocab,
        positions=m.seq_len if architectures.get(m.arch).learned_positions else 0,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        head_size=m.head_dim,
        **extra,
    )
