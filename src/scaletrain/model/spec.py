"""One `ModelSpec` per architecture (model.arch): how to build it and the facts other packages ask about it.

Parameter and FLOP counts (model/flops.py), tensor-parallel divisibility (parallel/layout.py), the Hugging Face
converter (checkpoint/hf/) and the CLI's export message read an architecture here instead of branching on its
name. Adding an architecture: its module (model/<arch>.py, with the seams GPT and Llama share: `embed`, `blocks`,
`ln_f`, `head`, `attn.qkv`/`attn.proj`, `mlp.fc`/`mlp.proj`, so the one tensor-parallel plan and the pipeline cut
fit it), one entry in `MODELS`, and its name in config.ARCHS (config validates model.arch before any model code
loads). Torch-free: a builder imports its module only when called, so `flops` stays importable without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.config import ModelConfig

__all__ = ["ModelSpec", "MODELS", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """An architecture: its builder and the structural facts parameter counts, FLOPs and layouts derive from."""

    name: str
    """model.arch value."""
    build: Callable[[ModelConfig, int], Any]
    """(config, seed) -> the plain single-device nn.Module, initialised from the seed."""
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
    hf_adapter: str
    """Hugging Face model_type its weights convert to and from (checkpoint/hf/ has a converter per type); "" =
    no Hugging Face export or import."""
    hf_class: str
    """transformers class that loads an exported directory ("" without a converter)."""

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in one MLP: gate, up and down (SwiGLU) or fc and proj (GELU)."""
        return 3 if self.gated_mlp else 2

    def tp_problems(self, m: ModelConfig, tp: int) -> list[str]:
        """Why `tp` cannot shard this architecture at shape `m` (column-parallel qkv and fc, row-parallel proj,
        vocabulary-parallel embedding and head), one line each; [] when it can."""
        out = []
        if m.n_heads % tp:
            out.append(f"parallel.tp={tp} does not divide model.n_heads={m.n_heads}")
        if self.grouped_kv and m.kv_heads % tp:
            # qkv's tensor-parallel shard must hold whole key/value groups (model/llama.py's row order).
            out.append(f"parallel.tp={tp} does not divide the key/value heads {m.kv_heads} (model.n_kv_heads)")
        if m.ffn_size % tp:
            out.append(f"parallel.tp={tp} does not divide the MLP width {m.ffn_size}")
        if m.padded_vocab % tp:
            out.append(
                f"parallel.tp={tp} does not divide the padded vocabulary {m.padded_vocab} "
                f"(raise model.vocab_multiple to a multiple of {tp})"
            )
        return out


def _build_gpt(cfg: ModelConfig, seed: int = 0) -> Any:
    from scaletrain.model.gpt import GPT  # torch: only when a model is built

    return GPT(cfg, seed)


def _build_llama(cfg: ModelConfig, seed: int = 0) -> Any:
    from scaletrain.model.llama import Llama  # torch: only when a model is built

    return Llama(cfg, seed)


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        # MLPerf gpt3 = GPT-2's architecture: learned positions, pre-LayerNorm, tanh GELU, biases, tied head.
        ModelSpec(
            name="gpt3",
            build=_build_gpt,
            gated_mlp=False,
            biases=True,
            norm_weights=2,
            tied_head=True,
            learned_positions=True,
            grouped_kv=False,
            hf_adapter="gpt2",
            hf_class="GPT2LMHeadModel",
        ),
        # Llama 2: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases, untied head.
        ModelSpec(
            name="llama",
            build=_build_llama,
            gated_mlp=True,
            biases=False,
            norm_weights=1,
            tied_head=False,
            learned_positions=False,
            grouped_kv=True,
            hf_adapter="llama",
            hf_class="LlamaForCausalLM",
        ),
    )
}
"""model.arch -> spec; read at call time, so a test can register another architecture."""


def model_spec(arch: str) -> ModelSpec:
    """The spec of architecture `arch`; ValueError naming the known ones otherwise."""
    try:
        return MODELS[arch]
    except KeyError:
        known = ", ".join(repr(a) for a in MODELS)
        raise ValueError(f"model.arch={arch!r}: no model builder (known: {known})") from None
