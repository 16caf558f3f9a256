"""What the GPT-2 and Llama Hugging Face converters share: the atomic directory publish, safetensors / tensors-only
.bin reading, config.json reading and the vocabulary-padding inference.

Imports nothing from the per-architecture converters, so each of them (gpt2.py, llama.py) depends only on this.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch


def read_config_json(path: Path) -> tuple[Path, dict]:
    """(path of config.json, its parsed contents) of the HF directory `path`; FileNotFoundError if it has none."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no such file")
    return cfg_file, json.loads(cfg_file.read_text())


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)  # directories too: their entries must reach disk before the rename counts
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_hf_dir(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], who: str) -> Path:
    """Write config.json + model.safetensors into `out_dir` atomically: a temp dir swapped in by rename.

    Replacing means deleting: only ever replace an empty directory or one that looks like an earlier export.
    """
    from safetensors import torch as st  # optional dependency: only exporting/importing needs it

    tmp = new_tmp_dir(out_dir, who)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # transformers 4.x refuses safetensors files without a "format" entry in their metadata.
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "model.safetensors"):
            fsync_path(tmp / name)
        swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def new_tmp_dir(out_dir: Path, who: str) -> Path:
    """A fresh temporary directory beside `out_dir` to build an export in; FileExistsError (prefixed with `who`)
    when `out_dir` exists and is neither empty nor an earlier HF export (replacing means deleting)."""
    if out_dir.exists() and not (
        out_dir.is_dir() and ((out_dir / "config.json").is_file() or not any(out_dir.iterdir()))
    ):
        raise FileExistsError(f"{who}: {out_dir} exists and is not an HF export; refusing to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def swap_in(tmp: Path, out_dir: Path) -> None:
    """Replace `out_dir` by the complete export `tmp` (files already fsynced) with renames."""
    fsync_path(tmp)
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-"))
    if out_dir.exists():
        # rename() cannot replace a non-empty directory: move the old export aside, then swap the new one in.
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old.exists():
            os.replace(old, out_dir)
        raise
    fsync_path(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def check_state_shapes(who: str, sd: dict, expected: dict[str, tuple]) -> None:
    """ValueError (prefixed with `who`) unless `sd` has exactly the keys of `expected`, each with its shape."""
    missing, unexpected = sorted(expected.keys() - sd.keys()), sorted(sd.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{who}: state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if tuple(sd[key].shape) != shape:
            raise ValueError(f"{who}: {key} has shape {tuple(sd[key].shape)}, config expects {shape}")


def vocab_multiple_for(vocab: int, rows: int, recorded) -> int:
    """A vocab_multiple under which `vocab` pads to exactly `rows`: the recorded one, else the largest power of 2."""
    candidates = ([recorded] if isinstance(recorded, int) and recorded > 0 else []) + [2**k for k in range(7, -1, -1)]
    for m in candidates + [rows]:  # m = rows always works once vocab <= rows
        if math.ceil(vocab / m) * m == rows:
            return m
    raise AssertionError("unreachable")


def load_tensors(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file read, its tensors) from an HF directory: model.safetensors, a sharded index, or a tensors-only
    pytorch_model.bin (never arbitrary pickle). Raises FileNotFoundError when none is there."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file() or index.is_file():
        from safetensors.torch import load_file
    if single.is_file():
        return single, load_file(str(single))
    if index.is_file():  # sharded by HF's save_pretrained for big models
        tensors = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(str(path / shard)))
        return index, tensors
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        try:  # weights_only: a checkpoint from elsewhere must never run code while unpickling
            tensors = torch.load(binary, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{binary}: refused, holds more than tensors (loaded with weights_only=True): {first}"
            ) from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{binary}: not a flat dict of tensors")
        return binary, tensors
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
