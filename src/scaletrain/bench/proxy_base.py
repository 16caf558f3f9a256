"""The pretrained base of the llama2_70b_lora CPU proxy: llama-proxy trained on the default corpus, made once.

MLPerf's LoRA benchmark starts from a pretrained Llama 2 70B loaded in the untimed init. The proxy's base is the
`llama-proxy` preset trained to its target on Shakespeare (about a minute and a half on 2 cores), saved as a
scaletrain checkpoint under <data dir>/llama-proxy-base and reused by every later benchmark. Its seed is fixed,
so every machine builds the same base.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.checkpoint import store
from scaletrain.config import Config, default_data_dir, resolve

BASE_PRESET = "llama-proxy"
BASE_SEED = 1234


def proxy_base_dir(cfg: Config) -> Path:
    """Where the proxy base lives for this config's data directory."""
    return default_data_dir(cfg.data) / "llama-proxy-base"


def ensure_proxy_base(cfg: Config, console=None, extra_overrides: tuple[str, ...] = ()) -> str:
    """Path of the proxy base checkpoint, training and saving it first if there is none.

    `extra_overrides` (--set style) change the base's recipe; tests use them to build a tiny base the same way.
    """
    import os

    root = proxy_base_dir(cfg)
    found = store.complete_checkpoints(root / "checkpoints")
    if found:
        return str(found[-1])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise store.CheckpointError(
            f"no proxy base under {root}: build it once in a single process "
            "(`scaletrain bench --preset llama2-70b-lora-proxy --runs 1`), then launch torchrun"
        )
    from scaletrain.bench.harness import run_once
    from scaletrain.train.engine import Trainer

    base = resolve(
        BASE_PRESET,
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
        console.print(f"[bold]building the proxy base[/bold]: {BASE_PRESET} on the default corpus -> {root} (once)")
    root.mkdir(parents=True, exist_ok=True)
    base.save(root)
    engine = Trainer(base, root, seed=BASE_SEED)
    result = run_once(base, engine, root)
    if result["status"] != "success":
        raise RuntimeError(
            f"proxy base training did not reach eval loss {base.train.target_eval_loss}: {result.get('reason')}"
        )
    # No loop state: the base is loaded as weights (checkpoint.init_from), never resumed as a timed run.
    engine.save_checkpoint({})
    return str(store.complete_checkpoints(root / "checkpoints")[-1])
