"""The one adapter from a trainer config and its resolved parallel `Layout` to the simulator's inputs.

Used by the dry run (`parallel/dry_run.py`), `scaletrain predict --from-config` and `scaletrain sim calibrate
RUN_DIR` (`cli/sim.py` imports it and passes it to `sim.fit.runs`, which may not import `parallel/`). So the three
price the same layout the same way. Torch-free: it imports only the config, the layout arithmetic and sim.
"""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.parallel.layout import Layout
from scaletrain.sim.workload import ClusterLayout, Workload, workload_from_config


def sim_layout(cfg: Config, layout: Layout) -> tuple[Workload, ClusterLayout]:
    """The simulator's Workload and ClusterLayout of `cfg` trained in `layout`.

    What the trainer does, in the simulator's terms: FSDP2/HSDP (`data_parallel_kind` "fsdp" or "hsdp") is ZeRO-3,
    sharded over dp_shard·cp (HSDP replicates over dp_replicate); DDP or one rank is ZeRO-0 (16 bytes per
    parameter either way: fp32 master weights, fp32 gradients, AdamW's two fp32 moments). Gradients reduce in fp32.
    The simulator prices 16-bit activations, as `train.dtype=bf16` runs them. Pipeline stages keep their outputs to
    the backward (`free_stage_outputs=False`): torch.distributed.pipelining's PipelineStage caches each micro-batch's
    output tuple in `fwd_cache` until `backward_one_chunk` pops it, and sends a detached view, freeing nothing.
    `parallel.fsdp_reshard_after_forward=false` stays ZeRO-3 here, not ZeRO-2 (docs/perf-model.md, Memory): the
    trainer's FSDP2 reshards after every micro-batch's backward without a pipeline, and under torch's pipeline
    schedules accumulates unsharded gradients until a stage's last backward.
    """
    p, t = cfg.parallel, cfg.train
    sharded = layout.data_parallel_kind in ("fsdp", "hsdp")
    cluster = ClusterLayout(
        gpus=layout.world_size,
        tp=layout.tp,
        pp=layout.pp,
        vp=layout.pp_virtual,
        cp=layout.cp,
        mbs=t.micro_batch_size,
        gbs=t.global_batch_size,
        sp=layout.sequence_parallel,
        recompute=p.activation_checkpoint,
        fp8=t.fp8,
        zero=3 if sharded else 0,
        bf16_grads=False,
        schedule=layout.pp_schedule if layout.pp > 1 else "",
        shard_group=layout.dp_shard * layout.cp if layout.data_parallel_kind == "hsdp" else 0,
        ep=layout.ep,
        pp_first_layers=layout.pp_first_layers,
        pp_last_layers=layout.pp_last_layers,
        pp_stage_layers=layout.pp_stage_layers,
        free_stage_outputs=False,
    )
    return workload_from_config(cfg), cluster


def sim_inputs(cfg: Config, world_size: int) -> tuple[Workload, ClusterLayout]:
    """`sim_layout` of cfg's layout resolved for `world_size` ranks (dp_shard=-1 takes what is left); raises
    LayoutError (a ConfigError) with every reason the layout cannot train cfg."""
    return sim_layout(cfg, Layout.from_config(cfg, world_size))
