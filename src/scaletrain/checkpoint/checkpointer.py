"""Save and load a training run's full state with torch.distributed.checkpoint, in any parallel layout.

What is saved: every model part's parameters and every optimizer's state (flattened per parameter name, so a
checkpoint written by FSDP x TP on 4 ranks loads into 1 rank or a pipeline: DCP reshards), the trainer and
benchmark-harness state (`trainer.json`: step, consumed samples, evaluations, the MLLOG offset, config,
layout) and each rank's RNG state. The data position needs nothing else: the sample order is a pure function of
seed and position. Directory handling (atomic publish, manifest, verification) is in `store.py`.

The output layer is tied to the embedding. Without pipeline parallelism one tensor has two names; with it, the
first and last stage each hold a copy. Saves always carry both names (`embed.tok.weight`, `head.weight`) for
the weight and its optimizer state, so any layout finds what it needs.
"""

from __future__ import annotations

import errno
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scaletrain.checkpoint import store
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.diskfull import disk_full, writing
from scaletrain.model.lora import is_lora_param

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def _options() -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _strict_options(strict: bool) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)


def _dcp_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _cause(exc: BaseException) -> str:
    """The root error of a failed save in one line (DCP wraps per-rank exceptions in CheckpointException)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))
        if isinstance(exc, tuple) and exc and isinstance(exc[0], BaseException):  # (exception, traceback summary)
            exc = exc[0]
    if isinstance(exc, CheckpointError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        # The symbolic name too (ENOSPC, EFBIG, EDQUOT): it is what an operator searches for.
        code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
        return f"{code} ({exc.strerror})" if code else exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Checkpointer:
    """Checkpoints of one run under `root`; every method is called on all ranks in lockstep."""

    def __init__(self, cfg, run_dir: Path):
        k = cfg.checkpoint
        self.cfg = cfg
        self.root = Path(k.dir) if k.dir else Path(run_dir) / "checkpoints"
        # "auto": the trainer sets the interval at run start (`set_interval`), from the failure model.
        self.auto = k.interval_steps == "auto"
        self.interval_steps = 0 if self.auto else int(k.interval_steps)
        self.interval_s = k.interval_minutes * 60.0
        self.keep, self.async_save, self.verify_mode = k.keep, k.async_save, k.verify
        self.enabled = self.interval_steps > 0 or self.interval_s > 0 or self.auto
        # A run asked for checkpoints (a trigger, or a folder named for them) keeps its final state too.
        self.save_final = self.enabled or bool(k.dir) or k.final
        self.last_step = 0
        self.last_time = time.monotonic()
        # async save in flight: (future, tmp, final, info, my_files)
        self._pending: tuple[Any, Path, Path, dict, list[str]] | None = None
        self._async_group = None
        self.lora = getattr(getattr(cfg, "lora", None), "rank", 0) > 0  # adapter-only state (see state_dict)

    # ------------------------------------------------------------------ state
    def state_dict(self, parts, optimizers) -> tuple[dict, list[tuple[dict, dict]]]:
        """One flat dict for DCP (model and optimizer entries) and the per-part (model, optim) dicts."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        flat: dict[str, Any] = {}
        per_part: list[tuple[dict, dict]] = []
        for part, opt in zip(parts, optimizers):
            msd = get_model_state_dict(part)
            if self.lora:
                # LoRA: the frozen base is rebuilt from its source (seed init / HF import), never saved;
                # only the adapters (and, through the optimizer, their moments) are.
                msd = {k: v for k, v in msd.items() if is_lora_param(k)}
            osd = get_optimizer_state_dict(part, opt, options=_options())
            flat.update({f"model.{k}": v for k, v in msd.items()})
            flat.update({f"optim.{k}": v for k, v in osd.items()})
            if getattr(part, "head_is_tied", False):
                # One tensor, two names: file its optimizer state under the head's name too (module docstring).
                # Only in the DCP dict: the optimizer itself knows the parameter once.
                for key in [k for k in osd if ".embed.tok.weight" in k]:
                    flat["optim." + key.replace(".embed.tok.weight", ".head.weight")] = osd[key]
            per_part.append((msd, osd))
        return flat, per_part

    def set_interval(self, steps: int, seconds: float) -> None:
        """The interval checkpoint.interval_steps="auto" resolved to: a step trigger of `steps` (> 0), or else a
        time trigger of `seconds` (when the run has no predicted step time); an interval_minutes given as well
        stays, the earlier trigger saving first."""
        if steps > 0:
            self.interval_steps = steps
        elif seconds > 0 and not self.interval_s:
            self.interval_s = seconds

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether to save now (same answer on every rank: rank 0's clock decides the time trigger)."""
        if not self.enabled:
            return False
        due = (self.interval_steps > 0 and step - self.last_step >= self.interval_steps) or (
            self.interval_s > 0 and time.monotonic() - self.last_time >= self.interval_s
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([1 if due else 0], dtype=torch.int32, device=device)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def save(self, step: int, parts, optimizers, trainer_state: dict) -> Path:
        """Write step_<step>; with async_save return once staged and publish on the next save or at finish().

        A failed save removes its `.tmp` and raises one line: DiskFullError (`no space left on device while writing
        …/step_<N>.tmp`) for a full disk or quota, CheckpointError naming the OS error otherwise.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.finish()  # publish the previous async save first: at most one in flight
        final = store.step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        rank = _rank()
        if rank == 0:
            if final.exists() and not (final / store.MANIFEST).exists():
                # A publish cut short (or a partial copy): never loadable, so it may not block this save.
                store.move_aside(final, f"{final}: incomplete checkpoint (no {store.MANIFEST}) in the way of this save")
            if final.exists():
                raise CheckpointError(f"{final}: already exists; refusing to overwrite a complete checkpoint")
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)  # left by a crash mid-save: never published, safe to discard
            with writing(tmp, f"checkpoint at step {step}; earlier checkpoints are untouched"):
                tmp.mkdir(parents=True)
        self._barrier()
        flat, _ = self.state_dict(parts, optimizers)
        info = {"step": step, **trainer_state}
        try:
            my_files = self._write_sidecars(tmp, info, rank)
            writer = FileSystemWriter(tmp, sync_files=True)
            if self.async_save and not dist.is_initialized():
                # DCP's writer thread warns too, after the block below has restored the filters: for the process.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            with warnings.catch_warnings():
                # One process without a process group is a supported case, not worth a warning on every save.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                if self.async_save:
                    if self._async_group is None and dist.is_initialized():
                        self._async_group = dist.new_group(backend="gloo")  # DCP's collectives off training's
                    future = dcp.async_save(flat, storage_writer=writer, process_group=self._async_group)
                    self._pending = (future, tmp, final, info, my_files)
                else:
                    dcp.save(flat, storage_writer=writer)
                    self._publish(tmp, final, info, my_files)
        except (Exception, _dcp_exception()) as exc:  # OSError, or DCP's wrapper (a BaseException) around it
            self._fail(exc, tmp, step)
            raise CheckpointError(
                f"checkpoint save at step {step} into {tmp} failed: {_cause(exc)}; earlier checkpoints are untouched"
            ) from None
        self.last_step, self.last_time = step, time.monotonic()
        return final

    def finish(self) -> None:
        """Wait for an asynchronous save and publish it (call at run end); fails as save() does."""
        if self._pending is None:
            return
        future, tmp, final, info, my_files = self._pending
        self._pending = None
        try:
            future.result()
            self._publish(tmp, final, info, my_files)
        except (Exception, _dcp_exception()) as exc:
            self._fail(exc, tmp, info["step"])
            raise CheckpointError(
                f"asynchronous checkpoint save into {tmp} failed: {_cause(exc)}; earlier checkpoints are untouched"
            ) from None

    def _write_sidecars(self, tmp: Path, info: dict, rank: int) -> list[str]:
        names = []
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        # Through a Python file: torch's C++ writer on a path would drop the errno of a full disk.
        with open(tmp / f"rng_rank{rank}.pt", "wb") as f:
            torch.save(rng, f)
        names.append(f"rng_rank{rank}.pt")
        if rank == 0:
            store.write_json_durably(tmp / store.TRAINER, info)
            names.append(store.TRAINER)
        return names

    def _publish(self, tmp: Path, final: Path, info: dict, my_files: list[str]) -> None:
        rank = _rank()
        # DCP names each rank's shard file __<rank>_<i>.distcp; rank 0 also owns .metadata.
        mine = my_files + sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            mine.append(".metadata")
        hashes = store.hash_files(tmp, mine)
        gathered: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(gathered, hashes)
        else:
            gathered = [hashes]
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            store.publish(tmp, final, files, {"step": info["step"], "world_size": len(gathered)})
            store.prune(self.root, self.keep, protect=final)
        self._barrier()

    def _fail(self, exc: BaseException, tmp: Path, step: int) -> None:
        """Remove the failed save's `tmp`; a full disk is raised as DiskFullError (asked before the removal frees
        space: the check may look at the free space the failure left)."""
        full = disk_full(
            exc, tmp, f"checkpoint at step {step}; the partial save was removed, earlier checkpoints are untouched"
        )
        self._abandon(tmp)
        if full is not None:
            raise full from None

    def _abandon(self, tmp: Path) -> None:
        if _rank() == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    # ------------------------------------------------------------------ load
    def find(self, resume: str) -> Path | None:
        """The checkpoint `resume` names ("none", "auto" or a path), verified; same answer on every rank.

        "auto" takes the newest complete checkpoint; one that fails verification is reported and skipped for the
        one before it, never loaded. An explicit path that fails is an error.
        """
        if resume in ("", "none"):
            return None
        found, problem = None, None
        if _rank() == 0:
            try:
                if resume == "auto":
                    # Set aside (kept for inspection), never loaded: left in place, a damaged or unpublished
                    # step_<N> would block the save of its step.
                    for path in store.unpublished(self.root):
                        store.move_aside(path, f"skipping incomplete checkpoint {path} (no {store.MANIFEST})")
                    for path in reversed(store.complete_checkpoints(self.root)):
                        try:
                            store.verify(path, self.verify_mode)
                            found = str(path)
                            break
                        except CheckpointError as exc:
                            store.move_aside(path, f"skipping damaged checkpoint: {exc}")
                else:
                    store.verify(Path(resume), self.verify_mode)
                    found = str(resume)
            except CheckpointError as exc:
                problem = str(exc)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [found, problem]
            dist.broadcast_object_list(box, src=0)
            found, problem = box
        if problem:
            raise CheckpointError(problem)
        return Path(found) if found else None

    def load(self, path: Path, parts, optimizers) -> dict:
        """Load model and optimizer state from `path` into this layout; returns trainer.json.

        Every file is read as data only (safe_load.py): a hostile checkpoint is a one-line CheckpointError.
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from scaletrain.checkpoint import safe_load

        path = Path(path)
        info = safe_load.read_trainer(path)
        metadata = safe_load.read_metadata(path)
        flat, per_part = self.state_dict(parts, optimizers)
        check_shapes(path, flat, metadata, gather=True)
        load_state(flat, path, metadata)
        for part, opt, (msd, osd) in zip(parts, optimizers, per_part):
            set_model_state_dict(part, msd, options=_strict_options(not self.lora))
            set_optimizer_state_dict(part, opt, osd, options=_options())
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: training draws no random numbers
            safe_load.set_rng(rng_file, safe_load.read_rng(rng_file))
        if _rank() == 0:
            from scaletrain.checkpoint.resume import warn_changed_settings

            warn_changed_settings(path, info, self.cfg)
        self.last_step, self.last_time = int(info["step"]), time.monotonic()
        return info


def check_shapes(path: Path, flat: dict, metadata: Metadata, gather: bool) -> None:
    """The checkpoint holds exactly this model's tensors, with these shapes, and every entry `flat` expects (model
    and optimizer alike) as what `flat` holds (entry_problem); one-line CheckpointError if not.

    `gather`: this rank holds only part of the model (pipeline stages): compare the union over ranks.
    """
    _check_model_shapes(path, flat, metadata, gather)
    problem = entry_problem(path, flat, metadata)
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        # Each rank checks its own entries; every rank must refuse together, or the others wait in DCP forever.
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise CheckpointError(problem)


def entry_problem(path: Path, flat: dict, metadata: Metadata) -> str | None:
    """Why `metadata` cannot fill `flat` exactly, naming `.metadata` and the entry, or None.

    DCP itself would load an entry saved as bytes into a tensor's place by replacing the tensor in the flat dict,
    so the optimizer keeps its fresh state (no error, a wrong resume); and chunks that do not cover a tensor leave
    the rest of it as initialised. Every expected key must be present, a tensor where `flat` holds a tensor (same
    shape, same kind of dtype: precision may change between runs), bytes where it holds anything else.
    """
    import math

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    where = Path(path) / ".metadata"
    meta = metadata.state_dict_metadata
    for key, value in flat.items():
        holder = "model" if key.startswith("model.") else "optimizer"
        saved = meta.get(key)
        if saved is None:
            return f"{where}: no entry {key!r}, which this {holder} holds (saved by another {holder}, or edited)"
        if not isinstance(value, torch.Tensor):
            if not isinstance(saved, BytesStorageMetadata):
                return f"{where}: entry {key!r} is saved as a tensor, this {holder} holds a {type(value).__name__}"
            continue
        have = f"the {list(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor this {holder} holds"
        if not isinstance(saved, TensorStorageMetadata):
            return f"{where}: entry {key!r} is saved as bytes, not as {have}"
        if tuple(saved.size) != tuple(value.shape):
            return f"{where}: entry {key!r} has shape {list(saved.size)}, not that of {have}"
        dtype = saved.properties.dtype
        if (dtype.is_floating_point, dtype.is_complex, dtype == torch.bool) != (
            value.dtype.is_floating_point,
            value.dtype.is_complex,
            value.dtype == torch.bool,
        ):
            return f"{where}: entry {key!r} is saved as {dtype}, not as {have}"
        covered = 0
        for chunk in saved.chunks:
            inside = len(chunk.offsets) == len(chunk.sizes) == value.dim() and all(
                0 <= o and 0 <= n and o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, value.shape)
            )
            if not inside:
                return f"{where}: entry {key!r} has a chunk at {list(chunk.offsets)} outside its shape"
            covered += math.prod(chunk.sizes)
        if covered != value.numel():
            return f"{where}: entry {key!r}'s chunks hold {covered} elements, not the {value.numel()} of {have}"
    return None


def _check_model_shapes(path: Path, flat: dict, metadata: Metadata, gather: bool) -> None:
    meta = metadata.state_dict_metadata
    saved = {k for k in meta if k.startswith("model.")}
    have = {k for k in flat if k.startswith("model.")}
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sorted(have))
        have = set().union(*map(set, parts))
    if len(saved) != len(have):
        extra = sorted(saved - have) or sorted(have - saved)
        where = "only in the checkpoint" if saved - have else "only in this model"
        raise CheckpointError(
            f"{path}: the checkpoint's model has {len(saved)} tensors, the model being built "
            f"has {len(have)} (e.g. {extra[0][6:]!r} {where}; model.* config differs from "
            "the checkpoint's)"
        )
    for key, value in flat.items():
        if not key.startswith("model.") or not hasattr(value, "shape"):
            continue
        if key not in meta:
            raise CheckpointError(f"{path}: has no tensor {key[6:]!r}; it was saved from another model")
        if not hasattr(meta[key], "size"):  # saved as bytes: not a config difference, entry_problem names it
            continue
        saved_shape = tuple(getattr(meta[key], "size", ()))
        if saved_shape != tuple(value.shape):
            raise CheckpointError(
                f"{path}: {key[6:]} has shape {list(saved_shape)}, this model has "
                f"{list(value.shape)} (model.* config differs from the checkpoint's)"
            )


def load_state(flat: dict, path: Path, metadata: Metadata, no_dist: bool = False) -> None:
    """Read checkpoint `path` into `flat` in place (safe_load.load_dcp: data only); any failure, DCP's per-rank
    ones included, is one CheckpointError that names the checkpoint."""
    from scaletrain.checkpoint import safe_load

    try:
        safe_load.load_dcp(flat, path, metadata, no_dist=no_dist)
    except (Exception, _dcp_exception()) as exc:
        cause = _cause(exc)
        raise CheckpointError(cause if str(path) in cause else f"{path}: load failed: {cause}") from None


def trainer_state(step: int, cfg, layout, harness: dict | None) -> dict:
    """What trainer.json records besides the step."""
    return {
        "consumed_samples": step * cfg.train.global_batch_size,
        "seed": cfg.train.seed,
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "harness": harness or {},
        "config": cfg.to_dict(),
        "pid": os.getpid(),
        "time": time.time(),
    }
