"""The model section of the configuration: shape, rotary positions, Mixture-of-Experts and latent attention.

Split from `scaletrain.config` (which re-exports every name here) to keep each file short; `model_problems` is the
model part of `Config.validate`. Layer 0: imports only `architectures`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from scaletrain import architectures

__all__ = ["ModelConfig", "MoEConfig", "MLAConfig", "model_problems", "ROUTER_SCORES"]

ROUTER_SCORES = ("softmax", "sigmoid")
"""model.moe.score_func values: softmax over all experts (GPT-OSS: with norm_topk, the same as a softmax over the
top-k logits) or an independent sigmoid per expert (DeepSeek-V3)."""


@dataclass
class MoEConfig:
    n_experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model (no MoE layers, every other moe field ignored)."""
    top_k: int = 2
    """Routed experts each token is sent to."""
    d_ff_expert: int = 0
    """Inner size of one expert's SwiGLU MLP; 0 means model.d_ff (DeepSeek-V3: 2,048 per expert, 18,432 dense)."""
    n_shared: int = 0
    """Shared experts every token also goes through (DeepSeek-V3: 1), each of d_ff_expert width."""
    score_func: str = "softmax"
    """Router scores: "softmax" or "sigmoid" (ROUTER_SCORES)."""
    norm_topk: bool = True
    """Renormalise the top-k scores of a token to sum to 1 before weighting the experts' outputs."""
    route_scale: float = 1.0
    """Multiplier on the routed experts' weights (DeepSeek-V3's routed_scaling_factor: 2.5)."""
    n_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3: 8): a token picks topk_groups groups first, by the sum
    of each group's two best scores, then its top_k experts inside them; 1 = plain top-k."""
    topk_groups: int = 1
    """Groups a token may route into under group-limited routing (DeepSeek-V3: 4)."""
    router_bias: bool = False
    """The router's linear layer has a learned bias (GPT-OSS)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the load-balancing auxiliary loss (Switch/GShard form: n_experts x sum over experts of the
    fraction of routed tokens x mean router probability) added to the training loss; the MLPerf deepseekv3_671b
    rules fix 0.01."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's selection bias moves by this
    much toward balance (up when under-loaded, down when over-loaded); the bias only changes which experts are
    picked, never the weights. 0 = off."""
    capacity_factor: float = 0.0
    """Tokens an expert accepts per step, as a multiple of the balanced share (tokens x top_k / n_experts); tokens
    over capacity are dropped (their routed contribution is zero; the residual and shared experts still apply).
    0 = no capacity: no token is ever dropped."""
    first_dense: int = 0
    """Leading layers with a dense MLP of model.d_ff instead of experts (DeepSeek-V3: 3)."""


@dataclass
class MLAConfig:
    kv_lora_rank: int = 0
    """Rank of the compressed key/value latent (DeepSeek-V3: 512); 0 = standard attention (no MLA)."""
    q_lora_rank: int = 0
    """Rank of the compressed query latent (DeepSeek-V3: 1,536); 0 = queries straight from the hidden state."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions without rotary positions (decompressed from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dimensions that carry the rotary positions (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dimension."""


@dataclass
class ModelConfig:
    arch: str = "gpt3"
    """Architecture family: "gpt3" (GPT-2/GPT-3 decoder: learned positions, pre-LN, tanh GELU, tied embeddings),
    "llama" (Llama 2: RMSNorm, SwiGLU, rotary positions, grouped-query attention, untied head), "llama31"
    (Llama 3.1: Llama 2 with rotary base 500,000 and the "llama3" frequency scaling), "qwen3" (Qwen3 dense: Llama
    with QK-norm, rotary base 1,000,000), "gpt_oss" (biases, sinks, sliding windows, experts from model.moe) or
    "deepseek_v3" (latent attention from model.mla, experts from model.moe)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 256
    """Hidden size h."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention (llama); 0 means n_heads (plain multi-head attention)."""
    d_ff: int = 0
    """Feed-forward inner size; 0 means 4 * d_model (the GPT-3 ratio)."""
    seq_len: int = 256
    """Training sequence length s (also the number of learned positions)."""
    vocab_size: int = 8192
    """Tokenizer vocabulary size (unpadded). The embedding is padded to a multiple of `vocab_multiple`."""
    vocab_multiple: int = 128
    """Pad the embedding/logit rows to a multiple of this (GPT-3: 50257 -> 51200) for fast GEMMs."""
    ln_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.006
    """Std of the normal init of every weight matrix and embedding (MLPerf gpt3: 0.006)."""
    rope_theta: float = 0.0
    """Rotary base; 0 means the architecture's (llama 10,000, llama31 500,000). Rotary architectures only."""
    rope_scaling: str = ""
    """Rotary frequency scaling: "none", "llama3" (Llama 3.1's, shaped by the four rope_* fields below), or ""
    for the architecture's (llama none, llama31 llama3). Rotary architectures only."""
    rope_factor: float = 8.0
    """llama3 scaling: wavelengths longer than rope_original_seq_len / rope_low_freq_factor are stretched by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: low-frequency bound; wavelengths above original / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: high-frequency bound; wavelengths below original / this keep their frequency."""
    rope_original_seq_len: int = 8192
    """llama3 scaling: the context the base frequencies were trained at (HF original_max_position_embeddings)."""

    head_dim: int = 0
    """Size of one attention head; 0 means d_model / n_heads (GPT-OSS: 64 with d_model 2,880 and 64 heads)."""
    moe: MoEConfig = field(default_factory=lambda: MoEConfig())
    """Mixture-of-Experts feed-forward layers (model.moe.n_experts = 0: every layer dense)."""
    mla: MLAConfig = field(default_factory=lambda: MLAConfig())
    """Multi-head latent attention (DeepSeek-V3); model.mla.kv_lora_rank = 0: standard attention."""
    swiglu_limit: float = 0.0
    """SwiGLU clamp: 0 = plain silu(gate) * up; > 0 = GPT-OSS's variant (its config: 7.0), gate clamped above at
    this, up clamped to [-limit, limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the clamped SwiGLU (GPT-OSS: 1.702); used only when swiglu_limit > 0."""
    sliding_window: int = 0
    """Tokens a sliding-window attention layer sees (itself and the window - 1 before it; GPT-OSS: 128); 0 = every
    layer attends to the whole causal context."""
    sliding_window_pattern: int = 2
    """With sliding_window > 0: in every run of this many layers the last has full attention and the others a
    sliding window (2 = GPT-OSS: even layers sliding, odd full; 1 = all full; 0 = all sliding)."""
    attn_sinks: bool = False
    """Attention sinks (GPT-OSS): one learned logit per head joins every softmax row as an extra column whose
    value is dropped, so a head can attend to nothing."""
    rope_beta_fast: float = 32.0
    """yarn scaling: rotations over the original context above which a frequency is kept (extrapolated)."""
    rope_beta_slow: float = 1.0
    """yarn scaling: rotations over the original context below which a frequency is divided by rope_factor."""
    rope_yarn_truncate: bool = True
    """yarn scaling: round the ramp's dimension bounds to integers (HF's `truncate`; GPT-OSS: false)."""

    @property
    def head_size(self) -> int:
        """Size of one attention head after resolving the 0 default."""
        return self.head_dim or self.d_model // max(1, self.n_heads)

    @property
    def kv_heads(self) -> int:
        """Key/value heads after resolving the 0 default."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_size(self) -> int:
        """Feed-forward inner size after resolving the 0 default."""
        return self.d_ff or 4 * self.d_model

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rows actually allocated: vocab_size rounded up to vocab_multiple."""
        m = self.vocab_multiple
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def rope_base(self) -> float:
        """Rotary base after resolving the 0 default (the architecture's)."""
        return self.rope_theta or architectures.get(self.arch).rope_theta

    @property
    def rope_kind(self) -> str:
        """Rotary frequency scaling after resolving the "" default (the architecture's)."""
        return self.rope_scaling or architectures.get(self.arch).rope_scaling


def _moe_problems(m: ModelConfig) -> Iterator[str]:
    e = m.moe
    if e.n_experts < 0:
        yield f"model.moe.n_experts={e.n_experts}: must be >= 0 (0 = dense)"
    if e.n_experts <= 0:
        return
    if not 1 <= e.top_k <= e.n_experts:
        yield f"model.moe.top_k={e.top_k}: must be in [1, model.moe.n_experts={e.n_experts}]"
    if e.d_ff_expert < 0 or e.n_shared < 0 or e.first_dense < 0:
        yield "model.moe.d_ff_expert, model.moe.n_shared and model.moe.first_dense must be >= 0"
    if e.first_dense > m.n_layers:
        yield f"model.moe.first_dense={e.first_dense}: more than model.n_layers={m.n_layers}"
    if e.score_func not in ROUTER_SCORES:
        yield f"model.moe.score_func={e.score_func!r}: must be one of {list(ROUTER_SCORES)}"
    if e.n_groups < 1 or e.n_experts % e.n_groups:
        yield f"model.moe.n_groups={e.n_groups}: must be >= 1 and divide model.moe.n_experts={e.n_experts}"
    elif not 1 <= e.topk_groups <= e.n_groups:
        yield f"model.moe.topk_groups={e.topk_groups}: must be in [1, model.moe.n_groups={e.n_groups}]"
    elif e.top_k > e.topk_groups * (e.n_experts // e.n_groups):
        yield (
            f"model.moe.top_k={e.top_k}: more than the {e.topk_groups * (e.n_experts // e.n_groups)} experts in "
            f"model.moe.topk_groups={e.topk_groups} groups"
        )
    if e.route_scale <= 0:
        yield f"model.moe.route_scale={e.route_scale}: must be > 0"
    for name in ("aux_loss_coef", "bias_update_rate", "capacity_factor"):
        if getattr(e, name) < 0:
            yield f"model.moe.{name}={getattr(e, name)}: must be >= 0"


def _arch_feature_problems(m: ModelConfig) -> Iterator[str]:
    """Fields the architecture's model code would silently ignore."""
    if m.arch not in architectures.names():
        return
    facts = architectures.get(m.arch)
    if m.moe.n_experts > 0 and not facts.experts:
        yield f"model.moe.n_experts={m.moe.n_experts}: model.arch={m.arch!r} has no Mixture-of-Experts layers"
    if m.mla.kv_lora_rank > 0 and not facts.latent_attention:
        yield f"model.mla.kv_lora_rank={m.mla.kv_lora_rank}: model.arch={m.arch!r} has no latent attention"
    if (m.sliding_window > 0 or m.attn_sinks) and not facts.windowed_attention:
        yield f"model.sliding_window/model.attn_sinks: model.arch={m.arch!r} has no windowed or sink attention"


def _mla_problems(m: ModelConfig) -> Iterator[str]:
    a = m.mla
    if m.arch in architectures.names() and architectures.get(m.arch).latent_attention:
        if a.kv_lora_rank <= 0:
            yield f"model.mla.kv_lora_rank={a.kv_lora_rank}: model.arch={m.arch!r} uses latent attention; set it > 0"
        if m.rope_scaling == "yarn":
            # DeepSeek's YaRN also scales the softmax (mscale_all_dim), which model/mla.py does not implement.
            yield f"model.rope_scaling='yarn': model.arch={m.arch!r} (latent attention) supports 'none' or 'llama3'"
    if a.kv_lora_rank < 0 or a.q_lora_rank < 0:
        yield "model.mla.kv_lora_rank and model.mla.q_lora_rank must be >= 0"
    if a.kv_lora_rank > 0:
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(a, name) <= 0:
                yield f"model.mla.{name}={getattr(a, name)}: must be > 0"
        if a.qk_rope_head_dim % 2:
            yield f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim}: must be even (rotary pairs)"


def model_problems(m: ModelConfig) -> Iterator[str]:
    """One line per wrong field of the model section (unknown architecture, shapes, rotary, MoE, MLA)."""
    if m.arch not in architectures.names():
        yield f"model.arch={m.arch!r}: must be one of {list(architectures.names())}"
    if m.n_kv_heads < 0 or (m.n_kv_heads and m.n_heads % m.n_kv_heads):
        yield f"model.n_kv_heads={m.n_kv_heads}: must be 0 or divide model.n_heads={m.n_heads}"
    for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "vocab_multiple"):
        if getattr(m, name) <= 0:
            yield f"model.{name}={getattr(m, name)}: must be > 0"
    if m.head_dim < 0:
        yield f"model.head_dim={m.head_dim}: must be >= 0 (0 means d_model / n_heads)"
    elif not m.head_dim and m.n_heads > 0 and m.d_model % m.n_heads:
        yield f"model.n_heads={m.n_heads}: must divide model.d_model={m.d_model} (or set model.head_dim)"
    if m.d_ff < 0:
        yield f"model.d_ff={m.d_ff}: must be >= 0 (0 means 4*d_model)"
    if not (0 < m.ln_eps < 1):
        yield f"model.ln_eps={m.ln_eps}: must be in (0, 1)"
    if m.init_std <= 0:
        yield f"model.init_std={m.init_std}: must be > 0"
    if m.swiglu_limit < 0 or m.swiglu_alpha <= 0:
        yield f"model.swiglu_limit={m.swiglu_limit}, model.swiglu_alpha={m.swiglu_alpha}: need limit >= 0, alpha > 0"
    if m.sliding_window < 0 or m.sliding_window_pattern < 0:
        yield (
            f"model.sliding_window={m.sliding_window}, model.sliding_window_pattern={m.sliding_window_pattern}: "
            "must be >= 0"
        )
    yield from architectures.rope_problems(m)
    yield from _arch_feature_problems(m)
    yield from _moe_problems(m)
    yield from _mla_problems(m)
