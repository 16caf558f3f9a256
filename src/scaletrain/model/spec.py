"""One `ModelSpec` per architecture (model.arch): how to build it and the facts other packages ask about it.

Parameter and FLOP counts (model/flops.py), tensor-parallel divisibility (parallel/layout.py), the Hugging Face
converter (checkpoint/hf/) and the CLI's export message read an architecture here instead of branching on its
name. Adding an architecture: its facts in scaletrain/architectures.py (which config validates model.arch against),
one entry in `MODELS`, and a module only for what the shared decoder (model/common.py) does not already build from
those facts (a `Decoder` subclass choosing its attention and MLP; Qwen3 needs none). Torch-free: a builder imports its module only when called, so `flops` stays importable without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain import architectures
from scaletrain.architectures import Architecture
from scaletrain.config import ModelConfig

__all__ = ["ModelSpec", "MODELS", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """An architecture's code: its builder and Hugging Face converter, with its structural facts (`facts`)."""

    name: str
    """model.arch value."""
    build: Callable[[ModelConfig, int], Any]
    """(config, seed) -> the plain single-device nn.Module, initialised from the seed."""
    hf_adapter: str
    """The checkpoint/hf/ converter its weights go through, by Hugging Face model_type ("gpt2", "llama"; the Llama
    converter also reads and writes Qwen3's, whose only extra weights are the QK-norms); "" = no Hugging Face
    export or import."""
    hf_class: str
    """transformers class that loads an exported directory ("" without a converter)."""

    @property
    def facts(self) -> Architecture:
        """The architecture's structure (scaletrain.architectures): one definition for model/, parallel/ and sim/."""
        return architectures.get(self.name)

    def tp_problems(self, m: ModelConfig, tp: int) -> list[str]:
        """Why `tp` cannot shard this architecture at shape `m` (column-parallel qkv and fc, row-parallel proj,
        vocabulary-parallel embedding and head, attention sinks split by head; routed experts are not split by tp:
        parallel/layout.py's expert-parallel rules), one line each; [] when it can."""
        out = []
        facts = self.facts
        if tp > 1 and facts.latent_attention:
            return [f"parallel.tp={tp}: model.arch={m.arch!r} has no tensor-parallel plan for its latent attention yet"]
        if m.n_heads % tp:
            out.append(f"parallel.tp={tp} does not divide model.n_heads={m.n_heads}")
        if self.facts.grouped_kv and m.kv_heads % tp:
            # qkv's tensor-parallel shard must hold whole key/value groups (model/common.py's row order).
            out.append(f"parallel.tp={tp} does not divide the key/value heads {m.kv_heads} (model.n_kv_heads)")
        moe = m.moe
        if (moe.n_experts == 0 or moe.first_dense > 0) and m.ffn_size % tp:
            out.append(f"parallel.tp={tp} does not divide the MLP width {m.ffn_size}")
        shared = moe.n_shared * (moe.d_ff_expert or m.ffn_size)
        if moe.n_experts and shared % tp:  # shared experts are column/row-parallel like a dense MLP
            out.append(f"parallel.tp={tp} does not divide the shared experts' width {shared}")
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


def _build_gpt_oss(cfg: ModelConfig, seed: int = 0) -> Any:
    from scaletrain.model.gpt_oss import GptOss  # torch: only when a model is built

    return GptOss(cfg, seed)


def _build_deepseek_v3(cfg: ModelConfig, seed: int = 0) -> Any:
    from scaletrain.model.deepseek_v3 import DeepseekV3  # torch: only when a model is built

    return DeepseekV3(cfg, seed)


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name="gpt3",
            build=_build_gpt,
            hf_adapter="gpt2",
            hf_class="GPT2LMHeadModel",
        ),
        ModelSpec(
            name="llama",
            build=_build_llama,
            hf_adapter="llama",
            hf_class="LlamaForCausalLM",
        ),
        # Llama 3.1 is the Llama module with other rotary frequencies (model/rope.py's Rope), and HF's same class.
        ModelSpec(
            name="llama31",
            build=_build_llama,
            hf_adapter="llama",
            hf_class="LlamaForCausalLM",
        ),
        # Qwen3 dense is the Llama module with QK-norm (its facts), converted by the Llama converter to Qwen3's type.
        ModelSpec(
            name="qwen3",
            build=_build_llama,
            hf_adapter="llama",
            hf_class="Qwen3ForCausalLM",
        ),
        # No checkpoint converter yet: tests/unit/test_gpt_oss.py maps HF's weights for the parity check.
        ModelSpec(
            name="gpt_oss",
            build=_build_gpt_oss,
            hf_adapter="",
            hf_class="",
        ),
        # DeepSeek-V3: latent attention and MoE; tests/unit/test_deepseek_v3.py maps HF's weights for parity, but
        # no directory converter yet.
        ModelSpec(
            name="deepseek_v3",
            build=_build_deepseek_v3,
            hf_adapter="",
            hf_class="",
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
