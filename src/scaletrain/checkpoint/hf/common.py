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


def publish_hf_dir(
    out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], who: str, overwrite: bool = False
) -> Path:
    """Write config.json + model.safetensors into `out_dir`: a new or empty directory gets the whole export at once
    (a temp dir swapped in by rename); an existing export only with `overwrite`, file by file (see swap_in).

    Never deletes a directory: see new_tmp_dir for what is refused.
    """
    from safetensors import torch as st  # optional dependency: only exporting/importing needs it

    tmp = new_tmp_dir(out_dir, who, overwrite)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # transformers 4.x refuses safetensors files without a "format" entry in their metadata.
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "model.safetensors"):
            fsync_path(tmp / name)
        swap_in(tmp, out_dir, who, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# Every name an export writes (single file or sharded like save_pretrained): --overwrite replaces these, nothing else.
_EXPORT_FILE = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors)$"
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
    With `overwrite` a non-empty `out_dir` gets each file by its own rename (os.replace), then loses the export
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
            if _EXPORT_FILE.match(stale.name) and stale.name not in names and stale.is_file():
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
