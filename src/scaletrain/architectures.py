"""One `Architecture` per model.arch: the structural facts every layer asks about, in one torch-free place.

config validates model.arch against it, the simulator's per-layer inventory (sim/layers.py) counts parameters,
FLOPs and activations from it, and model/spec.py pairs each entry with its builder and Hugging Face converter. So
an architecture fact (gated MLP, biases, norm kind, tied head, position embedding, grouped K/V) is written once,
here, and nothing branches on an architecture's name. Layer 0: imports nothing from scaletrain.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Architecture", "ARCHITECTURES", "get", "names"]


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
        ),
    )
}
"""model.arch -> facts; read at call time, so a test can register another architecture."""


def get(name: str) -> Architecture:
    """The facts of architecture `name`; ValueError naming the known ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"model.arch={name!r}: must be one of {list(ARCHITECTURES)}") from None


def names() -> tuple[str, ...]:
    """Every model.arch value, in registry order."""
    return tuple(ARCHITECTURES)
