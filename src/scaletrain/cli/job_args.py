"""The flags that describe a job on a cluster and its parallel layout, shared by `predict`, `plan`, `sim goodput` and
`sim plot --goodput`, and the `ClusterLayout` they give (`layout_from_args`). Torch-free."""

from __future__ import annotations

import argparse

from scaletrain import benchmarks
from scaletrain.cli import pretrain_report
from scaletrain.config_bounds import DEGREE_MAX, LAYERS_MAX, float_flag, int_flag
from scaletrain.sim.catalog import DEFAULT_GPU, shipped_keys
from scaletrain.sim.workload import ClusterLayout, split_problem

HEALING_MAX = 10**9
"""Largest --fp4-healing-step: a billion steps, more than any run trains, where it means "never switch" as 0 does."""

GBS_MAX = 2**17
"""Largest --gbs the simulator takes: 8x DeepSeek-V3's 15,360 sequences, the largest published. `plan` event-simulates
its best layouts, and at a larger batch those can hold millions of micro-batches, each simulated (minutes)."""


def layout_from_args(args) -> ClusterLayout:
    spec = benchmarks.for_model(args.model)
    _, ramp = pretrain_report.resolve(args)
    # None is "not given"; --gbs 0 never gets here (its flag type refuses it) to be read as the default. A batch ramp
    # lays the run out for its largest batch (each stage is priced at its own).
    gbs = (
        args.gbs if args.gbs is not None else max(s.gbs for s in ramp) if ramp else (spec.default_gbs if spec else None)
    )
    if gbs is None:
        raise ValueError("--gbs is required for models that are not an MLPerf benchmark")
    check_recipe_flags(args, fp8=args.fp8 or args.fp4)
    return ClusterLayout(
        gpus=args.gpus,
        tp=args.tp,
        pp=args.pp,
        vp=args.vp,
        cp=args.cp,
        mbs=args.mbs,
        gbs=gbs,
        sp=not args.no_sp,
        recompute=args.recompute,
        fp8=args.fp8 or args.fp4,
        fp4=args.fp4,
        fp8_attention=args.fp8_attention,
        fp4_healing_step=args.fp4_healing_step,
        zero=args.zero,
        schedule=args.schedule,
        bf16_grads=args.grad_dtype == "bf16" or (args.grad_dtype == "auto" and (args.fp8 or args.fp4)),
        ep=args.ep,
        moe_imbalance=args.moe_imbalance,
        **split_from_args(args),
    )


def split_from_args(args) -> dict:
    """The uneven pipeline split of --pp-first-layers / --pp-last-layers / --pp-stage-layers as `ClusterLayout`
    fields; ValueError (one line, exit 2) when the list comes with first/last."""
    first = -1 if args.pp_first_layers is None else args.pp_first_layers
    last = -1 if args.pp_last_layers is None else args.pp_last_layers
    stages: tuple[int, ...] = args.pp_stage_layers or ()
    if stages and (first >= 0 or last >= 0):
        raise ValueError("--pp-stage-layers gives every stage's blocks: drop --pp-first-layers / --pp-last-layers")
    return {"pp_first_layers": first, "pp_last_layers": last, "pp_stage_layers": stages}


def check_split(w, layout: ClusterLayout) -> None:
    """ValueError (one line, exit 2) naming the split flags when they cannot split `w`'s blocks over `layout`'s
    pp x vp stages (`split_problem`); the default split keeps its infeasible-layout report."""
    flags = [
        flag
        for flag, given in (
            ("--pp-first-layers", layout.pp_first_layers >= 0),
            ("--pp-last-layers", layout.pp_last_layers >= 0),
            ("--pp-stage-layers", bool(layout.pp_stage_layers)),
        )
        if given
    ]
    if not flags:
        return
    if layout.pp < 2:
        raise ValueError(f"{' / '.join(flags)} split pipeline stages: they need --pp 2 or more")
    why = split_problem(
        w.shape.layers, layout.pp, layout.vp, layout.pp_first_layers, layout.pp_last_layers, layout.pp_stage_layers
    )
    if why:
        raise ValueError(f"{' / '.join(flags)}: {why} ({w.name}, --pp {layout.pp} --vp {layout.vp})")


def stage_list(text: str) -> tuple[int, ...]:
    """argparse type of --pp-stage-layers: comma-separated block counts, each in [0, LAYERS_MAX]."""
    parts = [t.strip() for t in text.strip().strip("[]").split(",")]
    if not parts or not all(t.isdecimal() for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block counts >= 0, e.g. 3,4,4,2")
    counts = tuple(int(t) for t in parts)
    if max(counts) > LAYERS_MAX or len(counts) > LAYERS_MAX + 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {LAYERS_MAX + 2} stages of at most {LAYERS_MAX} blocks")
    return counts


stage_list.__name__ = "list"  # argparse names the type in its "invalid <type> value" fallback


def check_recipe_flags(args, fp8: bool) -> None:
    """ValueError (one line, exit 2) for a recipe flag its precision cannot take: --fp8-attention without the FP8
    recipe, --fp4-healing-step without --fp4."""
    if args.fp8_attention and not fp8:
        raise ValueError("--fp8-attention needs --fp8 (or --fp4): FP8 attention is part of the FP8 recipe")
    if args.fp4_healing_step is not None and not args.fp4:
        raise ValueError("--fp4-healing-step needs --fp4: only FP4 runs switch to FP8 at a healing step")


LAYOUT_DEGREES = {
    "tp": "tensor-parallel degree: GPUs that split each layer's matrices (default 1)",
    "pp": "pipeline-parallel degree: stages the layers are split into (default 1)",
    "vp": "virtual pipeline stages per GPU, for the interleaved schedule (default 1)",
    "cp": "context-parallel degree: GPUs that split each sequence (default 1)",
    "ep": "expert-parallel degree: GPUs that split an MoE layer's experts (default 1)",
}
"""predict's layout flags and what each degree splits."""


def catalog_flag(p) -> None:
    p.add_argument(
        "--catalog", action="append", default=[], metavar="TOML", help="an extra hardware catalog file (repeatable)"
    )


def job_flags(p) -> None:
    """What predict and plan share: the model, the cluster, the calibration, the batch and the output."""
    p.add_argument(
        "--model",
        default="gpt3-175b",
        metavar="NAME",
        help="the model, a preset or benchmark (default gpt3-175b): "
        + ", ".join(f"{b.reference_preset} ({b.name})" for b in benchmarks.BENCHMARKS.values())
        + ", any preset",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model field, e.g. --set model.n_layers=48 (repeatable)",
    )
    p.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        metavar="GPU",
        help=f"the GPU (default {DEFAULT_GPU}): {', '.join(shipped_keys('gpus'))} or a key of a --catalog file",
    )
    p.add_argument(
        "--gpus",
        "--world-size",
        dest="gpus",
        type=int_flag(1, DEGREE_MAX),
        required=True,
        metavar="N",
        help="number of GPUs in the cluster (= ranks)",
    )
    p.add_argument(
        "--node",
        metavar="NODE",
        help="node type (default: the GPU's usual one): hgx-h100, nd-h200-v5, gb200-nvl72, hgx-b300, mi355x-oam, ...",
    )
    p.add_argument(
        "--fabric",
        metavar="FABRIC",
        help="scale-out network (default: the node's): ib-ndr, ib-ndr-sharp, ib-xdr, ib-hdr, roce, roce-800",
    )
    p.add_argument(
        "--calibration",
        metavar="SET",
        help="fitted efficiency set: v3.0, v3.1, v4.0, v4.1, v5.0, v5.1 (default newest), or measured (the set "
        "`sim calibrate` fitted on your runs of this GPU, in the file $SCALETRAIN_EFFICIENCY names)",
    )
    catalog_flag(p)
    p.add_argument(
        "--gbs",
        type=int_flag(1, GBS_MAX),
        metavar="N",
        help="global batch size in sequences (default: a benchmark's reference batch; plan searches the "
        "benchmark's batches without it)",
    )
    p.add_argument(
        "--fp4",
        action="store_true",
        help="FP4 GEMMs (NVFP4/MXFP4) where FP8 would apply, on the FP8 recipe (implies --fp8 for predict)",
    )
    p.add_argument(
        "--fp8-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the attention core (flash attention, forward and backward) in FP8 on FP8 layouts, at the catalog's "
        "FP8 attention rate (NeMo's FP8_DPA=1); default: what the benchmark's reference recipe does (bf16 for every "
        "benchmark today, the MLCommons llama2_70b_lora reference included). predict needs --fp8 or --fp4 for it",
    )
    p.add_argument(
        "--fp4-healing-step",
        type=int_flag(0, HEALING_MAX),
        default=None,
        metavar="N",
        help="with --fp4: the step after which the run continues with FP8 GEMMs, the steps and evaluations after it "
        "priced at the FP8 rates; 0 = no switch (default: the benchmark's recipe, 350 for llama2_70b_lora as its "
        "published FP4 configs set HEALING_ITER, else 0)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    pretrain_report.token_flags(p)
    p.add_argument(
        "--moe-imbalance",
        type=float_flag(1.0, float(DEGREE_MAX)),
        default=1.0,
        metavar="X",
        help="MoE: the busiest expert rank's tokens over the mean (>= 1, default 1)",
    )


def layout_flags(p) -> None:
    """predict's one layout: the parallel degrees, micro-batch, precision, recomputation, sharding, schedule."""
    for name, what in LAYOUT_DEGREES.items():
        p.add_argument(f"--{name}", type=int_flag(1, DEGREE_MAX), default=1, metavar="N", help=what)
    p.add_argument(
        "--mbs",
        type=int_flag(1, GBS_MAX),
        default=1,
        metavar="N",
        help="micro-batch size in sequences (default 1)",
    )
    p.add_argument("--fp8", action="store_true", help="run the GEMMs in FP8 (the MLPerf recipes do)")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism alongside tensor parallelism")
    p.add_argument(
        "--recompute",
        default="none",
        choices=("none", "selective", "full"),
        help="activation recomputation: none (default), selective (attention) or full (every layer)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=1,
        choices=(0, 1, 2, 3),
        help="optimizer sharding: 0 none, 1 distributed optimizer (default), 2 gradients sharded too, reduce-scattered "
        "every micro-batch, weights whole (FSDP without resharding after forward, as Llama 3 trained), 3 fully sharded",
    )
    p.add_argument(
        "--schedule",
        default="",
        choices=("", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"),
        help="the pipeline schedule to simulate (default: interleaved_1f1b with --vp above 1, else 1f1b); zb_h1 is "
        "zero bubble (Qi et al. 2023): 1F1B with each weight gradient deferred into the bubble, at 1F1B's memory "
        "(the simulator's; the trainer runs gpipe, 1f1b and interleaved_1f1b)",
    )
    p.add_argument(
        "--grad-dtype",
        default="auto",
        choices=("auto", "bf16", "fp32"),
        help="gradient buffer and reduction dtype; auto = bf16 with --fp8 (the MLPerf FP8 "
        "recipes), else fp32 (Megatron's default)",
    )


def split_flags(p, plan: bool = False) -> None:
    """predict's and plan's uneven pipeline split (Megatron's first/last stage layer counts, or one per stage)."""
    scope = (
        "; plan then searches only the pipelined layouts (pp >= 2) whose pp x vp stages it splits"
        if plan
        else "; needs --pp 2 or more"
    )
    p.add_argument(
        "--pp-first-layers",
        type=int_flag(0, LAYERS_MAX),
        default=None,
        metavar="N",
        help="transformer blocks of the first virtual pipeline stage (with the embedding; 0 = only the embedding), "
        "the other stages splitting the rest evenly: Megatron's --decoder-first-pipeline-num-layers" + scope,
    )
    p.add_argument(
        "--pp-last-layers",
        type=int_flag(0, LAYERS_MAX),
        default=None,
        metavar="N",
        help="transformer blocks of the last virtual pipeline stage (with the output layer and loss; 0 = only "
        "those): Megatron's --decoder-last-pipeline-num-layers" + scope,
    )
    p.add_argument(
        "--pp-stage-layers",
        type=stage_list,
        default=None,
        metavar="N,N,...",
        help="blocks of every virtual pipeline stage in order (pp x vp counts summing to the model's blocks; stage k "
        "on pipeline rank k %% pp; only the first and last may be 0), instead of --pp-first-layers/--pp-last-layers"
        + scope,
    )
