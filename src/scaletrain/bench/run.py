"""`scaletrain bench`: N timed runs of the Trainer, each through the training loop with the MLPerf observer."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from scaletrain.config import Config
from scaletrain.train.run import default_console, exit_code, torch_device_name

from .harness import run_benchmark


def bench_exit_code(summary: dict) -> int:
    """0 unless a run diverged or crashed, a log failed the compliance check, or a complete submission failed the RCP
    check (not converging is a score)."""
    if any(exit_code(r) for r in summary.get("runs", [])):
        return 1
    return 1 if summary.get("compliant_all") is False or summary.get("rcp_ok") is False else 0


def _make_engine(cfg: Config, seed: int, run_dir: Path):
    from scaletrain.train.engine import Trainer

    return Trainer(cfg, run_dir, seed=seed)


def bench(cfg: Config, out_dir: Path, console: Console | None = None, overwrite: bool = False) -> dict:
    """cfg.bench.runs runs with distinct seeds under out_dir/run_i, checked and scored into summary.json.

    out_dir is locked and treated like a run directory (train/rundir.py): one that holds another benchmark is
    refused unless --resume auto (keep finished runs) or `overwrite`; the default runs/bench is moved aside.
    """
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
