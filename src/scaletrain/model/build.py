"""One entry point from a model config to the plain single-device model, whatever the architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.spec import model_spec

if TYPE_CHECKING:
    from scaletrain.model.deepseek_v3 import DeepseekV3
    from scaletrain.model.gpt import GPT
    from scaletrain.model.llama import Llama

# What parallel/ and checkpoint/ may assume of a built model (cfg, embed, blocks, ln_f, head, head_is_tied). For
# mypy only: wrappers (FSDP, compile) hand back nn.Module, so callers cast rather than check isinstance.
Decoder: TypeAlias = "GPT | Llama | DeepseekV3"


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The plain model of `cfg.arch` (its ModelSpec's builder: "gpt3" GPT, "llama" Llama), initialised from `seed`.

    Build it under `torch.device("meta")` to allocate nothing (parallelize materialises shards later).
    Raises ValueError for an unknown architecture.
    """
    return model_spec(cfg.arch).build(cfg, seed)
