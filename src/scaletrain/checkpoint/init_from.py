"""Start weights from elsewhere: the frozen base of a LoRA run (or any run's initial weights).

`checkpoint.init_from` names a scaletrain checkpoint (a step directory, a checkpoints/ folder or a run directory:
its newest complete checkpoint) or a Hugging Face directory (config.json + model.safetensors, a sharded
model.safetensors.index.json or a tensors-only pytorch_model.bin; GPT-2 or Llama). In a distributed run a
safetensors directory is read sharded: each rank reads only the slices its own shards hold (hf/sharded.py).
Otherwise every rank reads the full state on the CPU and keeps its own shards (`set_model_state_dict` with a full
state dict), so any layout can start from any saved one. Loading happens in the untimed init, as MLPerf's
llama2_70b_lora loads its base model there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from scaletrain.checkpoint import store
from scaletrain.checkpoint.checkpointer import check_shapes, load_state
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.config import Config, ConfigError, ModelConfig, from_dict
from scaletrain.model.build import build_model
from scaletrain.model.lora import apply_lora, init_lora, is_lora_param, merge_lora

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

    from scaletrain.model.build import Decoder

# Fields that decide tensor shapes and meaning; seq_len may differ (RoPE needs no table; gpt3's table is checked
# through its shape). The rotary frequencies change what the weights mean, the llama3 factors when both scale.
_SHAPE_FIELDS = ("arch", "n_layers", "d_model", "n_heads", "kv_heads", "head_size", "ffn_size", "padded_vocab")
_ROPE_FIELDS = ("rope_base", "rope_kind")
_LLAMA3_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len")


def _newest_checkpoint(path: Path) -> Path | None:
    if (path / store.MANIFEST).exists():
        return path
    for root in (path / "checkpoints", path):
        found = store.complete_checkpoints(root)
        if found:
            return found[-1]
    return None


def read_base_state(path: str | Path, _chain: tuple = ()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, plain full state dict) of the weights at `path`; adapters merged in if it has any.

    A scaletrain checkpoint is read as data only (checkpoint/safe_load.py), like a resume.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint.init_from={path}: no such file or directory")
    if _is_hf_dir(p):
        return _read_hf(p)
    ckpt = _newest_checkpoint(p)
    if ckpt is None:
        raise CheckpointError(
            f"checkpoint.init_from={path}: neither a Hugging Face directory nor a directory "
            "holding a complete scaletrain checkpoint"
        )
    cfg, model = load_full_model(ckpt, _chain=_chain)
    if cfg.lora.rank > 0:
        merge_lora(model)
    return cfg.model, {k: v.detach() for k, v in model.state_dict().items()}


def load_full_model(path: Path, verify_mode: str = "sha256", _chain: tuple = ()) -> tuple[Config, torch.nn.Module]:
    """(Config, plain model (GPT or Llama) with the checkpoint's weights) in this process, whatever layout saved it.

    Reads every file as data only (safe_load.py). `_chain`: checkpoints already being loaded (a LoRA checkpoint
    names its base in its config), so a loop of init_from references is an error, not a recursion. Lives here,
    not in checkpointer.py, because a LoRA checkpoint's base is read back through read_base_state.
    """
    from scaletrain.checkpoint import safe_load  # lazy: torch.distributed.checkpoint takes ~1 s to import

    path = Path(path)
    if str(path.resolve()) in _chain:
        raise CheckpointError(f"{path}: checkpoint.init_from leads back to this checkpoint (a loop)")
    store.verify(path, verify_mode)
    info = safe_load.read_trainer(path)
    try:
        cfg = from_dict(info["config"])
    except ConfigError as exc:
        raise CheckpointError(f"{path / store.TRAINER}: {exc}") from None
    metadata = safe_load.read_metadata(path)
    model = cast("Decoder", build_model(cfg.model, seed=int(info.get("seed", cfg.train.seed))))
    if cfg.lora.rank > 0:
        # An adapter-only checkpoint: the base is checkpoint.init_from or else the seed init (what the trainer froze); the adapters
        # are loaded below. Callers that want plain weights use model.lora.merge_lora.
        if cfg.checkpoint.init_from:
            base = read_base_state(cfg.checkpoint.init_from, _chain=(*_chain, str(path.resolve())))
            model.load_state_dict(base[1], strict=False)
        apply_lora(model, cfg.lora)
        init_lora(model, int(info.get("seed", cfg.train.seed)))
    flat = {f"model.{k}": v for k, v in model.state_dict().items() if cfg.lora.rank <= 0 or is_lora_param(k)}
    check_shapes(path, flat, metadata, gather=False)
    load_state(flat, path, metadata, no_dist=True)
    model.tie_weights()
    return cfg, model


def _is_hf_dir(p: Path, safetensors_only: bool = False) -> bool:
    weights = ["model.safetensors", "model.safetensors.index.json"] + (
        [] if safetensors_only else ["pytorch_model.bin"]
    )
    return (p / "config.json").is_file() and any((p / name).is_file() for name in weights)


def _one_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def load_init_weights(parts: list[torch.nn.Module], want: ModelConfig, where: str) -> None:
    """Load `checkpoint.init_from` into this rank's model parts (built from `want`): a Hugging Face safetensors
    directory in a distributed run is read sharded (each rank only its slices), anything else in full.

    One-line CheckpointError naming the path (and the file) for anything missing, malformed or mismatched.
    """
    import torch.distributed as dist

    p = Path(where)
    if _is_hf_dir(p):
        from scaletrain.checkpoint.hf.sharded import hf_model_config

        # config.json alone first: a model that does not match (or cannot be built) is refused before a byte of
        # its weights is read or a shape table built from it.
        try:
            _, have = hf_model_config(p)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"checkpoint.init_from={p}: {_one_line(exc)}") from None
        check_compatible(want, have, where, what=str(p / "config.json"))
    if dist.is_initialized() and dist.get_world_size() > 1 and _is_hf_dir(p, safetensors_only=True):
        from safetensors import SafetensorError

        from scaletrain.checkpoint.hf.sharded import load_hf_sharded

        try:
            load_hf_sharded(parts, p)
        except (ValueError, TypeError, KeyError, OSError, SafetensorError) as exc:
            raise CheckpointError(f"checkpoint.init_from={p}: {_one_line(exc)}") from None
        return
    saved, state = read_base_state(where)
    check_compatible(want, saved, where)
    with torch.no_grad():
        load_base_weights(parts, state)


def _read_hf(p: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError

    try:
        from scaletrain.checkpoint.hf import importer
        from scaletrain.checkpoint.hf.common import read_config_json

        _, hf = read_config_json(p)
        return importer(hf.get("model_type", ""))(p)
    except (ValueError, TypeError, KeyError, OSError, SafetensorError) as exc:  # not what it claims to be
        raise CheckpointError(f"checkpoint.init_from={p}: {_one_line(exc)}") from None


def check_compatible(want: ModelConfig, have: ModelConfig, where: str, what: str = "saved model") -> None:
    """One-line CheckpointError when the saved model (`what`: its description in the message) differs from the
    configured one in shape, rotary frequencies or normalisation epsilon."""
    fields = _SHAPE_FIELDS + _ROPE_FIELDS + (_LLAMA3_FIELDS if want.rope_kind == have.rope_kind == "llama3" else ())
    diffs = [f"{f} {getattr(have, f)} != {getattr(want, f)}" for f in fields if getattr(have, f) != getattr(want, f)]
    # The weights were trained with their normalisation epsilon: running them with another is a different model.
    if not math.isclose(have.ln_eps, want.ln_eps, rel_tol=1e-6):
        diffs.append(f"ln_eps {have.ln_eps} != {want.ln_eps}")
    if diffs:
        raise CheckpointError(f"checkpoint.init_from={where}: {what} does not match model.*: {', '.join(diffs)}")


def load_base_weights(parts: list[torch.nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Copy a full plain state dict into this rank's (possibly sharded, possibly pipeline-cut) model parts.

    Keys a part does not hold (other pipeline stages) and parameters the state lacks (LoRA adapters) are skipped.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for part in parts:
        own = part.state_dict()
        subset: dict[str, ValueType] = {k: v for k, v in state.items() if k in own}
        missing = [k for k in own if k not in state and "lora_" not in k]
        if missing:
            raise CheckpointError(
                f"checkpoint.init_from: saved weights lack {missing[0]} (and {len(missing) - 1} more)"
            )
        set_model_state_dict(part, subset, options=StateDictOptions(full_state_dict=True, strict=False))
        tie_weights = getattr(part, "tie_weights", None)
        if tie_weights is not None:
            tie_weights()


def _verify_spread(path: Path, verify_mode: str) -> None:
    """store.verify on every rank, but each file's sha256 hashed by one rank (round robin): no rank reads all."""
    import torch.distributed as dist

    manifest = store.verify(path, "size")
    problem = ""
    if verify_mode == "sha256":
        rank, world = dist.get_rank(), dist.get_world_size()
        for i, (name, meta) in enumerate(sorted(manifest["files"].items())):
            if i % world == rank and store.sha256(path / name) != meta["sha256"]:
                problem = problem or f"{path / name}: sha256 differs from the manifest (corrupt)"
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    first = next((p for p in found if p), "")
    if first:
        raise CheckpointError(first)


def load_sharded_model(path: Path, verify_mode: str = "sha256") -> tuple[Config, list[torch.nn.Module]]:
    """(Config, this rank's FSDP shards of the checkpoint's model, sharded over every rank) in a distributed run.

    Each rank reads only its slices (DCP reshards whatever layout saved it) and no rank builds the full model:
    what `scaletrain export` under torchrun hands to the sharded Hugging Face export. Every rank calls it. An
    adapter-only (LoRA) checkpoint is refused: merging it needs its base, so export it from one process.
    """
    import copy

    import torch.distributed as dist

    from scaletrain.checkpoint import safe_load
    from scaletrain.parallel.layout import Layout
    from scaletrain.parallel.parallelize import parallelize

    path = Path(path)
    _verify_spread(path, verify_mode)
    info = safe_load.read_trainer(path)
    try:
        saved = from_dict(info["config"])
    except ConfigError as exc:
        raise CheckpointError(f"{path / store.TRAINER}: {exc}") from None
    if saved.lora.rank > 0:
        raise CheckpointError(
            f"{path}: a LoRA checkpoint is exported merged with its base from one process (no torchrun)"
        )
    world = dist.get_world_size()
    # The export's own layout: plain FSDP over every rank, fp32 shards, nothing the forward pass needs.
    cfg = copy.deepcopy(saved)
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.pp = 1, world, 1, 1
    cfg.parallel.pp_virtual, cfg.parallel.cp, cfg.parallel.activation_checkpoint = 1, 1, "none"
    cfg.parallel.pp_first_layers, cfg.parallel.pp_last_layers, cfg.parallel.pp_stage_layers = -1, -1, []
    cfg.train.fp8, cfg.train.compile, cfg.train.dtype = False, False, "fp32"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, world
    layout = Layout.from_config(cfg, world)
    pm, _ = parallelize(cfg, layout, layout.build_mesh("cpu"), torch.device("cpu"), int(info.get("seed", 0)))
    metadata = safe_load.read_metadata(path)
    flat = {f"model.{k}": v for part in pm.parts for k, v in part.state_dict().items()}
    check_shapes(path, flat, metadata, gather=False)
    load_state(flat, path, metadata)
    for part in pm.parts:
        cast("Decoder", part).tie_weights()
    return saved, pm.parts


def export_sharded(path: Path, out_dir: Path, overwrite: bool = False, extra_files=None) -> tuple[Config, Path]:
    """Export checkpoint `path` as a Hugging Face directory from every rank of a distributed run, no rank holding
    more than its shards; destroys the process group when done. Returns (the checkpoint's Config, the directory).
    `extra_files`: a callable of the checkpoint's Config giving the export's further files (name -> bytes)."""
    import torch.distributed as dist

    from scaletrain.checkpoint.hf.sharded_export import export_hf_sharded

    try:
        cfg, parts = load_sharded_model(path)
        try:
            files = extra_files(cfg) if extra_files is not None else None
            out, _ = export_hf_sharded(parts, cfg.model, out_dir, overwrite=overwrite, extra_files=files)
        except (ValueError, FileExistsError) as exc:
            raise CheckpointError(str(exc)) from None
    finally:
        dist.destroy_process_group()
    return cfg, out
