"""Start weights from elsewhere: the frozen base of a LoRA run (or any run's initial weights).

`checkpoint.init_from` names a scaletrain checkpoint (a step directory, a checkpoints/ folder or a run directory:
its newest complete checkpoint) or a Hugging Face directory (config.json + model.safetensors, GPT-2 or Llama).
Every rank reads the full state on the CPU and keeps its own shards (`set_model_state_dict` with a full state
dict), so any layout can start from any saved one. Loading happens in the untimed init, as MLPerf's
llama2_70b_lora loads its base model there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scaletrain.checkpoint import store
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.config import ModelConfig

# Fields that decide tensor shapes and meaning; seq_len may differ (RoPE needs no table; gpt3's table is checked
# through its shape).
_SHAPE_FIELDS = ("arch", "n_layers", "d_model", "n_heads", "kv_heads", "ffn_size", "padded_vocab")


def _newest_checkpoint(path: Path) -> Path | None:
    if (path / store.MANIFEST).exists():
        return path
    for root in (path / "checkpoints", path):
        found = store.complete_checkpoints(root)
        if found:
            return found[-1]
    return None


def read_base_state(path: str | Path, _chain: tuple = ()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, plain full state dict) of the weights at `path`; adapters merged in if it has any.

    A scaletrain checkpoint is read as data only (checkpoint/safe_load.py), like a resume.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint.init_from={path}: no such file or directory")
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        return _read_hf(p)
    ckpt = _newest_checkpoint(p)
    if ckpt is None:
        raise CheckpointError(
            f"checkpoint.init_from={path}: neither a Hugging Face directory nor a directory "
            "holding a complete scaletrain checkpoint"
        )
    from scaletrain.checkpoint.checkpointer import load_full_model

    cfg, model = load_full_model(ckpt, _chain=_chain)
    if cfg.lora.rank > 0:
        from scaletrain.model.lora import merge_lora

        merge_lora(model)
    return cfg.model, {k: v.detach() for k, v in model.state_dict().items()}


def _read_hf(p: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError

    try:
        hf = json.loads((p / "config.json").read_text())
        if not isinstance(hf, dict):
            raise ValueError(f"{p / 'config.json'}: not a JSON object")
        from scaletrain.checkpoint.hf import importer

        return importer(hf.get("model_type", ""))(p)
    except (ValueError, TypeError, KeyError, SafetensorError) as exc:  # a file that is not what it claims to be
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint.init_from={p}: {text}") from None


def check_compatible(want: ModelConfig, have: ModelConfig, where: str) -> None:
    """One-line CheckpointError when the saved model's shapes differ from the configured one."""
    diffs = [
        f"{f} {getattr(have, f)} != {getattr(want, f)}" for f in _SHAPE_FIELDS if getattr(have, f) != getattr(want, f)
    ]
    if diffs:
        raise CheckpointError(f"checkpoint.init_from={where}: saved model does not match model.*: {', '.join(diffs)}")


def load_base_weights(parts: list[torch.nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Copy a full plain state dict into this rank's (possibly sharded, possibly pipeline-cut) model parts.

    Keys a part does not hold (other pipeline stages) and parameters the state lacks (LoRA adapters) are skipped.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for part in parts:
        own = part.state_dict()
        subset = {k: v for k, v in state.items() if k in own}
        missing = [k for k in own if k not in state and "lora_" not in k]
        if missing:
            raise CheckpointError(
                f"checkpoint.init_from: saved weights lack {missing[0]} (and {len(missing) - 1} more)"
            )
        set_model_state_dict(part, subset, options=StateDictOptions(full_state_dict=True, strict=False))
        if hasattr(part, "tie_weights"):
            part.tie_weights()
