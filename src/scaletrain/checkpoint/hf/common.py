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
import stat
import tempfile
from pathlib import Path

import torch

from scaletrain.config import ModelConfig
from scaletrain.config_io import load_json_bounded
from scaletrain.config_model import model_problems

# Bounds on config.json's shape fields, checked before any shape table is built (10**7 layers hung the import):
# far above every published model (Llama 3.1 405B: 126 layers, hidden 16,384, MLP 53,248, vocabulary 128,256,
# context 131,072; DeepSeek-V3's vocabulary 129,280), far below what makes a per-layer loop or a size product hang.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 18
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
MAX_ROPE = 1e12
"""Largest rotary base or scaling factor accepted (published bases reach 10**8)."""
_REQUIRED = object()


def hf_file(directory: Path, name: str, listed_in: Path | None = None) -> Path:
    """`directory/name`, checked before anything opens it: a plain file name (no separator, no `..`), a regular
    file (a FIFO blocks its reader forever), and, through symlinks, inside `directory` -- or inside the `blobs/`
    of a Hugging Face hub cache, whose `snapshots/<revision>/` directories are links into it.

    ValueError naming the file (and `listed_in`, the index that named it) otherwise.
    """
    listed = f" (listed in {listed_in.name})" if listed_in is not None else ""
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
        raise ValueError(f"{listed_in or directory}: {name!r} is not a file name in {directory}")
    path = directory / name
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file{listed}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc}){listed}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file{listed}")
    real, home = path.resolve(), directory.resolve()
    roots = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
    if not any(real.is_relative_to(root) for root in roots):
        raise ValueError(f"{path}: links to {real}, outside {directory}{listed}")
    return path


def read_config_json(path: Path) -> tuple[Path, dict]:
    """(path of config.json, its parsed contents) of the HF directory `path`; FileNotFoundError if it has none,
    ValueError (one line naming it) when it is not a regular file inside the directory, not a JSON object, too
    deep or too big."""
    cfg_file = path / "config.json"
    if not os.path.lexists(cfg_file):
        raise FileNotFoundError(f"{cfg_file}: no such file")
    hf = load_json_bounded(hf_file(path, "config.json"), max_bytes=1 << 20)
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file}: not a JSON object (a Hugging Face config.json is one)")
    return cfg_file, hf


def read_weight_map(index: Path) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of a sharded safetensors index; ValueError naming it when it
    is not one. The shard names are not checked here: `hf_file` does that before a shard is opened."""
    doc = load_json_bounded(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: not a safetensors index (needs a weight_map of tensor -> file)")
    return weight_map


def _bad_value(cfg_file: Path, key: str, value, need: str):
    raise ValueError(f"{cfg_file}: {key}={value!r} is not supported (need {need})")


def hf_int(cfg_file: Path, table: dict, key: str, lo: int, hi: int, default=_REQUIRED, label: str = "") -> int:
    """Integer field `key` of config.json (`table` is it, or a section of it named by `label`): an int, not a
    bool or a float, in [lo, hi]; `default` when absent or null (required without one). ValueError naming the
    file and the field otherwise."""
    value = table.get(key)
    name = f"{label}{key}"
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{cfg_file}: missing {name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _bad_value(cfg_file, name, value, f"an integer in [{lo}, {hi}]")
    return value


def hf_float(
    cfg_file: Path, table: dict, key: str, lo: float, hi: float, default=_REQUIRED, label: str = "", hi_open=False
) -> float:
    """Number field `key` of config.json: an int or float (not a bool), finite, in (lo, hi] ((lo, hi) with
    `hi_open`); `default` when absent or null (required without one). ValueError naming the file and field."""
    value = table.get(key)
    name = f"{label}{key}"
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{cfg_file}: missing {name!r}")
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (lo < value < hi if hi_open else lo < value <= hi):
        _bad_value(cfg_file, name, value, f"a finite number in ({lo:g}, {hi:g}{')' if hi_open else ']'}")
    return float(value)


def hf_section(cfg_file: Path, table: dict, key: str) -> dict:
    """Object field `key` of config.json ({} when absent or null); ValueError naming the file otherwise."""
    value = table.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        _bad_value(cfg_file, key, value, "a JSON object")
    return value


def check_model_config(cfg_file: Path, cfg: ModelConfig) -> ModelConfig:
    """`cfg` (read from `cfg_file`) when our model can be built from it; ValueError naming the file with the first
    problem (`config.model_problems`) otherwise."""
    problems = list(model_problems(cfg))
    if problems:
        raise ValueError(f"{cfg_file}: {problems[0]} is not supported")
    return cfg


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
        return single, load_file(str(hf_file(path, single.name)))
    if index.is_file():  # sharded by HF's save_pretrained for big models
        tensors = {}
        weight_map = read_weight_map(hf_file(path, index.name))
        # Every shard checked before the first is read: a bad name fails fast, not after gigabytes.
        shards = [hf_file(path, shard, index) for shard in sorted(set(weight_map.values()))]
        for shard in shards:
            tensors.update(load_file(str(shard)))
        return index, tensors
    binary = path / "pytorch_model.bin"
    if binary.is_file():
        hf_file(path, binary.name)
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
