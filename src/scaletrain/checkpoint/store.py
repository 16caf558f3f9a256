"""Atomic, verified checkpoint directories on a shared filesystem.

A checkpoint is `<dir>/step_<N>/` holding torch.distributed.checkpoint (DCP) shards, per-rank RNG files,
`trainer.json` (step, harness state, config, layout) and, written last, `manifest.json` listing every file with
its size and sha256. Saving goes to `step_<N>.tmp/`; each rank fsyncs and hashes the files it wrote, rank 0
writes the manifest, fsyncs it and renames the directory, then fsyncs the parent. So a directory named
`step_<N>` with a manifest is complete by construction; anything else (a `.tmp`, a missing or mismatching file)
is detected and never loaded silently.

The manifest catches damage, not intent: whoever hands a checkpoint over can rewrite it. Every file is therefore
read as data only (safe_load.py); nothing in a checkpoint is ever executed. Share weights through the
safetensors export.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from scaletrain.log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
TRAINER = "trainer.json"
READERS_LOCK = ".readers.lock"
"""In a checkpoints folder: readers (export) hold it shared while they read, prune() deletes only when it gets it
exclusively."""
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Every file a checkpoint may list: no paths, so a manifest cannot make verification read outside the directory.
_FILE = re.compile(r"^(\.metadata|trainer\.json|rng_rank\d+\.pt|__\d+_\d+\.distcp)$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


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


def _manifest_problem(manifest) -> str | None:
    """What is wrong with a parsed manifest's structure, or None."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "no 'files' table"
    for name, meta in files.items():
        if not _FILE.match(name):
            return f"lists {name!r}, not a checkpoint file"
        if not (
            isinstance(meta, dict)
            and type(meta.get("bytes")) is int
            and isinstance(meta.get("sha256"), str)
            and _SHA.match(meta["sha256"])
        ):
            return f"entry for {name!r} is not {{'bytes': int, 'sha256': hex}}"
    if not {".metadata", TRAINER} <= set(files):
        return f"does not list .metadata and {TRAINER}"
    return None


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
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({problem})")
    files = manifest["files"]
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
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    ]
    return [p for _, p in sorted(found, key=lambda step_path: step_path[0])]


def unpublished(root: Path) -> list[Path]:
    """Directories named step_<N> under `root` without a manifest: a publish that never finished (or a copy cut
    short); never loadable, and in the way of the next save of their step."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and not (p / MANIFEST).exists())


def move_aside(path: Path, why: str) -> Path:
    """Rename a damaged or incomplete checkpoint to `<name>.damaged-<time>` (kept for inspection); warn on stderr."""
    stamp = int(time.time())
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
    os.replace(path, aside)
    log.warning(f"{why}; moved to {aside}")
    return aside


@contextlib.contextmanager
def reading(root: Path) -> Iterator[None]:
    """Hold the checkpoints folder `root` for reading (a shared flock on its READERS_LOCK): prune() deletes nothing
    meanwhile, so a checkpoint of a live run cannot vanish under its reader. Blocks only while a prune is deleting.
    A folder where the lock cannot be created (read-only) has no pruner either, and is read without it."""
    root = Path(root)
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            fd = os.open(root / READERS_LOCK, flags, 0o644)
            break
        except OSError:
            continue
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # drops the lock


def _lock_for_pruning(root: Path) -> tuple[int | None, bool]:
    """(fd holding READERS_LOCK exclusively or None, whether a reader holds it: then prune must wait)."""
    try:
        fd = os.open(Path(root) / READERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None, False  # nobody can have created it to read either
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        return None, exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    return fd, False


def prune(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints and every stale `.tmp`; returns what was removed.

    While a reader holds the folder (reading(), e.g. an export of the live run) nothing is deleted: the next save
    prunes instead, so for a while the folder may hold more than `keep` checkpoints.
    """
    fd, busy = _lock_for_pruning(root)
    if busy:
        log.info(f"{root}: a reader holds {READERS_LOCK}; pruning at the next save")
        return []
    try:
        return _prune(root, keep, protect)
    finally:
        if fd is not None:
            os.close(fd)


def _prune(root: Path, keep: int, protect: Path | None) -> list[Path]:
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
