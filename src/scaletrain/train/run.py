"""`scaletrain train`: one run of the Trainer through the training loop (loop.py); exit codes by outcome.

Observers (the MLPerf log of the command line, bench/harness.py) are attached by the caller: a plain Python call
`train(cfg)` trains, writes config.json, metrics.jsonl, TensorBoard and result.json, and never imports `bench/`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from scaletrain.config import Config
from scaletrain.diskfull import writing
from scaletrain.train.protocol import Observer

ObserverFactory = Callable[[Config, Any, Path, bool], Sequence[Observer]]
"""(cfg, engine, run_dir, writer) -> the observers of that run; called once the engine (a Trainer) is built."""


def default_console() -> Console:
    """Console for tables: the terminal's width, or 120 columns when output goes to a file or pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=120)


def _make_engine(cfg: Config, seed: int, run_dir: Path):
    from scaletrain.train.engine import Trainer

    return Trainer(cfg, run_dir, seed=seed)


def train(
    cfg: Config, console: Console | None = None, overwrite: bool = False, observers: ObserverFactory | None = None
) -> dict:
    """One run to the target: config.json, metrics.jsonl, result.json and TensorBoard in train.run_dir, plus what
    the `observers` write (`scaletrain train` attaches the MLPerf log, mllog.txt).

    Under torchrun every rank trains; rank 0 alone writes files and prints. The run directory is locked for the
    run; one that holds another run is refused unless resumed or `overwrite` (see train/rundir.py), and
    resuming (auto) a run that already finished returns its result without training again.
    """
    from scaletrain.train.distributed import init_distributed, is_writer
    from scaletrain.train.engine import resolve_device
    from scaletrain.train.loop import run_loop
    from scaletrain.train.rundir import RunDirClaim

    console = console or default_console()
    run_dir = Path(cfg.train.run_dir)
    init_distributed(resolve_device(cfg.train.device))
    writer = is_writer()
    with RunDirClaim(
        run_dir,
        writer=writer,
        resume=cfg.checkpoint.resume,
        overwrite=overwrite,
        checkpoint_dir=Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None,
    ) as claim:
        engine = _make_engine(cfg, cfg.train.seed, run_dir)  # validates the layout and the data first
        finished = claim.decide()
        if finished is not None:
            if writer:
                console.print(
                    f"{run_dir} already finished ({finished['status']}, {outcome_of(finished)}); nothing "
                    f"to train (--overwrite starts it again)",
                    soft_wrap=True,
                )
            return finished
        claim.apply()
        if writer:
            with writing(run_dir / "config.json"):
                cfg.save(run_dir)
            for line in start_lines(cfg, engine, run_dir):
                console.print(line, soft_wrap=True, highlight=False, markup=False)
        attached = observers(cfg, engine, run_dir, writer) if observers is not None else ()
        result = run_loop(cfg, engine, run_dir, attached, writer=writer)
    if not writer:
        return result
    table = Table(title=f"scaletrain train ({cfg.preset or 'custom'})")
    for column in ("status", "time to train", "steps", "tokens", "eval loss", "target"):
        table.add_column(column)
    table.add_row(
        result["status"],
        f"{result['time_to_train_s']:.1f} s",
        str(result["steps"]),
        f"{result['tokens']:,}",
        _fmt(result.get("eval_loss")),
        f"{cfg.train.target_eval_loss}",
    )
    console.print(table)
    console.print(f"run directory: {run_dir}")
    return result


# Exit status of `train` and `bench` by outcome (README "Exit status"): a run that stopped as configured is not a
# failure, so `torchrun --max-restarts` and schedulers do not restart it; 2 (bad input) comes from the CLI, and so
# does a full disk, which no restart cures until space is freed (then --resume auto continues the run).
EXIT_CODES = {"converged": 0, "budget_exhausted": 0, "diverged": 1, "crashed": 1, "disk_full": 2}


def outcome_of(result: dict) -> str:
    """result.json's "outcome", derived from status/reason/error for results written before it existed."""
    if result.get("outcome"):
        return result["outcome"]
    if result.get("error"):
        return "crashed"
    if result.get("status") == "success":
        return "converged"
    return "budget_exhausted" if str(result.get("reason") or "").startswith("step budget") else "diverged"


def exit_code(result: dict) -> int:
    """0 = converged or stopped by the step budget, 1 = diverged or crashed, 2 = stopped by a full disk."""
    return EXIT_CODES.get(outcome_of(result), 1)


def torch_device_name(device) -> str:
    """'CPU' or the CUDA device name with dashes (as in submission_platform)."""
    import torch

    return torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "CPU"


def start_lines(cfg: Config, engine, run_dir: Path) -> list[str]:
    """What a run says before its first step: what it trains, on what data, to which target within which budget,
    where its files go, and on what layout and device."""
    from scaletrain.train.schedule import eval_every_steps

    if cfg.data.format == "sft":
        from scaletrain.data.sft_paths import resolve_paths
    else:
        from scaletrain.data.corpus import resolve_paths
    train, valid, tokenizer = resolve_paths(cfg.data)  # resolved already by the engine: cannot fail here
    steps = engine._planned_steps()
    budget = "train.max_steps" if cfg.train.max_steps else "the lr decay's end"
    lines = [
        f"train {cfg.preset or 'custom config'}: run directory {run_dir}",
        f"  data: train {train}, valid {valid}"
        + (f", tokenizer {tokenizer}" if tokenizer else "")
        + (" (SFT pairs)" if cfg.data.format == "sft" else ""),
        f"  target: eval loss <= {cfg.train.target_eval_loss:g}, evaluated every {eval_every_steps(cfg)} steps; "
        f"at most {steps} steps ({budget}) of {cfg.train.global_batch_size} sequences x {cfg.model.seq_len} tokens",
        f"  layout: {engine.layout.describe()} ({engine.layout.data_parallel_kind}), device {engine.device}"
        f"{_gemm_note(cfg, engine.device)}",
    ]
    if engine.resume_path is not None:
        lines.append(f"  resuming from {engine.resume_path}")
    return lines


def _gemm_note(cfg: Config, device) -> str:
    """A word when a bf16 run's GEMMs are emulated (train/cpu_bf16.py), so its speed is not a surprise."""
    from scaletrain.train.cpu_bf16 import bf16_gemm_context

    if isinstance(bf16_gemm_context(device, cfg.train.dtype, cfg.train.compile), contextlib.nullcontext):
        return ""
    return " (no bf16 GEMM on this CPU: bf16 operands multiplied in fp32)"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_dry_run(result: dict, console: Console | None = None) -> None:
    """The --dry-run report: layout, per-rank parameter shards (grouped) and the memory estimate."""
    console = console or default_console()
    console.print(
        f"[bold]dry run[/bold] {result['layout']} ({result['data_parallel']}), "
        f"{result['world_size']:,} ranks, {result['device']} {result['device_memory_gib']:.1f} GiB"
    )
    experts = result.get("experts")
    if experts:
        console.print(
            f"  routed experts: {experts['per_ep_rank']} of {experts['per_layer']} per layer on each of ep="
            f"{experts['ep']} ranks, FSDP-sharded over {experts['fsdp_ranks']} ranks"
        )
    for r in result["ranks"]:
        table = Table(title=f"rank {r['rank']} {r['coords']} stages {r['stages']}")
        for col in ("parameter", "global shape", "local shard", "count"):
            table.add_column(col, justify="left" if col == "parameter" else "right")
        groups: dict = {}
        for s in r["shards"]:
            # blocks.<i>.x -> blocks.*.x: one row per parameter kind, with how many blocks hold it.
            parts = s["name"].split(".")
            key = ".".join(["blocks", "*", *parts[2:]]) if parts[0] == "blocks" else s["name"]
            entry = groups.setdefault((key, tuple(s["global"]), tuple(s["local"])), 0)
            groups[(key, tuple(s["global"]), tuple(s["local"]))] = entry + 1
        for (name, g, loc), n in groups.items():
            table.add_row(name, "x".join(map(str, g)), "x".join(map(str, loc)), str(n))
        console.print(table)
        mem = r["memory_gib"]
        # An uneven split (parallel.pp_first_layers / pp_last_layers / pp_stage_layers) names each stage's blocks.
        per_stage = f" (blocks per stage {r['stage_blocks']})" if result.get("uneven_stages") else ""
        console.print(
            f"  local parameters {r['local_params']:,}; layers {mem['layers_on_rank']}{per_stage}, "
            f"in-flight micro-batches {mem['in_flight_microbatches']:.2f}"
        )
        console.print(
            "  memory estimate (GiB): "
            + ", ".join(
                f"{k} {v:.2f}" for k, v in mem.items() if k not in ("total", "in_flight_microbatches", "layers_on_rank")
            )
            + f" -> [bold]total {mem['total']:.1f}[/bold]"
        )
    verdict = "[green]fits[/green]" if result["fits"] else "[red]does not fit[/red]"
    console.print(
        f"max {result['max_memory_gib']:.1f} GiB of {result['usable_memory_gib']:.1f} GiB usable "
        f"({result['device_memory_gib']:.1f} GiB less the runtime reserve): {verdict}"
    )
