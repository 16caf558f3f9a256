"""Reading a checkpoint that someone else may have written: every file is parsed as data, nothing runs.

A checkpoint's manifest only proves that files were not damaged by accident: whoever hands a checkpoint over
can rewrite the hashes too. So each file the loader reads is parsed by something that cannot execute code:

- `.metadata` (a pickle, DCP's format): an unpickler that resolves nothing but the exact (module, name) pairs DCP
  writes (listed below, found by pickling real metadata of every layout this project saves and listing the
  globals with pickletools). A name is matched whole, so a dotted name such as `os.system` looked up through an
  allowed module is refused. The vetted object is then handed to DCP through `VettedReader`, so DCP never
  unpickles the file itself.
- non-tensor entries inside `__<rank>_<i>.distcp` (the optimizer's param_groups values): DCP's default planner
  would `torch.load(..., weights_only=False)` them; `SafeLoadPlanner` loads them with `weights_only=True`
  (tensors, numbers, strings, containers only). Tensors DCP already reads with `weights_only=True`.
- `rng_rank<r>.pt`: `torch.load(weights_only=True)` and a type check; `trainer.json` and `manifest.json`: JSON
  with their types checked.

Every refusal is a one-line CheckpointError that names the file.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from scaletrain.checkpoint.store import TRAINER, CheckpointError

_DCP = "torch.distributed.checkpoint."
# Exactly what DCP pickles into .metadata (torch 2.11-2.13; FSDP, TP, PP, LoRA and optimizer state alike), plus
# the dtypes a tensor of ours may have. pathlib moved PosixPath to pathlib._local in Python 3.13.
_ALLOWED = frozenset(
    {
        (_DCP + "metadata", "Metadata"),
        (_DCP + "metadata", "TensorStorageMetadata"),
        (_DCP + "metadata", "BytesStorageMetadata"),
        (_DCP + "metadata", "ChunkStorageMetadata"),
        (_DCP + "metadata", "TensorProperties"),
        (_DCP + "metadata", "MetadataIndex"),
        (_DCP + "metadata", "StorageMeta"),
        (_DCP + "metadata", "_MEM_FORMAT_ENCODING"),
        (_DCP + "filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        *(
            ("torch", dtype)
            for dtype in (
                "float32",
                "float64",
                "float16",
                "bfloat16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
                "float8_e4m3fn",
                "float8_e5m2",
            )
        ),
    }
)
# The only files DCP metadata may point into: this checkpoint's own shards (no paths, no other files).
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataOnly(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def _reason(exc: BaseException) -> str:
    """One line out of an exception (torch's weights_only refusal is a paragraph; its line that matters is kept)."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"it names {found.group(1)}, which only weights_only=False would run"
    for line in text.splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def read_metadata(directory: Path):
    """DCP Metadata of a checkpoint, unpickled with the restricted unpickler and checked; CheckpointError if not."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    path = Path(directory) / ".metadata"
    try:
        md = _MetadataOnly(io.BytesIO(path.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:  # any unpickling failure means the file is not ours
        raise CheckpointError(f"{path}: not DCP metadata ({_reason(exc)})") from None
    if (
        not isinstance(md, Metadata)
        or not isinstance(md.state_dict_metadata, dict)
        or not isinstance(md.storage_data, dict)
    ):
        raise CheckpointError(f"{path}: not DCP metadata (a {type(md).__name__}, not a complete Metadata)")
    for key, item in md.state_dict_metadata.items():
        tensor = isinstance(item, TensorStorageMetadata) and isinstance(item.size, torch.Size)
        if not isinstance(key, str) or not (tensor or isinstance(item, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: not DCP metadata (entry {key!r} is a {type(item).__name__})")
    for info in md.storage_data.values():
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(info.relative_path, str)
            or not _SHARD.match(info.relative_path)
        ):
            raise CheckpointError(
                f"{path}: not DCP metadata (points at {getattr(info, 'relative_path', info)!r}, "
                "not a shard of this checkpoint)"
            )
        if info.transform_descriptors:  # we never compress; a decoder is code we did not ask for
            raise CheckpointError(f"{path}: not DCP metadata (unexpected transforms {info.transform_descriptors})")
    return md


class VettedReader(FileSystemReader):
    """DCP's file reader, given the already-vetted Metadata so that it never unpickles `.metadata` itself."""

    def __init__(self, path: Path, metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata files, which we never write
            raise CheckpointError(f"{self.path}: per-rank metadata is not used by scaletrain checkpoints")
        md = self._metadata
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries are unpickled with weights_only=True."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self._directory = Path(directory)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            info = (self.metadata.storage_data or {}).get(read_item.storage_index) if self.metadata else None
            where = self._directory / (info.relative_path if info is not None else "?")
            raise CheckpointError(
                f"{where}: entry {fqn!r} is not plain data; refused to unpickle it ({_reason(exc)})"
            ) from None
        # What DefaultLoadPlanner.load_bytes does with the object it loaded.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(state_dict: dict, directory: Path, metadata, no_dist: bool = False) -> None:
    """dcp.load into `state_dict` from `directory` with the vetted `metadata`, nothing unpickled unrestricted."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # A single-process load is what we mean; DCP's note about it would break a one-line error on stderr.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(
            state_dict,
            storage_reader=VettedReader(directory, metadata),
            planner=SafeLoadPlanner(directory),
            no_dist=no_dist,
        )


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: not valid JSON ({_reason(exc)})") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_trainer(directory: Path) -> dict:
    """trainer.json of a checkpoint, with the types the loader relies on checked; CheckpointError naming it."""
    path = Path(directory) / TRAINER
    info = _load_json(path)
    problem = None
    if not isinstance(info, dict):
        problem = f"a JSON {type(info).__name__}, not an object"
    elif not _is_int(info.get("step")) or info["step"] < 0:
        problem = f"'step' is {info.get('step')!r}, not a step number"
    elif not isinstance(info.get("config"), dict):
        problem = "no 'config' object"
    elif "seed" in info and not _is_int(info["seed"]):
        problem = f"'seed' is {info['seed']!r}, not an integer"
    elif not isinstance(info.get("harness", {}), dict):
        problem = "'harness' is not an object"
    elif info.get("harness", {}).get("base") is True:
        # A llama2_70b_lora proxy base cached by an earlier version ({"steps", "evals", "base": true}): a finished
        # base that is only ever loaded as weights. Its harness state resumes nothing, so it is dropped.
        info["harness"] = {}
    elif info.get("harness"):
        h = info["harness"]
        for key in ("steps", "t_start", "mllog_bytes"):
            if not _is_int(h.get(key)) or h[key] < 0:
                problem = f"harness '{key}' is {h.get(key)!r}, not a non-negative integer"
                break
        else:
            evals = h.get("evals")
            if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
                problem = "harness 'evals' is not a list of objects"
            elif h["steps"] != info["step"]:
                problem = f"harness 'steps' {h['steps']} differs from 'step' {info['step']}"
    if problem:
        raise CheckpointError(f"{path}: not a scaletrain trainer state ({problem})")
    return info


def read_rng(path: Path) -> dict:
    """A rank's saved RNG state ({"cpu": uint8 tensor, maybe "cuda"}), loaded as tensors only."""
    try:
        rng = torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not an RNG state; refused to unpickle it ({_reason(exc)})") from None
    ok = (
        isinstance(rng, dict)
        and all(isinstance(rng.get(k), torch.Tensor) and rng[k].dtype == torch.uint8 for k in rng)
        and "cpu" in rng
    )
    if not ok:
        raise CheckpointError(f"{path}: not an RNG state (expected {{'cpu': uint8 tensor}})")
    return rng


def set_rng(path: Path, rng: dict) -> None:
    """Restore the RNG state read from `path` (a state of the wrong size is a one-line error)."""
    try:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: not an RNG state of this torch ({_reason(exc)})") from None
