"""Dry run at scale: validate a layout for a cluster you do not have and estimate memory per GPU.

The layout is applied for real (DeviceMesh, DTensor tensor parallelism, FSDP2, pipeline cut) on the meta device
inside a fake process group of the requested world size, as each examined rank; parameter shards are read off
the resulting DTensors, so what is printed is what training would allocate for parameters.

Memory is the simulator's model (`scaletrain.sim.memory`, docs/perf-model.md "Memory"), reached through the one
adapter `parallel.sim_layout.sim_layout`, so `train --dry-run` and `predict --from-config` give the same figure
for the same layout: weights, gradients and AdamW state per sharding scheme (FSDP = ZeRO-3 over dp_shard·cp, plus
two gathered layers and one layer's gradients), activations after Korthikanti et al. with flash attention and the
schedule's in-flight micro-batches, logits on the last stage. It fits when it stays under the GPU's HBM (from
`sim/hardware/gpus.toml`) less a 5 GiB runtime reserve and 3% fragmentation. Each examined rank also carries the
simulator's count of its local parameters beside the real one (a test keeps them equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.config import Config
from scaletrain.parallel.layout import Layout, LayoutError
from scaletrain.parallel.sim_layout import sim_layout
from scaletrain.sim import memory
from scaletrain.sim.catalog import DEFAULT_GPU, CatalogError, load_catalog
from scaletrain.sim.workload import ClusterLayout, Workload


@dataclass
class RankReport:
    """What one examined rank holds."""

    rank: int
    coords: dict
    stages: list
    stage_blocks: list
    """Transformer blocks of each of `stages` (0 for an end stage holding only the embedding or the output layer)."""
    shards: list  # (name, global shape, local shape) per parameter
    local_params: int
    sim_local_params: float
    """The simulator's count of the same (equal to local_params where every dimension divides evenly)."""
    memory_gib: dict


def _fake_world(world_size: int, rank: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _examine(cfg: Config, layout: Layout, rank: int) -> tuple[list, list, dict]:
    import torch.distributed as dist

    from scaletrain.parallel.parallelize import build_meta_parts, parallelize_part

    _fake_world(layout.world_size, rank)
    try:
        mesh = layout.build_mesh("cpu")
        coords = {name: mesh[name].get_local_rank() for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        if layout.ep > 1:
            coords["ep"] = mesh["ep"].get_local_rank()
        parts, ids = build_meta_parts(cfg, layout, coords["pp"])
        shards = []
        for part in parts:
            parallelize_part(part, cfg, layout, mesh)
            for name, p in part.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                shards.append((name.replace("._checkpoint_wrapped_module", ""), tuple(p.shape), tuple(local.shape)))
        return shards, ids, coords
    finally:
        dist.destroy_process_group()


def estimate_memory(w: Workload, cluster: ClusterLayout, pp_rank: int) -> dict:
    """The simulator's memory estimate (GiB) of one GPU of pipeline rank `pp_rank`; see the module docstring."""
    est = memory.stage_memory(w, cluster, pp_rank)
    out = {k: getattr(est, k) / memory.GIB for k in ("weights", "grads", "optimizer", "activations", "other")}
    out["total"] = est.total / memory.GIB
    out["in_flight_microbatches"] = est.in_flight
    out["layers_on_rank"] = cluster.rank_blocks(w)[pp_rank]  # the split the trainer cuts (uneven ones too)
    return out


def dry_run(cfg: Config, world_size: int, device: str = DEFAULT_GPU) -> dict:
    """Validate cfg's layout at `world_size` ranks and report the first and last pipeline rank.

    Raises LayoutError when the layout does not divide the model or `device` is not a catalog GPU.
    """
    cat = load_catalog()
    try:
        gpu = cat.gpu(device)
    except CatalogError:
        raise LayoutError(f"--gpu {device!r}: must be one of {sorted(cat.gpus)}") from None
    layout = Layout.from_config(cfg, world_size)
    w, cluster = sim_layout(cfg, layout)
    capacity_gib = gpu.hbm_gb * memory.GB / memory.GIB
    # Ranks with the most to hold: pipeline rank 0 (embedding, most in-flight micro-batches) and the last one
    # (output layer and logits). Mesh order is (pp, dp_replicate, dp_shard, cp, tp): pp rank r starts at r*stride.
    stride = world_size // layout.pp
    examined = sorted({0, (layout.pp - 1) * stride})
    reports = []
    sizes = layout.stage_blocks(cfg.model.n_layers) if layout.pp > 1 else None
    for rank in examined:
        shards, ids, coords = _examine(cfg, layout, rank)
        local = sum(math.prod(local) for _, _, local in shards)
        mem = estimate_memory(w, cluster, coords["pp"])
        first, last = coords["pp"] == 0, coords["pp"] == layout.pp - 1
        sim_local = memory.local_params(w, cluster, first, last)
        blocks = [sizes[s] for s in ids] if sizes else [cfg.model.n_layers]
        reports.append(RankReport(rank, coords, ids, blocks, shards, local, sim_local, mem))
    worst = max(r.memory_gib["total"] for r in reports)
    usable_gib = memory.usable_bytes(gpu.hbm_gb) / memory.GIB
    result = {
        "layout": layout.describe(),
        "world_size": world_size,
        "degrees": layout.degrees,
        "uneven_stages": layout.uneven,
        "data_parallel": layout.data_parallel_kind,
        "device": gpu.key,
        "device_memory_gib": capacity_gib,
        "usable_memory_gib": usable_gib,
        "ranks": [
            {
                "rank": r.rank,
                "coords": r.coords,
                "stages": r.stages,
                "stage_blocks": r.stage_blocks,
                "local_params": r.local_params,
                "sim_local_params": r.sim_local_params,
                "memory_gib": r.memory_gib,
                "shards": [{"name": n, "global": list(g), "local": list(loc)} for n, g, loc in r.shards],
            }
            for r in reports
        ],
        "experts": _experts(cfg, layout),
        "max_memory_gib": worst,
        "fits": worst <= usable_gib,
    }
    return result


def _experts(cfg: Config, layout: Layout) -> dict | None:
    """Routed experts per MoE layer, per EP rank, and the ranks FSDP shards each EP rank's experts over."""
    n = cfg.model.moe.n_experts
    if not n:
        return None
    return {"per_layer": n, "ep": layout.ep, "per_ep_rank": n // layout.ep, "fsdp_ranks": layout.efsdp}


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
        f"{worst['rank']} but a {result['device']} leaves {result['usable_memory_gib']:.1f} of its "
        f"{result['device_memory_gib']:.1f} GiB after the runtime reserve "
        f"(largest: {top} GiB); raise tp/pp/dp_shard or use activation checkpointing"
    )
