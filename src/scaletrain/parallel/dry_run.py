"""Dry run at scale: validate a layout for a cluster you do not have and estimate memory per GPU.

The layout is applied for real (DeviceMesh, DTensor tensor parallelism, FSDP2, pipeline cut) on the meta device
inside a fake process group of the requested world size, as each examined rank; parameter shards are read off
the resulting DTensors, so what is printed is what training would allocate for parameters. Optimizer state,
gradients, gathered FSDP units and activations are then estimated:

  parameters + gradients + AdamW state: 4 + 4 + 8 bytes per local (sharded) parameter (fp32 master copy);
  FSDP working set: two gathered units (current + prefetched) in the compute dtype, and one unit's gradient
                    in fp32 before its reduce-scatter;
  activations (bf16, Korthikanti et al. 2022, flash attention so no s^2 term), per layer and micro-batch:
      sequence parallel: 34 s b h / t bytes; without it: s b h (10 + 24 / t);
      "full" recompute keeps only the block input (2 s b h / t with SP) plus one layer's full working set;
  in flight per pipeline rank: GPipe all micro-batches; 1F1B min(pp, m); interleaved pp (1 + (pp-1)/(pp v));
  logits on the last stage: s b V / t in fp32 for the loss and its gradient;
  runtime reserve: CUDA context, NCCL buffers and allocator fragmentation, a flat 4 GiB (an assumption).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.parallel.layout import Layout, LayoutError

# Usable device memory in GB (10^9 bytes, as vendors quote it). Sources: vendor datasheets (docs/perf-model.md,
# Hardware).
DEVICE_MEMORY_GB = {"a100": 80.0, "h100": 80.0, "h200": 141.0, "b200": 180.0, "gb200": 186.0, "gb300": 288.0}
RUNTIME_RESERVE_GIB = 4.0


@dataclass
class RankReport:
    """What one examined rank holds."""

    rank: int
    coords: dict
    stages: list
    shards: list  # (name, global shape, local shape) per parameter
    local_params: int
    memory_gib: dict


def _fake_world(world_size: int, rank: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _examine(cfg: Config, layout: Layout, rank: int) -> tuple[list, list, dict, int]:
    import torch.distributed as dist

    from scaletrain.parallel.parallelize import build_meta_parts, parallelize_part

    _fake_world(layout.world_size, rank)
    try:
        mesh = layout.build_mesh("cpu")
        coords = {name: mesh[name].get_local_rank() for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        parts, ids = build_meta_parts(cfg, layout, coords["pp"])
        shards, biggest_unit = [], 0
        for part in parts:
            parallelize_part(part, cfg, layout, mesh)
            for name, p in part.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                shards.append((name.replace("._checkpoint_wrapped_module", ""), tuple(p.shape), tuple(local.shape)))
            for block in part.blocks.values():
                # An FSDP unit gathered in full over the data-parallel shards (TP/PP split stays).
                unit = sum(_tp_local_numel(p) for p in block.parameters())
                biggest_unit = max(biggest_unit, unit)
            root_unit = sum(_tp_local_numel(p) for n, p in part.named_parameters() if not n.startswith("blocks."))
            biggest_unit = max(biggest_unit, root_unit)
        return shards, ids, coords, biggest_unit
    finally:
        dist.destroy_process_group()


def _tp_local_numel(p) -> int:
    """Elements of `p` after tensor parallelism only (what an FSDP all-gather reassembles on a rank)."""
    if not hasattr(p, "placements"):
        return p.numel()
    n = p.numel()
    for mesh_dim, placement in enumerate(p.placements):
        name = p.device_mesh.mesh_dim_names[mesh_dim] if p.device_mesh.mesh_dim_names else ""
        if placement.is_shard() and name == "tp":
            n //= p.device_mesh.size(mesh_dim)
    return n


def estimate_memory(
    cfg: Config, layout: Layout, local_params: int, biggest_unit: int, stages: list, last_stage: bool
) -> dict:
    """Bytes-based estimate (GiB) of one rank's memory; see the module docstring for every term."""
    m, t = cfg.model, cfg.train
    tp, pp, v = layout.tp, layout.pp, layout.pp_virtual
    s = m.seq_len // layout.cp
    b, h = t.micro_batch_size, m.d_model
    compute_bytes = 2 if t.dtype == "bf16" else 4
    gib = 2.0**30
    states = local_params * 16
    fsdp = 0
    if layout.data_parallel_kind in ("fsdp", "hsdp"):
        fsdp = biggest_unit * (2 * compute_bytes + 4)
    layers = len(stages) * (m.n_layers // layout.num_stages)
    ac = cfg.parallel.activation_checkpoint
    sp = layout.sequence_parallel and tp > 1
    per_layer_full = s * b * h * (34 / tp if sp else 10 + 24 / tp) * (compute_bytes / 2)
    if ac == "full":
        per_layer = s * b * h * 2 / (tp if sp else 1)
        extra = per_layer_full  # one layer recomputed at a time
    else:
        per_layer = per_layer_full
        extra = 0.0
    n_micro = t.global_batch_size // layout.dp // b
    if pp == 1:
        in_flight = 1
    elif layout.pp_schedule == "gpipe":
        in_flight = n_micro
    elif layout.pp_schedule == "1f1b":
        in_flight = min(pp, n_micro)
    else:
        in_flight = pp * (1 + (pp - 1) / (pp * v))
    activations = layers * per_layer * in_flight + extra
    logits = s * b * m.padded_vocab / tp * 4 * 2 if last_stage else 0
    out = {
        "params_grads_optimizer": states / gib,
        "fsdp_gathered_units": fsdp / gib,
        "activations": activations / gib,
        "logits": logits / gib,
        "runtime_reserve": RUNTIME_RESERVE_GIB,
    }
    out["total"] = sum(out.values())
    out["in_flight_microbatches"] = in_flight
    out["layers_on_rank"] = layers
    return out


def dry_run(cfg: Config, world_size: int, device: str = "h100") -> dict:
    """Validate cfg's layout at `world_size` ranks and report the first and last pipeline rank.

    Raises LayoutError when the layout does not divide the model or does not fit `device` memory.
    """
    if device not in DEVICE_MEMORY_GB:
        raise LayoutError(f"--gpu {device!r}: must be one of {sorted(DEVICE_MEMORY_GB)}")
    layout = Layout.from_config(cfg, world_size)
    capacity_gib = DEVICE_MEMORY_GB[device] * 1e9 / 2**30
    # Ranks with the most to hold: pipeline rank 0 (embedding, most in-flight micro-batches) and the last one
    # (output layer and logits). Mesh order is (pp, dp_replicate, dp_shard, cp, tp): pp rank r starts at r*stride.
    stride = world_size // layout.pp
    examined = sorted({0, (layout.pp - 1) * stride})
    reports = []
    for rank in examined:
        shards, ids, coords, unit = _examine(cfg, layout, rank)
        local = sum(math.prod(local) for _, _, local in shards)
        mem = estimate_memory(cfg, layout, local, unit, ids, last_stage=layout.num_stages - 1 in ids)
        reports.append(RankReport(rank, coords, ids, shards, local, mem))
    worst = max(r.memory_gib["total"] for r in reports)
    result = {
        "layout": layout.describe(),
        "world_size": world_size,
        "degrees": layout.degrees,
        "data_parallel": layout.data_parallel_kind,
        "device": device,
        "device_memory_gib": capacity_gib,
        "ranks": [
            {
                "rank": r.rank,
                "coords": r.coords,
                "stages": r.stages,
                "local_params": r.local_params,
                "memory_gib": r.memory_gib,
                "shards": [{"name": n, "global": list(g), "local": list(loc)} for n, g, loc in r.shards],
            }
            for r in reports
        ],
        "max_memory_gib": worst,
        "fits": worst <= capacity_gib,
    }
    return result


def check_fits(result: dict) -> None:
    """Raise LayoutError when the estimate exceeds the device memory, naming the largest terms."""
    if result["fits"]:
        return
    worst = max(result["ranks"], key=lambda r: r["memory_gib"]["total"])
    terms = sorted(
        (
            (k, v)
            for k, v in worst["memory_gib"].items()
            if k not in ("total", "in_flight_microbatches", "layers_on_rank")
        ),
        key=lambda kv: -kv[1],
    )
    top = ", ".join(f"{k} {v:.1f}" for k, v in terms[:3])
    raise LayoutError(
        f"layout {result['layout']} needs ~{worst['memory_gib']['total']:.1f} GiB on rank "
        f"{worst['rank']} but a {result['device']} has {result['device_memory_gib']:.1f} GiB "
        f"(largest: {top} GiB); raise tp/pp/dp_shard or use activation checkpointing"
    )
