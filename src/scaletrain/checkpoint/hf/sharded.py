"""Sharded Hugging Face import: every rank reads only the rows/columns of each safetensors tensor that its own
(DTensor) shards of the model hold, so a 70B base costs each of N ranks ~1/N of the bytes, not all of them.

The conversion to scaletrain's layout (Llama's grouped fused qkv and interleaved gate|up rows, GPT-2's transposed
Conv1D weights and (q|k|v, head) column order) is a map from each of our rows to (HF tensor, row in it): `row_map`,
built from the very functions the single-process converters use (split_qkv, _qkv_rows), so both agree by
construction. A rank's shard is a block of rows x columns (DTensor's own local-offset computation, which DCP uses
too); each run of consecutive source rows is one `safe_open(...).get_slice(name)[rows, cols]` read: safetensors is
data only and the slice read touches only those bytes. torch.distributed.checkpoint's HuggingFaceStorageReader
does the same per-slice read but maps one saved tensor onto one destination; a fused, permuted destination would
need a private planner, so the reads are done here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.hf.common import hf_file, read_config_json, read_weight_map
from scaletrain.config import ModelConfig


@dataclass
class RowMap:
    """Where each row of one of our tensors comes from: HF tensor `names[which[r]]`, row (or, `transpose`d, column)
    `row[r]` of it; columns are the same."""

    names: list[str]
    which: torch.Tensor
    row: torch.Tensor
    transpose: bool = False

    def hf_rows(self, k: int) -> int:
        """Rows (transposed: columns) of HF tensor `names[k]`."""
        return int(self.row[self.which == k].max()) + 1


def _plain(name: str, rows: int, transpose: bool = False) -> RowMap:
    return RowMap([name], torch.zeros(rows, dtype=torch.long), torch.arange(rows), transpose)


def _from_parts(names: list[str], parts: list[torch.Tensor], rows: int, transpose: bool = False) -> RowMap:
    """parts[k][j] = our row holding row j of names[k]; inverted into a RowMap."""
    which, row = torch.full((rows,), -1, dtype=torch.long), torch.full((rows,), -1, dtype=torch.long)
    for k, ours in enumerate(parts):
        ours = ours.flatten()
        which[ours], row[ours] = k, torch.arange(ours.numel())
    assert bool((which >= 0).all()), "every row of ours has one source"
    return RowMap(names, which, row, transpose)


def _llama_maps(cfg: ModelConfig) -> dict[str, RowMap]:
    from scaletrain.checkpoint.hf.llama import expected_shapes, plain_names, split_qkv

    shapes = expected_shapes(cfg)
    maps = {
        "embed.tok.weight": _plain("model.embed_tokens.weight", cfg.padded_vocab),
        "ln_f.weight": _plain("model.norm.weight", cfg.d_model),
        "head.weight": _plain("lm_head.weight", cfg.padded_vocab),
    }
    for i in range(cfg.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in plain_names(cfg).items():
            maps[f"{ours}{a}.weight"] = _plain(f"{hf}{b}.weight", shapes[f"{ours}{a}.weight"][0])
        rows = shapes[ours + "attn.qkv.weight"][0]
        q, k, v = split_qkv(torch.arange(rows).unsqueeze(1), cfg.n_heads, cfg.kv_heads)
        names = [f"{hf}self_attn.{n}_proj.weight" for n in "qkv"]
        maps[ours + "attn.qkv.weight"] = _from_parts(names, [q, k, v], rows)
        fc = torch.arange(2 * cfg.ffn_size)
        gate_up = [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]
        maps[ours + "mlp.fc.weight"] = _from_parts(gate_up, [fc[0::2], fc[1::2]], 2 * cfg.ffn_size)
    return maps


def _gpt2_maps(cfg: ModelConfig) -> dict[str, RowMap]:
    from scaletrain.checkpoint.hf.gpt2 import _BLOCK, _expected_shapes, _qkv_rows

    shapes = _expected_shapes(cfg)
    maps = {
        "embed.tok.weight": _plain("wte.weight", cfg.padded_vocab),
        "embed.pos.weight": _plain("wpe.weight", cfg.seq_len),
        "ln_f.weight": _plain("ln_f.weight", cfg.d_model),
        "ln_f.bias": _plain("ln_f.bias", cfg.d_model),
        "head.weight": _plain("wte.weight", cfg.padded_vocab),  # tied; a pipeline's last stage holds a copy
    }
    for i in range(cfg.n_layers):
        for ours, hf in _BLOCK.items():
            key, name = f"blocks.{i}.{ours}.", f"h.{i}.{hf}."
            rows = shapes[key + "weight"][0]
            if ours == "attn.qkv":  # HF column j holds our row hf_order[j]
                hf_order = _qkv_rows(torch.arange(rows), cfg.n_heads, to_hf=True)
                maps[key + "weight"] = _from_parts([name + "weight"], [hf_order], rows, transpose=True)
                maps[key + "bias"] = _from_parts([name + "bias"], [hf_order], rows)
            else:
                maps[key + "weight"] = _plain(name + "weight", rows, transpose=not ours.startswith("ln"))
                maps[key + "bias"] = _plain(name + "bias", rows)
    return maps


def row_maps(adapter: str, cfg: ModelConfig) -> dict[str, RowMap]:
    """Our state-dict key -> RowMap for the Hugging Face converter `adapter` ("llama" or "gpt2")."""
    return _llama_maps(cfg) if adapter == "llama" else _gpt2_maps(cfg)


def hf_shapes(maps: dict[str, RowMap], our_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the maps read, with the shape the config implies."""
    out: dict[str, tuple[int, ...]] = {}
    for key, m in maps.items():
        cols = our_shapes[key][1:]
        for k, name in enumerate(m.names):
            rows = m.hf_rows(k)
            out[name] = (*cols, rows) if m.transpose else (rows, *cols)
    return out


@dataclass
class TensorInfo:
    """One tensor of an HF directory, from its file's header."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def scan_dir(path: Path) -> tuple[Path, dict[str, TensorInfo]]:
    """(the file that lists the tensors, name -> TensorInfo) from the safetensors headers of an HF directory.

    Reads headers only. ValueError naming the file for a missing shard, an unreadable or truncated file, or an
    index entry its shard does not hold; FileNotFoundError when there are no safetensors.
    """
    from safetensors import SafetensorError, safe_open

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    files: dict[Path, set[str]]
    if single.is_file():
        source, files = single, {hf_file(path, single.name): set()}
    elif index.is_file():
        source = index
        files = {}
        # A shard outside the directory (a path, `..`, a link out of it) is not this checkpoint's data, and a
        # FIFO would block its reader: every listed name is checked before any shard is opened.
        for name, shard in read_weight_map(hf_file(path, index.name)).items():
            files.setdefault(hf_file(path, shard, index), set()).add(name)
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, TensorInfo] = {}
    for file, listed in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    tensors[name] = TensorInfo(file, tuple(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{file}: {text}") from None
        lost = sorted(n for n in listed if n not in tensors or tensors[n].file != file)
        if lost:
            raise ValueError(f"{file}: missing tensor {lost[0]!r} (listed in {source.name})")
    return source, tensors


def hf_model_config(path: Path) -> tuple[str, ModelConfig]:
    """(converter name, ModelConfig) of an HF directory, from config.json alone."""
    from scaletrain.checkpoint.hf.gpt2 import gpt2_config
    from scaletrain.checkpoint.hf.llama import MODEL_TYPES, llama_config

    _, hf = read_config_json(path)
    if hf.get("model_type") in MODEL_TYPES.values():
        return "llama", llama_config(path)
    return "gpt2", gpt2_config(path)


def _resolve(adapter: str, cfg: ModelConfig, source: Path, tensors: dict[str, TensorInfo]) -> dict[str, RowMap]:
    """The row maps with the directory's own tensor names, every name and shape checked against the config."""
    from scaletrain.checkpoint.hf.gpt2 import _expected_shapes
    from scaletrain.checkpoint.hf.llama import expected_shapes

    maps = row_maps(adapter, cfg)
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",)
    if adapter == "gpt2":
        # Original OpenAI-converted files have no "transformer." prefix and carry the causal-mask buffers.
        for m in maps.values():
            m.names = [n if n in tensors else f"transformer.{n}" for n in m.names]
        ignore = (".attn.bias", ".attn.masked_bias", "lm_head.weight")
    elif "lm_head.weight" not in tensors:  # a tied HF Llama head becomes an untied copy of the embedding
        maps["head.weight"].names = ["model.embed_tokens.weight"]
    ours = {**(expected_shapes(cfg) if adapter == "llama" else _expected_shapes(cfg))}
    ours["head.weight"] = (cfg.padded_vocab, cfg.d_model)
    for name, shape in hf_shapes(maps, ours).items():
        if name not in tensors:
            raise ValueError(f"{source}: missing tensor {name.removeprefix('transformer.')!r}")
        if tensors[name].shape != shape:
            raise ValueError(
                f"{tensors[name].file}: {name} has shape {tensors[name].shape}, config.json implies {shape}"
            )
    used = {n for m in maps.values() for n in m.names}
    extra = sorted(n for n in tensors if n not in used and not n.endswith(ignore))
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra[:5]}")
    return maps


def model_tensors(part: torch.nn.Module):
    """(plain model name, tensor) of a part's state dict, adapters left out; the names without what activation
    checkpointing and compile wrappers add, the tensors the part's own (in-place writes reach the parameters)."""
    from scaletrain.model.lora import is_lora_param

    for key, value in part.state_dict().items():
        if not is_lora_param(key):
            yield key.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), value


def local_block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(this rank's local tensor, its global offset per dim, whether this rank is the one that writes it: the
    first replica along every mesh dimension that replicates it) of a plain tensor or DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (0,) * t.ndim, True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"unsupported sharding {t.placements}: local shape {tuple(local.shape)} != {tuple(shape)}")
    coord = tuple(t.device_mesh.get_coordinate() or ())
    first = all(c == 0 for c, p in zip(coord, t.placements) if p.is_replicate())
    return local, tuple(offset), first


def runs(m: RowMap, start: int, n: int) -> list[tuple[int, int, int, int]]:
    """(local row, length, source k, source row) for each run of our rows [start, start+n) that are consecutive
    rows of one HF tensor."""
    which, row = m.which[start : start + n], m.row[start : start + n]
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)
    starts = brk.nonzero().flatten().tolist()
    ends = [*starts[1:], n]
    return [(s, e - s, int(which[s]), int(row[s])) for s, e in zip(starts, ends)]


def _read_into(local: torch.Tensor, offset: tuple[int, ...], m: RowMap, files: dict[str, Any]) -> int:
    """Copy this rank's block of one of our tensors from the HF slices it maps to; returns the bytes read."""
    nbytes = 0
    cols = slice(offset[1], offset[1] + local.shape[1]) if local.ndim == 2 else None
    for lr, n, k, sr in runs(m, offset[0], local.shape[0]):
        sl = files[m.names[k]].get_slice(m.names[k])
        rows = slice(sr, sr + n)
        if cols is None:
            data = sl[rows]
        else:
            data = sl[cols, rows].T if m.transpose else sl[rows, cols]
        local[lr : lr + n].copy_(data)
        nbytes += data.numel() * data.element_size()
    return nbytes


@torch.no_grad()
def load_hf_sharded(parts: list[torch.nn.Module], path) -> tuple[ModelConfig, int]:
    """Load a Hugging Face directory's weights into this rank's (sharded, possibly pipeline-cut) model parts,
    reading only this rank's slices; returns (the directory's ModelConfig, bytes of tensor data this rank read).

    Check the model against `hf_model_config(path)` first: the parts must be built from that config. LoRA
    adapters (absent from HF files) are left as they are. ValueError naming the file for anything malformed or
    not matching config.json. Every rank must call it (one collective at the end).
    """
    from safetensors import safe_open

    path = Path(path)
    adapter, cfg = hf_model_config(path)
    source, tensors = scan_dir(path)
    maps = _resolve(adapter, cfg, source, tensors)
    nbytes, seen, mismatch = 0, set(), False
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def files_for(m: RowMap) -> dict[str, Any]:
            for name in m.names:
                file = tensors[name].file
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return {name: handles[tensors[name].file] for name in m.names}

        for part in parts:
            for key, value in model_tensors(part):
                if key not in maps:
                    raise ValueError(f"{source}: the model has {key!r}, which no {adapter} tensor maps to")
                local, offset, _ = local_block(value)
                if local.numel() == 0 or local.data_ptr() in seen:  # a tied head shares the embedding's storage
                    continue
                seen.add(local.data_ptr())
                m = maps[key]
                nbytes += _read_into(local, offset, m, files_for(m))
                if adapter == "gpt2" and key == "embed.tok.weight" and "lm_head.weight" in tensors:
                    # The single-process import refuses an untied head; compare this rank's slice of it.
                    head = RowMap(["lm_head.weight"], m.which, m.row)
                    got = torch.empty_like(local)
                    nbytes += _read_into(got, offset, head, files_for(head))
                    mismatch |= not torch.equal(got, local)
            tie = getattr(part, "tie_weights", None)
            if tie is not None:
                tie()
    if torch.distributed.is_initialized():
        flag = torch.tensor([int(mismatch)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        mismatch = bool(flag.item())
    if mismatch:
        raise ValueError(f"{source}: lm_head.weight differs from wte.weight; scaletrain needs a tied output layer")
    return cfg, nbytes
