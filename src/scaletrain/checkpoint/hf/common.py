"""What the GPT-2 and Llama Hugging Face converters share: the atomic directory publish, safetensors / tensors-only
.bin reading, config.json reading and the vocabulary-padding inference.

Imports nothing from the per-architecture converters, so each of them (gpt2.py, llama.py) depends only on this.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

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


_ABSENT = object()


def _field(cfg_file: Path, table: dict, key: str, label: str, default) -> tuple[str, Any]:
    """(the field's printed name, its value or _ABSENT when missing or null and a default stands in);
    ValueError naming the file when a required field is missing."""
    name, value = f"{label}{key}", table.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{cfg_file}: missing {name!r}")
        return name, _ABSENT
    return name, value


def hf_int(cfg_file: Path, table: dict, key: str, lo: int, hi: int, default=_REQUIRED, label: str = "") -> int:
    """Integer field `key` of config.json (`table` is it, or a section of it named by `label`): an int, not a
    bool or a float, in [lo, hi]; `default` when absent or null (required without one). ValueError naming the
    file and the field otherwise."""
    name, value = _field(cfg_file, table, key, label, default)
    if value is _ABSENT:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _bad_value(cfg_file, name, value, f"an integer in [{lo}, {hi}]")
    return value


def hf_float(
    cfg_file: Path, table: dict, key: str, lo: float, hi: float, default=_REQUIRED, label: str = "", hi_open=False
) -> float:
    """Number field `key` of config.json: an int or float (not a bool), finite, in (lo, hi] ((lo, hi) with
    `hi_open`); `default` when absent or null (required without one). ValueError naming the file and field."""
    name, value = _field(cfg_file, table, key, label, default)
    if value is _ABSENT:
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


def publish_hf_dir(
    out_dir: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    who: str,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ `extra_files`, e.g. the tokenizer's: name -> bytes) into `out_dir`:
    a new or empty directory gets the whole export at once (a temp dir swapped in by rename); an existing export
    only with `overwrite`, file by file (see swap_in).

    Never deletes a directory: see new_tmp_dir for what is refused.
    """
    from safetensors import torch as st  # optional dependency: only exporting/importing needs it

    tmp = new_tmp_dir(out_dir, who, overwrite)
    try:
        config = with_token_ids(config, extra_files)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # transformers 4.x refuses safetensors files without a "format" entry in their metadata.
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_extra_files(tmp, extra_files)
        for name in ("config.json", "model.safetensors", *(extra_files or {})):
            fsync_path(tmp / name)
        swap_in(tmp, out_dir, who, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def with_token_ids(config: dict, extra_files: dict[str, bytes] | None) -> dict:
    """config.json's dict with the bos/eos/pad ids of the export's generation_config.json, when it has one."""
    generation = (extra_files or {}).get("generation_config.json")
    if generation is None:
        return config
    ids = json.loads(generation)
    return {**config, **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ids}}


def write_extra_files(directory: Path, extra_files: dict[str, bytes] | None) -> None:
    """Write an export's further files (plain names that _EXPORT_FILE lists) into its temporary directory."""
    for name, data in (extra_files or {}).items():
        if not _EXPORT_FILE.match(name):  # a name --overwrite would not replace, or a path: a caller's bug
            raise ValueError(f"export: {name!r} is not a file name an export writes")
        (directory / name).write_bytes(data)


# Every name an export writes (single file or sharded like save_pretrained, and the tokenizer's files): --overwrite
# replaces these, nothing else; of an earlier export's weight files, those this one does not write are removed.
_WEIGHT_FILE = re.compile(r"^(model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors)$")
_EXPORT_FILE = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors"
    r"|tokenizer\.json|tokenizer_config\.json|generation_config\.json)$"
)


def cwd_problem(out_dir: Path) -> str | None:
    """Why `out_dir` is never an export target for being the current directory or one above it, or None."""
    real, cwd = Path(os.path.realpath(out_dir)), Path(os.path.realpath(os.getcwd()))
    if real == cwd or real in cwd.parents:
        where = "the current directory" if real == cwd else f"above the current directory ({cwd})"
        return f"{out_dir} is {where}; export into a new directory"
    return None


def export_target_problem(out_dir: Path, overwrite: bool = False) -> str | None:
    """Why `out_dir` cannot receive an export, or None. Refused always: the current directory or one above it, a
    non-directory, a dangling link; without `overwrite`: any directory that holds something (an export goes into a
    new or empty directory)."""
    out_dir = Path(out_dir)
    problem = cwd_problem(out_dir)
    if problem:
        return problem
    if out_dir.is_symlink() and not out_dir.exists():
        return f"{out_dir} is a symbolic link to nothing ({os.readlink(out_dir)}); export into a new directory"
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        return f"{out_dir} exists and is not a directory; export into a new directory"
    try:
        entries = sorted(p.name for p in out_dir.iterdir())
    except OSError as exc:
        return f"{out_dir}: cannot list it ({exc.strerror})"
    if entries and not overwrite:
        return (
            f"{out_dir} is not empty (holds {entries[0]!r}{' and more' if len(entries) > 1 else ''}); export into "
            "a new or empty directory, or pass --overwrite to replace an earlier export's files there (others stay)"
        )
    # Checked before any file is replaced: a directory under an export file's name would stop the swap half-way.
    odd = [n for n in entries if _EXPORT_FILE.match(n) and (out_dir / n).is_dir() and not (out_dir / n).is_symlink()]
    if odd:
        return f"{out_dir / odd[0]} is a directory where the export writes a file; move it away first"
    return None


def new_tmp_dir(out_dir: Path, who: str, overwrite: bool = False) -> Path:
    """A fresh temporary directory beside `out_dir` to build an export in; FileExistsError (prefixed with `who`)
    when export_target_problem refuses `out_dir`. The directory gets the permissions of any new directory
    (0777 less the umask), not mkdtemp's 0700: it becomes the export itself."""
    problem = export_target_problem(out_dir, overwrite)
    if problem:
        raise FileExistsError(f"{who}: {problem}")
    real = Path(os.path.realpath(out_dir))
    real.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = real.parent / f".{real.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def swap_in(tmp: Path, out_dir: Path, who: str = "export_hf", overwrite: bool = False) -> None:
    """Put the complete export `tmp` (files already fsynced) in place of `out_dir`, deleting no directory.

    A missing or empty `out_dir` is replaced by `tmp` in one rename (a reader sees the whole export or nothing).
    With `overwrite` a non-empty `out_dir` gets each file by its own rename (os.replace), then loses the weight
    files of an earlier, differently sharded export; every other file in it stays.
    """
    fsync_path(tmp)
    # The export's own modes: safetensors creates its file 0600, the directory came from new_tmp_dir.
    mask = _umask()
    for path in tmp.iterdir():
        os.chmod(path, 0o666 & ~mask)
    real = Path(os.path.realpath(out_dir))
    if overwrite and real.is_dir() and any(real.iterdir()):
        names = sorted(p.name for p in tmp.iterdir())
        # The config last: while files are being replaced an old config describes the old weights' shapes.
        for name in sorted(names, key=lambda n: n == "config.json"):
            os.replace(tmp / name, real / name)
        for stale in real.iterdir():
            # Weights only: a tokenizer file that this export lacks (none found) may be one the user put there.
            if _WEIGHT_FILE.match(stale.name) and stale.name not in names and stale.is_file():
                stale.unlink()
        fsync_path(real)
        tmp.rmdir()
        return
    try:
        # rename() replaces an empty directory and fails on one that gained files since the check: never a loss.
        os.replace(tmp, real)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(
                f"{who}: {out_dir} changed while exporting ({exc.strerror}); nothing replaced"
            ) from None
        raise
    fsync_path(real.parent)


def _umask() -> int:
    """This process's umask (Linux reports it in /proc; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
