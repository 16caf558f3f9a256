"""`scaletrain train` and `scaletrain bench`: the Trainer driven by the MLPerf harness."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from scaletrain.config import Config


def default_console() -> Console:
    """Console for tables: the terminal's width, or 120 columns when output goes to a file or pipe."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=120)


def _make_engine(cfg: Config, seed: int, run_dir: Path):
    from scaletrain.train.engine import Trainer

    return Trainer(cfg, run_dir, seed=seed)


def train(cfg: Config, console: Console | None = None, overwrite: bool = False) -> dict:
    """One run to the target: config.json, metrics.jsonl, mllog.txt, result.json and TensorBoard in train.run_dir.

    Under torchrun every rank trains; rank 0 alone writes files and prints. The run directory is locked for the
    run; one that holds another run is refused unless resumed or `overwrite` (see train/rundir.py), and
    resuming (auto) a run that already finished returns its result without training again.
    """
    from scaletrain.bench.harness import run_once
    from scaletrain.train.distributed import init_distributed, is_writer
    from scaletrain.train.engine import resolve_device
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
            cfg.save(run_dir)
            console.print(
                f"layout: {engine.layout.describe()} ({engine.layout.data_parallel_kind}), device {engine.device}"
            )
        result = run_once(
            cfg,
            engine,
            run_dir,
            dp_size=engine.layout.dp,
            platform=cfg.bench.platform or engine.platform,
            writer=writer,
        )
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
# failure, so `torchrun --max-restarts` and schedulers do not restart it; 2 (bad input) comes from the CLI.
EXIT_CODES = {"converged": 0, "budget_exhausted": 0, "diverged": 1, "crashed": 1}


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
    """0 = converged or stopped by the step budget, 1 = diverged or crashed."""
    return EXIT_CODES.get(outcome_of(result), 1)


def bench_exit_code(summary: dict) -> int:
    """0 unless a run diverged or crashed, or a log failed the compliance check (not converging is a score)."""
    if any(exit_code(r) for r in summary.get("runs", [])):
        return 1
    return 1 if summary.get("compliant_all") is False else 0


def bench(cfg: Config, out_dir: Path, console: Console | None = None, overwrite: bool = False) -> dict:
    """cfg.bench.runs runs with distinct seeds under out_dir/run_i, checked and scored into summary.json.

    out_dir is locked and treated like a run directory (train/rundir.py): one that holds another benchmark is
    refused unless --resume auto (keep finished runs) or `overwrite`; the default runs/bench is moved aside.
    """
    from scaletrain.bench.harness import run_benchmark
    from scaletrain.parallel.layout import Layout
    from scaletrain.train.distributed import init_distributed, is_writer
    from scaletrain.train.engine import resolve_device
    from scaletrain.train.rundir import RunDirClaim

    device = resolve_device(cfg.train.device)
    _, world = init_distributed(device)
    layout = Layout.from_config(cfg, world)  # every layout problem before the first run directory is made
    if device.type == "cpu":
        from scaletrain.train.host import check_host_memory

        check_host_memory(cfg, layout)
    name = torch_device_name(device)
    writer = is_writer()
    with RunDirClaim(
        out_dir,
        writer=writer,
        resume=cfg.checkpoint.resume,
        overwrite=overwrite,
        bench=True,
        checkpoint_dir=Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None,
        flag="--out",
    ) as claim:
        claim.decide()
        claim.apply()
        return run_benchmark(
            cfg,
            _make_engine,
            out_dir,
            console=console or default_console(),
            dp_size=layout.dp,
            platform=cfg.bench.platform or f"{world}x{name}",
            writer=writer,
        )


def torch_device_name(device) -> str:
    """'CPU' or the CUDA device name with dashes (as in submission_platform)."""
    import torch

    return torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "CPU"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_dry_run(result: dict, console: Console | None = None) -> None:
    """The --dry-run report: layout, per-rank parameter shards (grouped) and the memory estimate."""
    console = console or default_console()
    console.print(
        f"[bold]dry run[/bold] {result['layout']} ({result['data_parallel']}), "
        f"{result['world_size']:,} ranks, {result['device']} {result['device_memory_gib']:.1f} GiB"
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
        console.print(
            f"  local parameters {r['local_params']:,}; layers {mem['layers_on_rank']}, "
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
