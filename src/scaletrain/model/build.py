"""One entry point from a model config to the plain single-device model, whatever the architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from torch import nn

from scaletrain.config import ModelConfig

if TYPE_CHECKING:
    from scaletrain.model.gpt import GPT
    from scaletrain.model.llama import Llama

# What parallel/ and checkpoint/ may assume of a built model (cfg, embed, blocks, ln_f, head, head_is_tied). For
# mypy only: wrappers (FSDP, compile) hand back nn.Module, so callers cast rather than check isinstance.
Decoder: TypeAlias = "GPT | Llama"


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The plain model of `cfg.arch` ("gpt3": GPT, "llama": Llama), initialised from `seed`.

    Build it under `torch.device("meta")` to allocate nothing (parallelize materialises shards later).
    Raises ValueError for an unknown architecture.
    """
    if cfg.arch == "gpt3":
        from scaletrain.model.gpt import GPT

        return GPT(cfg, seed)
    if cfg.arch == "llama":
        from scaletrain.model.llama import Llama

        return Llama(cfg, seed)
    raise ValueError(f"model.arch={cfg.arch!r}: no model builder (known: 'gpt3', 'llama')")
