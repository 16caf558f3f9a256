"""Layout-independent random init: every element's value is a pure function of (seed, parameter name, index).

A sharded parameter (a tensor-parallel or FSDP `DTensor`, or a pipeline stage's copy) is filled shard by shard,
each rank generating only the elements it owns, and the result equals the single-process init bit for bit. This
is what lets a 4-D layout start from exactly the weights of the one-process reference without any rank ever
holding the full model, and what makes a run's losses independent of its layout.

Values come from a counter-based generator (splitmix64 of key XOR counter, two counters per element, Box-Muller
in float64). torch's own generators are sequential and so cannot give shard-local slices of a global draw.
"""

from __future__ import annotations

import hashlib

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_CHUNK = 1 << 22  # elements per generation pass: bounds the int64/float64 temporaries


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    # int64 multiply wraps modulo 2**64, which is the arithmetic splitmix64 is defined in.
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def param_key(seed: int, name: str) -> int:
    """64-bit stream key of parameter `name` under `seed` (stable across runs, processes and platforms)."""
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _normal_at(flat_index: torch.Tensor, key: int) -> torch.Tensor:
    """Standard normal values (float64) of global flat positions `flat_index` in stream `key`."""
    c = flat_index * 2
    u1 = _srl(_splitmix64(c ^ key), 11).double() * 2.0**-53
    u2 = _srl(_splitmix64((c + 1) ^ key), 11).double() * 2.0**-53
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * torch.pi * u2)


def local_index_ranges(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Per dimension, the global indices held locally: all of them for a plain tensor, the shard's for a DTensor.

    Follows DTensor's chunking (ceil-sized chunks, mesh dims in order, and FSDP's `_StridedShard` after the
    plain shards of the same tensor dim, since it shards what tensor parallelism already split).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    assert coord is not None, "a DTensor's own rank is always in its mesh"
    ranges = [torch.arange(n) for n in tensor.shape]
    plain, strided = [], []
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            strided.append((mesh_dim, placement))
        elif isinstance(placement, Shard):
            plain.append((mesh_dim, placement))
        elif not (placement.is_replicate() or placement.is_partial()):
            raise NotImplementedError(f"init of a DTensor with placement {placement!r}")
    for mesh_dim, placement in plain + strided[::-1]:
        dim = placement.dim
        chunks = torch.chunk(ranges[dim], mesh.size(mesh_dim))
        idx = coord[mesh_dim]
        ranges[dim] = chunks[idx] if idx < len(chunks) else ranges[dim][:0]
    return ranges


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill `param` (plain tensor or DTensor shard) with N(0, std) values of stream (seed, name); meta is skipped."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    if local.is_meta or local.numel() == 0:
        return
    key = param_key(seed, name)
    ranges = local_index_ranges(param)
    if tuple(len(r) for r in ranges) != tuple(local.shape):
        raise RuntimeError(
            f"init of {name}: computed shard shape {[len(r) for r in ranges]} != local shape {list(local.shape)}"
        )
    # Global flat index of every local element: sum_d index_d * stride_d of the full (global) tensor.
    strides = [1] * len(param.shape)
    for d in range(len(param.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * param.shape[d + 1]
    device = local.device
    flat = local.view(-1)
    rows = ranges[0].to(device) * strides[0] if ranges else torch.zeros(1, dtype=torch.long, device=device)
    inner = torch.zeros(1, dtype=torch.long, device=device)
    for d in range(1, len(ranges)):
        inner = (inner[:, None] + (ranges[d].to(device) * strides[d])[None, :]).reshape(-1)
    # Generate a few rows at a time so temporaries stay small even for a 600M-element embedding shard.
    per_row = max(inner.numel(), 1)
    rows_per_pass = max(1, _CHUNK // per_row)
    for start in range(0, rows.numel(), rows_per_pass):
        r = rows[start : start + rows_per_pass]
        index = (r[:, None] + inner[None, :]).reshape(-1)
        values = _normal_at(index, key) * std
        flat[start * per_row : start * per_row + index.numel()].copy_(values.to(local.dtype))
