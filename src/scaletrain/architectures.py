"""One `Architecture` per model.arch: the structural facts every layer asks about, in one torch-free place.

config validates model.arch against it, the simulator's per-layer inventory (sim/layers.py) counts parameters,
FLOPs and activations from it, and model/spec.py pairs each entry with its builder and Hugging Face converter. So
an architecture fact (gated MLP, biases, norm kind, tied head, position embedding, grouped K/V, QK-norm, rotary
base and frequency scaling) is written once, here, and nothing branches on an architecture's name. `LORA_TARGETS`
says which projection of a block each lora.targets value adapts, for config, the LoRA modules (model/lora.py) and
the inventory (sim/layers.py) alike. Layer 0: imports nothing from scaletrain.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Architecture",
    "ARCHITECTURES",
    "LoraTarget",
    "LORA_TARGETS",
    "ROPE_SCALINGS",
    "get",
    "names",
    "rope_problems",
]

ROPE_SCALINGS = ("none", "llama3", "yarn")
"""model.rope_scaling values: plain rotary frequencies, Llama 3.1's ("llama3": wavelengths beyond the original
context stretched by rope_factor, those under original/high_freq_factor kept, a smooth blend between), or YaRN
("yarn", GPT-OSS: frequencies rotating fewer than rope_beta_slow times over the original context divided by
rope_factor, more than rope_beta_fast kept, a linear ramp between, and cos/sin scaled by 0.1 ln(factor) + 1)."""


@dataclass(frozen=True)
class Architecture:
    """The structure of a decoder family: what parameter counts, FLOPs, memory and sharding rules derive from."""

    name: str
    """model.arch value."""
    gated_mlp: bool
    """SwiGLU (gate and up fused in `mlp.fc`, 2 x d_ff wide; three matrices) rather than GELU (two matrices)."""
    biases: bool
    """Every block linear has a bias (the output layer never does)."""
    norm_weights: int
    """Parameters per hidden unit of one norm: 2 for LayerNorm (weight, bias), 1 for RMSNorm."""
    tied_head: bool
    """The output layer is the token embedding (one matrix, counted once)."""
    learned_positions: bool
    """A seq_len x d_model position embedding (else positions are rotary: no parameters)."""
    grouped_kv: bool
    """Grouped-query attention: `attn.qkv` rows are in whole key/value groups, so tensor parallelism must also
    divide the key/value heads."""
    rope_theta: float = 0.0
    """Rotary base that model.rope_theta=0 resolves to; 0 for an architecture without rotary positions."""
    rope_scaling: str = "none"
    """Rotary frequency scaling (one of ROPE_SCALINGS) that an empty model.rope_scaling resolves to."""
    latent_attention: bool = False
    """Multi-head latent attention (model/mla.py: low-rank key/value latent with decoupled rotary keys, shaped by
    model.mla) instead of `attn.qkv`; model.mla.kv_lora_rank must then be > 0."""
    experts: bool = False
    """Its model code builds Mixture-of-Experts layers from model.moe (others refuse model.moe.n_experts > 0)."""
    windowed_attention: bool = False
    """Its attention honours model.sliding_window and model.attn_sinks (others refuse them)."""
    qk_norm: bool = False
    """QK-norm (Qwen3): an RMSNorm over each head's features (one weight of head_dim, shared by the heads) on the
    queries and on the keys before rotary positions; `attn.q_norm`, `attn.k_norm`."""

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in one MLP: gate, up and down (SwiGLU) or fc and proj (GELU)."""
        return 3 if self.gated_mlp else 2


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        # MLPerf gpt3 = GPT-2's architecture: learned positions, pre-LayerNorm, tanh GELU, biases, tied head.
        Architecture(
            "gpt3",
            gated_mlp=False,
            biases=True,
            norm_weights=2,
            tied_head=True,
            learned_positions=True,
            grouped_kv=False,
        ),
        # Llama 2: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head.
        Architecture(
            "llama",
            gated_mlp=True,
            biases=False,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=True,
            rope_theta=10000.0,
        ),
        # Llama 3.1 (Grattafiori et al. 2024): Llama 2's structure with rotary base 500,000 and the "llama3"
        # frequency scaling of its 128K-context release (factors from model.rope_*: 8, 1, 4, original 8,192).
        Architecture(
            "llama31",
            gated_mlp=True,
            biases=False,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=True,
            rope_theta=500000.0,
            rope_scaling="llama3",
        ),
        # Qwen3 dense (Qwen Team 2025, arXiv:2505.09388; HF Qwen3ForCausalLM): Llama's structure with QK-norm and
        # rotary base 1,000,000; its head size is model.head_dim (128 in every released size).
        Architecture(
            "qwen3",
            gated_mlp=True,
            biases=False,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=True,
            rope_theta=1000000.0,
            qk_norm=True,
        ),
        # GPT-OSS (OpenAI 2025; HF GptOssForCausalLM): Llama's structure with biased attention projections and
        # experts, rotary base 150,000 with YaRN scaling; its sinks, sliding windows, clamped SwiGLU and
        # Mixture-of-Experts MLPs are model config fields (model/gpt_oss.py).
        Architecture(
            "gpt_oss",
            gated_mlp=True,
            biases=True,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=True,
            rope_theta=150000.0,
            rope_scaling="yarn",
            experts=True,
            windowed_attention=True,
        ),
        # DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437): RMSNorm, SwiGLU (dense and per expert), multi-head
        # latent attention with rotary base 10,000 on its decoupled rotary dims, untied head; experts from model.moe.
        Architecture(
            "deepseek_v3",
            gated_mlp=True,
            biases=False,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=False,
            rope_theta=10000.0,
            latent_attention=True,
            experts=True,
        ),
    )
}
"""model.arch -> facts; read at call time, so a test can register another architecture."""


@dataclass(frozen=True)
class LoraTarget:
    """The projection of every block that one lora.targets value adapts (LoRA: W x + B A x, A [r, in], B [out, r]).

    Its fans (in and out widths) are the projection's own: the inventory's GEMM of the same name (sim/layers.py)
    and the model's `nn.Linear` at `module`, which a test holds equal, so they are not written again here."""

    name: str
    """lora.targets value; also the name of the inventory's GEMM it adapts."""
    module: str
    """Path of the adapted linear inside a block (`blocks.N.<module>`): model/lora.py puts the adapter beside it."""
    tp: str
    """How tensor parallelism splits the projection: "col" (its output features) or "row" (its input features).
    The adapter follows it: A splits like the input (row) or stays whole, B like the output (col) or stays whole."""


LORA_TARGETS: dict[str, LoraTarget] = {
    t.name: t
    for t in (
        LoraTarget("qkv", "attn.qkv", "col"),
        LoraTarget("proj", "attn.proj", "row"),
        # A gated MLP's gate and up are one fused `mlp.fc` (2 x d_ff wide), so fc1 is one adapter there too.
        LoraTarget("fc1", "mlp.fc", "col"),
        LoraTarget("fc2", "mlp.proj", "row"),
    )
}
"""lora.targets value -> the projection it adapts."""


def get(name: str) -> Architecture:
    """The facts of architecture `name`; ValueError naming the known ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"model.arch={name!r}: must be one of {list(ARCHITECTURES)}") from None


def names() -> tuple[str, ...]:
    """Every model.arch value, in registry order."""
    return tuple(ARCHITECTURES)


def rope_problems(m: Any) -> Iterator[str]:
    """One line per wrong rotary field of model config `m` (a ModelConfig, duck-typed: config imports this
    module); nothing for an unknown architecture, which config reports itself. NaNs are config's nonfinite check's."""
    if m.arch not in ARCHITECTURES:
        return
    facts = get(m.arch)
    if not facts.rope_theta and (m.rope_theta or m.rope_scaling not in ("", "none")):
        yield f"model.rope_theta/model.rope_scaling: model.arch={m.arch!r} has no rotary positions; leave them unset"
    if m.rope_theta < 0 or 0 < m.rope_theta <= 1:
        yield f"model.rope_theta={m.rope_theta}: must be > 1 (or 0 for the architecture's {facts.rope_theta:g})"
    if m.rope_scaling and m.rope_scaling not in ROPE_SCALINGS:
        yield (
            f"model.rope_scaling={m.rope_scaling!r}: must be one of {list(ROPE_SCALINGS)} (or '' for the "
            "architecture's)"
        )
    kind = m.rope_scaling or facts.rope_scaling
    if kind not in ("llama3", "yarn"):
        return
    if not m.rope_factor >= 1:
        yield f"model.rope_factor={m.rope_factor}: must be >= 1"
    if m.rope_original_seq_len <= 0:
        yield f"model.rope_original_seq_len={m.rope_original_seq_len}: must be > 0"
    if kind == "yarn":
        if not 0 < m.rope_beta_slow < m.rope_beta_fast:
            yield (
                f"model.rope_beta_slow={m.rope_beta_slow}, model.rope_beta_fast={m.rope_beta_fast}: need "
                "0 < slow < fast"
            )
        return
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        yield (
            f"model.rope_low_freq_factor={m.rope_low_freq_factor}, model.rope_high_freq_factor="
            f"{m.rope_high_freq_factor}: need 0 < low < high"
        )
