"""How to run a priced layout: the `scaletrain train` overrides and the Slurm line of a plan's layout.

The overrides set every trainer field the layout depends on (`parallel.tp/pp/pp_virtual/pp_schedule/cp/
activation_checkpoint/sequence_parallel`, an uneven split's `parallel.pp_first_layers/pp_last_layers/
pp_stage_layers`, `train.micro_batch_size/global_batch_size/fp8`); `parallel.dp_shard` keeps its default -1 (the
rest of the world), so data parallelism is FSDP2 over dp·cp, which the simulator prices as ZeRO-3 (`plan
--as-trained`, `predict --from-config`). The Slurm line is `scripts/slurm/train.sbatch` (one srun task per
node, each running torchrun with NPROC_PER_NODE workers). Torch-free: strings from the simulator's layout dict.
"""

from __future__ import annotations

import shlex

from scaletrain import benchmarks

SBATCH_SCRIPT = "scripts/slurm/train.sbatch"
"""The project's multi-node launcher (README "Multi-node", docs/multinode.md)."""
SBATCH_GPUS_PER_NODE = 8
"""What train.sbatch asks for (#SBATCH --gpus-per-node=8, NPROC_PER_NODE=8) unless told otherwise."""


def preset_of(model: str) -> str:
    """The trainer preset behind a `--model` value (a benchmark name means its reference preset)."""
    alias = benchmarks.BENCHMARKS.get(model)
    return alias.reference_preset if alias else model


def train_overrides(layout: dict) -> list[str]:
    """`KEY=VALUE` trainer overrides that run the simulator layout `layout` (a `ClusterLayout` as a dict).

    ValueError for what the trainer cannot run: FP4 GEMMs (the trainer's FP8 is torchao's; it has no FP4 recipe).
    """
    if layout.get("fp4"):
        raise ValueError("FP4: the trainer has no FP4 recipe (train.fp8 is torchao's FP8)")
    out = [f"parallel.tp={layout['tp']}", f"parallel.pp={layout['pp']}"]
    if layout["pp"] > 1:
        schedule = layout.get("schedule") or ("interleaved_1f1b" if layout["vp"] > 1 else "1f1b")
        out += [f"parallel.pp_virtual={layout['vp']}", f"parallel.pp_schedule={schedule}"]
        # An uneven split (predict's --pp-first-layers / --pp-last-layers / --pp-stage-layers): the same blocks per
        # stage; the layout dict carries these keys only when one is set.
        if layout.get("pp_stage_layers"):
            out.append(f"parallel.pp_stage_layers={','.join(map(str, layout['pp_stage_layers']))}")
        for key in ("pp_first_layers", "pp_last_layers"):
            if layout.get(key, -1) >= 0:
                out.append(f"parallel.{key}={layout[key]}")
    out.append(f"parallel.cp={layout['cp']}")
    if layout.get("ep", 1) > 1:
        out.append(f"parallel.ep={layout['ep']}")
    if layout["tp"] > 1 and not layout.get("sp", True):
        out.append("parallel.sequence_parallel=false")
    out += [
        f"parallel.activation_checkpoint={layout['recompute']}",
        f"train.micro_batch_size={layout['mbs']}",
        f"train.global_batch_size={layout['gbs']}",
        f"train.fp8={'true' if layout['fp8'] else 'false'}",
    ]
    return out


def slurm_command(gpus: int, gpus_per_node: int, scaletrain_args: list[str]) -> str | None:
    """The `sbatch ... scripts/slurm/train.sbatch ARGS` line for `gpus` ranks on nodes of `gpus_per_node` GPUs
    (fewer on a single node); None when whole nodes cannot make exactly `gpus` ranks."""
    per_node = min(gpus, gpus_per_node)
    if gpus % per_node:
        return None
    env, extra = [], []
    if per_node != SBATCH_GPUS_PER_NODE:
        env, extra = [f"NPROC_PER_NODE={per_node}"], [f"--gpus-per-node={per_node}"]
    return shlex.join([*env, "sbatch", "--nodes", str(gpus // per_node), *extra, SBATCH_SCRIPT, *scaletrain_args])


def run_lines(model: str, model_sets: list[str], layout: dict, gpu: str, gpus_per_node: int) -> dict:
    """{"train_overrides", "train_command", "dry_run_command", "slurm_command"} for `layout` of `--model model`
    (with the `--set` model overrides `model_sets`) on `gpu`s, nodes of `gpus_per_node`; {"run_error": why} when the
    trainer cannot run it. slurm_command is None when whole nodes cannot make exactly the layout's GPU count."""
    try:
        sets = [*model_sets, *train_overrides(layout)]
    except ValueError as exc:
        return {"run_error": str(exc)}
    args = ["--preset", preset_of(model)] + [a for s in sets for a in ("--set", s)]
    gpus = layout["gpus"]
    dry = ["scaletrain", "train", "--dry-run", "--world-size", str(gpus), "--gpu", gpu, *args]
    return {
        "train_overrides": sets,
        "train_command": shlex.join(["scaletrain", "train", *args]),
        "dry_run_command": shlex.join(dry),
        "slurm_command": slurm_command(gpus, gpus_per_node, ["train", *args]),
    }


AS_PRICED = (
    "tp",
    "pp",
    "vp",
    "cp",
    "ep",
    "dp",
    "mbs",
    "gbs",
    "fp8",
    "zero",
    "recompute",
    "bf16_grads",
    "schedule",
    "pp_first_layers",
    "pp_last_layers",
    "pp_stage_layers",
)
"""The fields of a priced layout that the trainer's run of it must reproduce for the price to hold."""


def plan_run_lines(model: str, model_sets: list[str], layout: dict, gpu: str, gpus_per_node: int, sim_inputs) -> dict:
    """`run_lines` of a planned layout, checked through the trainer's own layout resolution: `sim_inputs` (the
    CLI's adapter parallel/sim_layout.py, config -> the layout as `train` runs it) on the trainer config the
    overrides make. Adds "run_as_priced": whether that is the layout the plan priced (ZeRO, gradient dtype,
    schedule and all), and "run_differs" (the fields that differ, as "field planned->trained") when it is not, or
    "run_error" when the trainer refuses the config (the trainer's reason)."""
    from scaletrain.sim.workload import load_config

    out = run_lines(model, model_sets, layout, gpu, gpus_per_node)
    if "run_error" in out:
        return out
    try:
        _, trained = sim_inputs(load_config(model, tuple(out["train_overrides"])), layout["gpus"])
    except ValueError as exc:  # ConfigError / LayoutError: the trainer's one-line reason
        return {**out, "run_error": str(exc)}
    as_run = {
        **{k: getattr(trained, k) for k in AS_PRICED if k not in ("dp", "schedule", "pp_stage_layers")},
        "dp": trained.dp,
        "schedule": trained.pipeline_schedule,
        "pp_stage_layers": list(trained.pp_stage_layers),
    }
    # Dense layouts print no ep, and even splits no pp_* keys.
    planned = {"ep": 1, "pp_first_layers": -1, "pp_last_layers": -1, "pp_stage_layers": [], **layout}
    differs = [f"{k} {planned[k]}->{as_run[k]}" for k in AS_PRICED if planned.get(k) != as_run[k]]
    if trained.zero_shards != layout["dp"] * layout["cp"] and layout["zero"] == 3:
        differs.append(f"zero_shards {layout['dp'] * layout['cp']}->{trained.zero_shards}")
    return {**out, "run_as_priced": not differs, **({"run_differs": differs} if differs else {})}


def print_run_lines(run: dict, out=None) -> None:
    """The run lines of one planned layout, under its prediction in `plan`'s table."""
    if "run_error" in run:
        print(f"  run: not runnable by scaletrain train: {run['run_error']}", file=out)
        return
    print(f"  run: {run['train_command']}", file=out)
    if run["slurm_command"]:
        print(f"  slurm: {run['slurm_command']}", file=out)
    if not run.get("run_as_priced", True):
        print(f"  trained as: {', '.join(run['run_differs'])} (plan --as-trained prices that)", file=out)
