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


def train(cfg: Config, console: Console | None = None) -> dict:
    """One run to the target: config.json, metrics.jsonl, mllog.txt, result.json and TensorBoard in train.run_dir."""
    from scaletrain.bench.harness import run_once
    console = console or default_console()
    run_dir = Path(cfg.train.run_dir)
    cfg.save(run_dir)
    engine = _make_engine(cfg, cfg.train.seed, run_dir)
    result = run_once(cfg, engine, run_dir)
    table = Table(title=f"scaletrain train ({cfg.preset or 'custom'})")
    for column in ("status", "time to train", "steps", "tokens", "eval loss", "target"):
        table.add_column(column)
    table.add_row(result["status"], f"{result['time_to_train_s']:.1f} s", str(result["steps"]),
                  f"{result['tokens']:,}", _fmt(result.get("eval_loss")), f"{cfg.train.target_eval_loss}")
    console.print(table)
    console.print(f"run directory: {run_dir}")
    return result


def bench(cfg: Config, out_dir: Path, console: Console | None = None) -> dict:
    """cfg.bench.runs runs with distinct seeds under out_dir/run_i, checked and scored into summary.json."""
    from scaletrain.bench.harness import run_benchmark
    return run_benchmark(cfg, _make_engine, out_dir, console=console or default_console())


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"
