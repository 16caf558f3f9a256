"""One entry point from a model config to the plain single-device model, whatever the architecture."""

from __future__ import annotations

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.common import Decoder
from scaletrain.model.spec import model_spec

__all__ = ["Decoder", "build_model"]
# `Decoder` is what parallel/ and checkpoint/ may assume of a built model (cfg, embed, blocks, ln_f, head,
# head_is_tied). Wrappers (FSDP, compile) hand back nn.Module, so callers cast rather than check isinstance.


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The plain model of `cfg.arch` (its ModelSpec's builder: a model.common.Decoder), initialised from `seed`.

    Build it under `torch.device("meta")` to allocate nothing (parallelize materialises shards later).
    Raises ValueError for an unknown architecture.
    """
    return model_spec(cfg.arch).build(cfg, seed)
