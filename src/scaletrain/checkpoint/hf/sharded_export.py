"""Sharded Hugging Face export: every rank writes its own (DTensor) shards straight into their place in the
output safetensors files, so no rank ever holds more than its shards (no gather, no full tensor).

The output is what `save_pretrained` writes for a big model: `config.json`, `model-0000k-of-0000n.safetensors`
(one per rank, whole tensors, balanced by bytes) and `model.safetensors.index.json` (tensor -> file); one rank
writes a single `model.safetensors` as the single-process export does. The safetensors layout is fixed by the
config alone (a JSON header, then each tensor's bytes row-major at a known offset), so rank 0 writes the headers
and sizes the files, and then every rank `pwrite`s the byte ranges of its rows (through the same row maps the
sharded import reads with, sharded.py). Ranks holding replicas of a tensor leave it to the first replica. The
directory is built beside the target and renamed into place when every rank is done, like the single export.
Needs an output directory every rank sees (a local disk for one node; a parallel file system for several).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from scaletrain.checkpoint.hf.common import fsync_path, new_tmp_dir, swap_in, with_token_ids, write_extra_files
from scaletrain.checkpoint.hf.sharded import RowMap, hf_shapes, local_block, model_tensors, row_maps, runs
from scaletrain.config import ModelConfig

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _our_shapes(adapter: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from scaletrain.checkpoint.hf.gpt2 import _expected_shapes
    from scaletrain.checkpoint.hf.llama import expected_shapes

    return expected_shapes(cfg) if adapter == "llama" else _expected_shapes(cfg)


def plan_files(shapes: dict[str, tuple[int, ...]], itemsize: int, n_files: int) -> dict[str, list[str]]:
    """File name -> the HF tensors it holds, in order: consecutive runs of `shapes`, balanced by bytes."""
    sizes = {n: itemsize * int(torch.Size(s).numel()) for n, s in shapes.items()}
    n_files = max(1, min(n_files, len(sizes)))
    if n_files == 1:
        return {"model.safetensors": list(sizes)}
    total, acc = sum(sizes.values()), 0
    files: list[list[str]] = [[] for _ in range(n_files)]
    for name, size in sizes.items():
        # the file this tensor's middle byte falls in, when the bytes are cut into n_files equal pieces
        files[min(n_files - 1, (acc + size // 2) * n_files // total)].append(name)
        acc += size
    files = [f for f in files if f]
    return {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors": f for i, f in enumerate(files)}


def _header(names: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> tuple[bytes, dict]:
    """(the file's header bytes, name -> (data start, data end) offsets relative to the data section)."""
    item = torch.empty((), dtype=dtype).element_size()
    entries: dict = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name in names:
        end = at + item * int(torch.Size(shapes[name]).numel())
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shapes[name]), "data_offsets": [at, end]}
        offsets[name], at = (at, end), end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    return len(text).to_bytes(8, "little") + text, offsets


def _pwrite_block(fd: int, base: int, data: torch.Tensor, hf_shape: tuple[int, ...], r0: int, c0: int) -> int:
    """Write `data` (contiguous, 1-D or rows x cols) at rows r0.., cols c0.. of the row-major HF tensor at byte
    `base` of `fd`; returns the bytes written."""
    raw = data.contiguous().view(torch.uint8).reshape(data.shape[0], -1).numpy()
    item = data.element_size()
    width = int(torch.Size(hf_shape[1:]).numel())  # elements per HF row
    if data.ndim == 1 or data.shape[1] == width:  # whole rows: one contiguous range
        os.pwrite(fd, raw.tobytes(), base + r0 * width * item)
    else:
        for i in range(data.shape[0]):
            os.pwrite(fd, raw[i].tobytes(), base + ((r0 + i) * width + c0) * item)
    return raw.size


def _write_local(
    value: torch.Tensor, m: RowMap, dtype: torch.dtype, where: dict[str, tuple[int, int]], shapes: dict
) -> int:
    """Write this rank's block of one of our tensors into the HF tensors it maps to; returns the bytes written."""
    local, offset, first = local_block(value)
    if not first or local.numel() == 0:
        return 0
    local = local.detach().to(device="cpu", dtype=dtype)
    c0 = offset[1] if local.ndim == 2 else 0
    nbytes = 0
    for lr, n, k, sr in runs(m, offset[0], local.shape[0]):
        name = m.names[k]
        fd, base = where[name]
        block = local[lr : lr + n]
        if m.transpose:  # HF rows are our columns: rows c0.., columns sr..
            nbytes += _pwrite_block(fd, base, block.T, shapes[name], c0, sr)
        else:
            nbytes += _pwrite_block(fd, base, block, shapes[name], sr, c0)
    return nbytes


def export_hf_sharded(
    parts: list[torch.nn.Module],
    cfg: ModelConfig,
    out_dir,
    dtype=torch.float32,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> tuple[Path, int]:
    """Write this rank's shards of a (sharded) model as part of a Hugging Face directory; every rank calls it.

    Returns (the directory, bytes of tensor data this rank wrote). The result holds the same tensors as
    `export_hf(full_state_dict, cfg, out_dir, dtype)`, split into one file per rank. ValueError for a model
    without a converter or a non-floating dtype; FileExistsError when `out_dir` is refused: it must be new or
    empty unless `overwrite` (common.export_target_problem). Rank 0 writes `extra_files` (name -> bytes).
    """
    import torch.distributed as dist

    from scaletrain.checkpoint.hf import CONVERTERS
    from scaletrain.checkpoint.hf import gpt2 as gpt2_mod
    from scaletrain.checkpoint.hf import llama as llama_mod
    from scaletrain.model.spec import model_spec

    if dtype not in _DTYPES:
        raise ValueError(f"export_hf: dtype={dtype} is not a floating-point dtype")
    adapter = model_spec(cfg.arch).hf_adapter
    if adapter not in CONVERTERS:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face converter")
    maps = row_maps(adapter, cfg)
    if adapter == "gpt2":
        del maps["head.weight"]  # tied: HF re-ties lm_head to wte on load
        for m in maps.values():
            m.names = [f"transformer.{n}" for n in m.names]
    shapes = hf_shapes(maps, {**_our_shapes(adapter, cfg), "head.weight": (cfg.padded_vocab, cfg.d_model)})
    from scaletrain.model.lora import is_lora_param

    if any(is_lora_param(k) for part in parts for k in part.state_dict()):
        raise ValueError("export_hf: the model has LoRA adapters; the Hugging Face format needs them merged")
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    files = plan_files(shapes, torch.empty((), dtype=dtype).element_size(), world)
    headers = {file: _header(names, shapes, dtype) for file, names in files.items()}
    out_dir = Path(out_dir)
    box: list = [None, None]
    if rank == 0:
        try:
            tmp = new_tmp_dir(out_dir, "export_hf", overwrite)
            hf_config = (llama_mod._hf_config if adapter == "llama" else gpt2_mod._hf_config)(cfg, dtype)
            hf_config = with_token_ids(hf_config, extra_files)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
            write_extra_files(tmp, extra_files)
            if len(files) > 1:
                total = sum(max(end for _, end in offs.values()) for _, offs in headers.values())
                index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, ns in files.items() for n in ns}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            for file, (head, offs) in headers.items():
                with open(tmp / file, "wb") as fh:
                    fh.write(head)
                    fh.truncate(len(head) + max(end for _, end in offs.values()))
            box[0] = str(tmp)
        except (OSError, FileExistsError) as exc:
            box[1] = str(exc)
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise FileExistsError(box[1])
    tmp = Path(box[0])
    nbytes, seen = 0, set()
    fds = {file: os.open(tmp / file, os.O_WRONLY) for file in files}
    try:
        where = {n: (fds[f], len(headers[f][0]) + headers[f][1][n][0]) for f, ns in files.items() for n in ns}
        for part in parts:
            for key, value in model_tensors(part):
                if adapter == "gpt2" and key == "head.weight":
                    continue
                if key not in maps:
                    raise ValueError(f"export_hf: the model has {key!r}, which no {adapter} tensor holds")
                local = local_block(value)[0]
                if local.numel() and local.data_ptr() in seen:  # a tied head shares the embedding's storage
                    continue
                seen.add(local.data_ptr())
                nbytes += _write_local(value, maps[key], dtype, where, shapes)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if distributed:
        dist.barrier()
    if rank == 0:
        index_file = ["model.safetensors.index.json"] if len(files) > 1 else []
        for file in [*files, "config.json", *index_file, *(extra_files or {})]:
            fsync_path(tmp / file)
        swap_in(tmp, out_dir, "export_hf", overwrite)
    if distributed:
        dist.barrier()
    return out_dir, nbytes
