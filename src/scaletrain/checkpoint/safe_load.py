"""Reading a checkpoint that someone else may have written: every file is parsed as data, nothing runs.

A checkpoint's manifest only proves that files were not damaged by accident: whoever hands a checkpoint over
can rewrite the hashes too. So each file the loader reads is parsed by something that cannot execute code:

- `.metadata` (a pickle, DCP's format): an unpickler that resolves nothing but the exact (module, name) pairs DCP
  writes (`pickle_prescan.ALLOWED`, found by pickling real metadata of every layout this project saves and
  listing the globals with pickletools). A name is matched whole, so a dotted name such as `os.system` looked up through an
  allowed module is refused. Resolving names is not enough: BUILD on an allowed class or function would setattr
  on it for the whole process (`PosixPath._str` once made the run lock's release delete a file of the attacker's
  choosing). So `pickle_prescan.prescan` first runs the opcodes on a model stack and refuses state set on anything
  but a DCP metadata object the pickle itself just created, and any opcode DCP never writes; and after the load every
  allowed class, function and enum member is compared with a snapshot taken before it (restored and refused if
  anything changed). The vetted object is then handed to DCP through `VettedReader`, so DCP never unpickles the
  file itself. Before DCP loads, `checkpointer.entry_problem` checks that every entry the model and optimizer
  expect is there, as the kind they hold (DCP would silently load bytes beside a tensor it should fill).
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
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from scaletrain.checkpoint.pickle_prescan import ALLOWED, DCP, prescan
from scaletrain.checkpoint.store import TRAINER, CheckpointError

# The only files DCP metadata may point into: this checkpoint's own shards (no paths, no other files).
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataOnly(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else."""

    def find_class(self, module, name):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


# Attributes a BUILD slotstate (or anything else) could set on a class or function without touching its __dict__.
_SPECIAL = ("__dict__", "__bases__", "__name__", "__qualname__", "__code__", "__defaults__", "__kwdefaults__")


def _allowed_objects() -> dict[str, object]:
    """Every object the unpickler may hand out, plus the mutable state hanging off them, by a printable name."""
    import importlib

    found: dict[str, object] = {}
    for module, name in sorted(ALLOWED):
        try:
            found[f"{module}.{name}"] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # pathlib._local before Python 3.13
            continue
    enum: Any = found.get(DCP + "metadata._MEM_FORMAT_ENCODING")
    for member in list(enum or ()):  # shared singletons: a lookup returns these very objects
        found[f"{DCP}metadata.{member}"] = member
    return found


def _state_of(obj: object) -> dict[str, object]:
    """What of `obj` could be changed from outside: its __dict__ entries and the special attributes it has."""
    state: dict[str, object] = {}
    if hasattr(obj, "__dict__"):
        state.update({f"[{k}]": v for k, v in vars(obj).items()})
    for attr in _SPECIAL:
        if attr == "__dict__" and isinstance(obj, type):  # a fresh proxy on every access, and never assignable
            continue
        try:
            state[attr] = object.__getattribute__(obj, attr)
        except AttributeError:
            continue
    return state


def _same(before: object, after: object) -> bool:
    # A C type computes its __name__ anew on every access: equal immutable text is the same state.
    return before is after or (type(before) is type(after) is str and before == after)


def _snapshot() -> dict[str, tuple[object, dict[str, object]]]:
    """(object, state) of every allowed global, and the contents of torch's layout cache, for _changed."""
    from torch import serialization

    serialization._get_layout("torch.strided")  # fill the cache now, so that the load itself never changes it
    snap = {name: (obj, _state_of(obj)) for name, obj in _allowed_objects().items()}
    cache = serialization._get_layout.cache  # type: ignore[attr-defined]
    snap["torch.serialization._get_layout.cache"] = (cache, {f"[{k}]": v for k, v in cache.items()})
    return snap


_ABSENT = object()


def _now(name: str, obj: object) -> dict[str, object]:
    if name.endswith("_get_layout.cache"):
        return {f"[{k}]": v for k, v in obj.items()}  # type: ignore[attr-defined]
    return _state_of(obj)


def _diff(name: str, obj: object, before: dict[str, object]) -> list[str]:
    after = _now(name, obj)
    # "__dict__" sorts first: restoring a replaced __dict__ brings back its entries with it.
    return sorted(k for k in before.keys() | after.keys() if not _same(before.get(k, _ABSENT), after.get(k, _ABSENT)))


def _restore(name: str, obj: object, before: dict[str, object], diff: list[str]) -> None:
    if name.endswith("_get_layout.cache"):
        obj.clear()  # type: ignore[attr-defined]
        obj.update({k[1:-1]: v for k, v in before.items()})  # type: ignore[attr-defined]
        return
    # type's or object's own setattr: the class's or metaclass's could have been replaced by the attack.
    base: Any = type if isinstance(obj, type) else object
    for key in diff:
        attr = key[1:-1] if key.startswith("[") else key
        try:
            if key in before:
                base.__setattr__(obj, attr, before[key])
            else:
                base.__delattr__(obj, attr)
        except (AttributeError, TypeError):
            continue  # reported below if it is still different


def _changed(snap: dict[str, tuple[object, dict[str, object]]]) -> list[str]:
    """What differs from `snap` (compared by identity), e.g. "pathlib.PosixPath._str"; each is put back."""
    changed = []
    for name, (obj, before) in snap.items():
        diff = _diff(name, obj, before)
        if not diff:
            continue
        key = diff[0]
        if name.endswith("_get_layout.cache"):
            changed.append(f"{name}{key}")
        else:
            changed.append(f"{name}.{key[1:-1] if key.startswith('[') else key}")
        for _ in range(2):  # a second pass for entries a restored __dict__ did not bring back
            _restore(name, obj, before, diff)
            diff = _diff(name, obj, before)
            if not diff:
                break
        else:
            changed[-1] += " (could not be restored)"
    return changed


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


def _tensor_entry_ok(item) -> bool:
    """Whether a TensorStorageMetadata holds what the loaders read from it: a dtype and chunks of whole numbers."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    def dims(size) -> bool:
        return isinstance(size, torch.Size) and all(_is_int(n) for n in size)

    return (
        isinstance(item.properties, TensorProperties)
        and isinstance(item.properties.dtype, torch.dtype)
        and dims(item.size)
        and isinstance(item.chunks, list)
        and all(isinstance(c, ChunkStorageMetadata) and dims(c.offsets) and dims(c.sizes) for c in item.chunks)
    )


def read_metadata(directory: Path):
    """DCP Metadata of a checkpoint, unpickled with the restricted unpickler and checked; CheckpointError if not."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    path = Path(directory) / ".metadata"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    snap = _snapshot()
    try:
        prescan(data)
        md = _MetadataOnly(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure means the file is not ours
        raise CheckpointError(f"{path}: not DCP metadata ({_reason(exc)})") from None
    finally:
        # Belt and braces behind prescan: whatever the load did to an allowed class or function is undone here.
        changed = _changed(snap)
    if changed:
        raise CheckpointError(f"{path}: not DCP metadata (loading it changed {changed[0]}; restored)")
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
        if tensor and not _tensor_entry_ok(item):
            raise CheckpointError(f"{path}: not DCP metadata (entry {key!r} has malformed properties or chunks)")
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
    if not (md.storage_meta is None or isinstance(md.storage_meta, StorageMeta)):
        raise CheckpointError(f"{path}: not DCP metadata (storage_meta is a {type(md.storage_meta).__name__})")
    if not all(isinstance(index, MetadataIndex) for index in md.storage_data):
        raise CheckpointError(f"{path}: not DCP metadata (storage_data is not keyed by MetadataIndex)")
    extra = _undeclared(md)
    if extra:
        raise CheckpointError(f"{path}: not DCP metadata ({extra} is not a field of its class)")
    return md


def _undeclared(md) -> str | None:
    """The first attribute of a DCP object in `md` that its dataclass does not declare, e.g. "Metadata.x", or None.

    BUILD fills an instance's __dict__ with whatever the pickle says; an undeclared name there could shadow a
    method of the class for whoever calls it later.
    """
    import dataclasses

    objects = [md, *md.storage_data, *md.storage_data.values()]
    if md.storage_meta is not None:
        objects.append(md.storage_meta)
    for item in md.state_dict_metadata.values():
        objects.append(item)
        if hasattr(item, "chunks"):
            objects += [item.properties, *item.chunks]
    declared: dict[type, set[str]] = {}
    for obj in objects:
        cls = type(obj)
        if cls not in declared:
            declared[cls] = {f.name for f in dataclasses.fields(obj)}
        extra = sorted(set(vars(obj)) - declared[cls])
        if extra:
            return f"{cls.__name__}.{extra[0]}"
    return None


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
