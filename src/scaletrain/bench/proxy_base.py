"""The pretrained bases of the CPU proxies that start from a checkpoint, each made once.

MLPerf's llama2_70b_lora fine-tunes a pretrained Llama 2 70B and llama31_405b continues pre-training Meta's Llama 3.1
405B; both load it in the untimed init. A proxy's base is the preset its BenchmarkSpec names (`proxy_base_preset`:
`llama-proxy` for the LoRA proxy, `llama31-8b-proxy` for the 405B proxy) trained to that preset's target on the
default corpus (a minute or two on 2 cores), saved as a scaletrain checkpoint under <data dir>/<preset>-base and
reused by every later benchmark. Its seed is fixed, so every machine builds the same base.
"""

from __future__ import annotations

import os
from pathlib import Path

from scaletrain import benchmarks
from scaletrain.checkpoint import store
from scaletrain.config import Config, default_data_dir, resolve

from .harness import run_once

BASE_SEED = 1234


def base_preset(cfg: Config) -> str:
    """The preset cfg's proxy benchmark starts from; ValueError for a benchmark without a base."""
    name = cfg.bench.benchmark
    preset = benchmarks.get(name).proxy_base_preset if benchmarks.is_proxy(name) else ""
    if not preset:
        raise ValueError(f"bench.benchmark={name!r} has no pretrained proxy base")
    return preset


def proxy_base_dir(cfg: Config) -> Path:
    """Where the proxy base of cfg's benchmark lives for this config's data directory."""
    return default_data_dir(cfg.data) / f"{base_preset(cfg)}-base"


def ensure_proxy_base(cfg: Config, console=None, extra_overrides: tuple[str, ...] = ()) -> str:
    """Path of the proxy base checkpoint, training and saving it first if there is none.

    `extra_overrides` (--set style) change the base's recipe; tests use them to build a tiny base the same way.
    """
    from scaletrain.train.engine import Trainer

    preset = base_preset(cfg)
    root = proxy_base_dir(cfg)
    found = store.complete_checkpoints(root / "checkpoints")
    if found:
        return str(found[-1])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise store.CheckpointError(
            f"no proxy base under {root}: build it once in a single process "
            f"(`scaletrain bench --benchmark {cfg.bench.benchmark} --runs 1`), then launch torchrun"
        )
    base = resolve(
        preset,
        overrides=[
            f"data.data_dir={cfg.data.data_dir}",
            f"train.run_dir={root}",
            f"train.seed={BASE_SEED}",
            "checkpoint.keep=1",
            f"train.progress={str(cfg.train.progress).lower()}",
            *extra_overrides,
        ],
    )
    if console is not None:
        console.print(f"[bold]building the proxy base[/bold]: {preset} on the default corpus -> {root} (once)")
    root.mkdir(parents=True, exist_ok=True)
    base.save(root)
    engine = Trainer(base, root, seed=BASE_SEED)
    result = run_once(base, engine, root)
    if result["status"] != "success":
        raise RuntimeError(
            f"proxy base training did not reach eval loss {base.train.target_eval_loss}: {result.get('reason')}"
        )
    # No loop state: the base is loaded as weights (checkpoint.init_from), never resumed as a timed run. A recipe
    # that asks for checkpoints has its final step saved by the loop already (with its loop state, read by nobody).
    if engine.checkpointer.last_step != engine.step:
        engine.save_checkpoint({})
    return str(store.complete_checkpoints(root / "checkpoints")[-1])
