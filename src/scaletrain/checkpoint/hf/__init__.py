"""Hugging Face export and import of scaletrain weights: one converter module per architecture (gpt2.py for gpt3,
llama.py for llama) over the shared directory and tensor I/O in common.py; sharded.py (import) and
sharded_export.py (export) do the same conversions per rank, each rank reading or writing only its own slices.

May import `config`, `model` (the Llama rotary constant, the ModelSpec's converter name) and torch/safetensors; nothing else in `checkpoint`
imports back into it except `init_from` (reading a Hugging Face directory as a run's initial weights).
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.checkpoint.hf.common import publish_hf_dir
from scaletrain.checkpoint.hf.gpt2 import export_gpt2_hf, import_gpt2_hf
from scaletrain.checkpoint.hf.llama import MODEL_TYPES, export_llama_hf, import_llama_hf
from scaletrain.config import ModelConfig
from scaletrain.model.spec import model_spec

__all__ = [
    "export_hf",
    "import_hf",
    "export_gpt2_hf",
    "import_gpt2_hf",
    "export_llama_hf",
    "import_llama_hf",
    "publish_hf_dir",
    "CONVERTERS",
    "importer",
]

# GPT-2 reading keeps its historical public name; a Llama directory goes through import_llama_hf.
import_hf = import_gpt2_hf

# Hugging Face model_type -> (exporter, importer): one converter module per type; ModelSpec.hf_adapter names one.
# The Llama converter also reads and writes Qwen3's type (checkpoint/hf/llama.py).
CONVERTERS = {
    "gpt2": (export_gpt2_hf, import_gpt2_hf),
    **dict.fromkeys(MODEL_TYPES.values(), (export_llama_hf, import_llama_hf)),
}


def importer(model_type: object):
    """The importer of a Hugging Face directory whose config.json says `model_type`; GPT-2's for any other type
    (it names what it needed)."""
    key = model_type if isinstance(model_type, str) and model_type in CONVERTERS else "gpt2"
    return CONVERTERS[key][1]


def export_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir,
    dtype=torch.float32,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write a full (unsharded) state dict as the Hugging Face directory of its architecture; returns its path.

    `out_dir` must be new or empty; `overwrite` lets an existing directory's export files be replaced (others stay).
    `extra_files`: further files of the export, name -> bytes (tokenizer_export.tokenizer_files).

    gpt3 becomes `GPT2LMHeadModel`, llama `LlamaForCausalLM`, qwen3 `Qwen3ForCausalLM` (see gpt2.py / llama.py for
    the conversions).
    """
    adapter = model_spec(cfg.arch).hf_adapter
    if adapter not in CONVERTERS:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face converter")
    return CONVERTERS[adapter][0](state_dict, cfg, out_dir, dtype, overwrite, extra_files)
