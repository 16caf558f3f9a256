"""Atomic, verified checkpoint directories on a shared filesystem.

A checkpoint is `<dir>/step_<N>/` holding torch.distributed.checkpoint (DCP) shards, per-rank RNG files,
`trainer.json` (step, harness state, config, layout) and, written last, `manifest.json` listing every file with
its size and sha256. Saving goes to `step_<N>.tmp/`; each rank fsyncs and hashes the files it wrote, rank 0
writes the manifest, fsyncs it and renames the directory, then fsyncs the parent. So a directory named
`step_<N>` with a manifest is complete by construction; anything else (a `.tmp`, a missing or mismatching file)
is detected and never loaded silently.

DCP's `.metadata` is a pickle. It is only ever unpickled after its sha256 matched the manifest, and first with
a restricted unpickler that admits nothing but DCP's metadata classes, so a foreign or tampered file is refused
rather than executed. Checkpoints are for resuming this job; share weights through the safetensors export.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
TRAINER = "trainer.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this model; the message names it."""


def step_dir(root: Path, step: int) -> Path:
    """Final directory of the checkpoint at `step`."""
    return Path(root) / f"step_{step:08d}"


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    """Flush a file's data to stable storage."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict) -> None:
    """Write JSON to `path` via a temporary name, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of files in `directory` (each fsynced first)."""
    out = {}
    for name in names:
        path = directory / name
        fsync_file(path)
        out[name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    return out


def publish(tmp: Path, final: Path, files: dict[str, dict], info: dict) -> None:
    """Rank 0: write the manifest into `tmp`, then atomically rename it to `final` (replacing nothing)."""
    if final.exists():
        raise CheckpointError(f"{final}: already exists; refusing to overwrite a complete checkpoint")
    write_json_durably(tmp / MANIFEST, {"format": "scaletrain-checkpoint-1", **info, "files": files})
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def verify(directory: Path, mode: str = "sha256") -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming the first missing or damaged file.

    mode "size" checks presence and sizes only (fast for TB-scale checkpoints), "sha256" also every hash.
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {MANIFEST}; the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, manifest says {meta['bytes']} (truncated or overwritten)")
        if mode == "sha256" and sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt)")
    return manifest


def complete_checkpoints(root: Path) -> list[Path]:
    """Directories named step_<N> under `root` that have a manifest, oldest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def prune(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints and every stale `.tmp`; returns what was removed."""
    removed = []
    complete = complete_checkpoints(root)
    for path in complete[:-keep] if keep > 0 else []:
        if path != protect:
            # Unpublish first (rename back to .tmp): a kill mid-delete must leave a discardable .tmp, never a
            # step_<N> with its manifest but missing files, nor one without a manifest that is never pruned.
            doomed = path.with_name(path.name + ".tmp")
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
    for path in Path(root).glob("step_*.tmp"):
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class _MetadataOnly(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
                ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "float64"), ("torch", "bool"),
                ("torch", "strided"), ("torch", "sparse_coo"), ("torch", "contiguous_format"),
                ("torch", "preserve_format"), ("torch", "channels_last"), ("torch", "device"),
                ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("enum", "Enum"), ("_codecs", "encode"), ("builtins", "bytearray"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module, name):
        if module.startswith(self._ALLOWED_MODULES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name.endswith(("dtype", "layout", "memory_format")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def read_metadata(directory: Path):
    """DCP Metadata of a checkpoint, unpickled with the restricted unpickler; CheckpointError when refused."""
    path = Path(directory) / ".metadata"
    try:
        return _MetadataOnly(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:  # any unpickling failure means the file is not ours
        raise CheckpointError(f"{path}: not DCP metadata ({type(exc).__name__}: {exc})") from None
