"""A scripted Engine: no model, deterministic fake losses, driven by the real training loop (train/loop.py) in tests
and dry runs of the MLPerf protocol.

`scripted_run` writes a whole benchmark log through the real loop, MLPerf observer and MLLOG writer with this engine,
so a log at the official hyperparameters can be checked by MLCommons' checker without the hardware those need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from scaletrain.config import Config, resolve
from scaletrain.train.protocol import NonFiniteLoss

from .harness import run_once

__all__ = ["ScriptedEngine", "scripted_run", "scripted_submission", "lora_reference_config", "LORA_REFERENCE_SCHEDULE"]

# The llama2_70b_lora reference's batch and LR schedule (mlcommons/training llama2_70b_lora README and its RCPs:
# max_steps 1024 at GBS 8, warmup_ratio 0, cosine to 0, HF AdamW betas 0.9/0.999), as overrides on the
# llama2-70b-lora preset, which is the at-scale recipe (GBS 64, the same 1024-step schedule).
LORA_REFERENCE_SCHEDULE = (
    "train.global_batch_size=8",
    "optim.decay_samples=8192",
    "optim.warmup_samples=0",
    "optim.end_lr_ratio=0.0",
    "optim.beta2=0.999",
)


class ScriptedEngine:
    """Engine whose evaluate() returns `eval_losses` in turn (the last one repeats) and whose train_step is instant.

    `nan_at_step` (1-based, counted from init) makes that train_step raise NonFiniteLoss like a real engine would.
    `calls` records the protocol calls in order, so tests can assert the loop drove the engine correctly. It never
    saves a checkpoint, receives no stop signal and resumes nothing.
    """

    def __init__(
        self,
        cfg: Config,
        eval_losses: Sequence[float] = (3.0, 2.8, 2.68),
        eval_tokens: int = 11_590_004,
        nan_at_step: int | None = None,
        eval_samples: int = 173,
        train_samples: int = 3901,
    ) -> None:
        self.seq_len = cfg.model.seq_len
        self.global_batch_size = cfg.train.global_batch_size
        self.eval_tokens = eval_tokens
        self.eval_samples = eval_samples  # llama2_70b_lora: GovReport's 173 validation / 3901 training sequences
        self.train_samples = train_samples
        self.lr = cfg.optim.lr
        self.eval_losses = list(eval_losses)
        self.nan_at_step = nan_at_step
        self.step = 0
        self.n_evals = 0
        self.calls: list[str] = []
        self.finished: dict | None = None
        self.resume_path: Path | None = None

    def resume_state(self) -> dict | None:
        """Nothing to resume."""
        return None

    def init(self) -> None:
        """Nothing to build; resets the counters, as a real engine resets to the seed's initial state."""
        self.calls.append("init")
        self.step = 0
        self.n_evals = 0

    def train_step(self) -> dict:
        """Count a step; NaN at `nan_at_step`."""
        self.calls.append("train_step")
        self.step += 1
        if self.nan_at_step is not None and self.step == self.nan_at_step:
            raise NonFiniteLoss(self.step, math.nan)
        return {"loss": 3.5 - 0.001 * self.step, "lr": self.lr}

    def evaluate(self) -> float:
        """The next scripted eval loss."""
        self.calls.append("evaluate")
        loss = self.eval_losses[min(self.n_evals, len(self.eval_losses) - 1)]
        self.n_evals += 1
        return float(loss)

    def stop_signal(self) -> int:
        """No stop signal."""
        return 0

    def checkpoint_due(self) -> bool:
        """Never saves."""
        return False

    def final_checkpoint_due(self) -> bool:
        """Never saves."""
        return False

    def save_checkpoint(self, loop_state: dict) -> Path:
        """Not reached: checkpoint_due() and final_checkpoint_due() are False and no stop signal arrives."""
        raise RuntimeError("a ScriptedEngine saves no checkpoints")

    def finish(self, result: dict) -> None:
        """Keep the result for inspection."""
        self.calls.append("finish")
        self.finished = result


def lora_reference_config(*overrides: str) -> Config:
    """The official llama2_70b_lora reference configuration: the llama2-70b-lora preset at the reference's GBS 8."""
    return resolve("llama2-70b-lora", overrides=[*LORA_REFERENCE_SCHEDULE, *overrides])


def scripted_run(
    cfg: Config,
    run_dir: str | Path,
    eval_losses: Sequence[float],
    dp_size: int = 1,
    platform: str | None = None,
    **engine_kwargs,
) -> tuple[dict, ScriptedEngine]:
    """One timed run of cfg.bench.benchmark through the real loop and MLPerf observer (`run_once`) with a
    ScriptedEngine whose evaluations return `eval_losses` in turn; writes run_dir/mllog.txt and result.json.
    Returns (result, engine)."""
    engine = ScriptedEngine(cfg, eval_losses=eval_losses, **engine_kwargs)
    return run_once(cfg, engine, run_dir, dp_size=dp_size, platform=platform), engine


def scripted_submission(
    cfg: Config,
    out_dir: str | Path,
    converge_evals: Sequence[int],
    dp_size: int = 1,
    platform: str | None = None,
    **engine_kwargs,
) -> list[Path]:
    """One scripted run per entry of `converge_evals` in out_dir/run_<i>/ (seeds cfg.train.seed + 1000*i, as `bench`
    derives them), run i reaching the target at its converge_evals[i]-th evaluation: the MLLOGs of a submission
    whose samples to converge are chosen, for the RCP checker (`checker.check_rcp`). Returns the log paths."""
    import copy

    target = cfg.train.target_eval_loss
    logs = []
    for i, k in enumerate(converge_evals):
        if k < 1:
            raise ValueError(f"converge_evals[{i}]={k}: a run converges at its first evaluation at the earliest")
        run_cfg = copy.deepcopy(cfg)
        run_cfg.train.seed = cfg.train.seed + 1000 * i
        losses = [target + 0.01 * (k - j) for j in range(1, k)] + [target - 0.01]
        run_dir = Path(out_dir) / f"run_{i}"
        scripted_run(run_cfg, run_dir, losses, dp_size=dp_size, platform=platform, **engine_kwargs)
        logs.append(run_dir / "mllog.txt")
    return logs
