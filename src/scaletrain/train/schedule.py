"""When a run evaluates and when it must stop: the evaluation cadence and the step budget, fixed by the config.

An evaluation every ceil(train.eval_interval_samples / GBS) optimizer steps. llama2_70b_lora (and its proxy) skips
its first floor(0.125*GBS + 2) evaluations: not run, not logged, so the first block is that much longer
(training_rules.adoc v4.1, "Evaluation frequency"; NVIDIA's NeMo config sets its first val_check_interval to
(SKIP_EVALS+1)*384//GBS steps). Evaluation k falls after k intervals and the first one run is k = skip + 1
(GBS 8: 3 skipped, first at 1536 samples). The skip rule itself is `benchmarks.BenchmarkSpec.skipped_evals`.

Everything is computed from the step count alone, so a run resumed from a checkpoint lands on the same cadence.
"""

from __future__ import annotations

import math

from scaletrain import benchmarks
from scaletrain.config import Config

__all__ = ["EvalSchedule", "eval_every_steps", "eval_skip", "next_eval_step", "max_benchmark_steps", "tokens_per_step"]


def tokens_per_step(cfg: Config) -> int:
    """Training tokens one optimizer step consumes: GBS * seq_len (every position of a training sample has a label)."""
    return cfg.train.global_batch_size * cfg.model.seq_len


def eval_every_steps(cfg: Config) -> int:
    """Optimizer steps between evaluations: ceil(eval_interval_samples / GBS) (gpt3: 12 at GBS 2048)."""
    return math.ceil(cfg.train.eval_interval_samples / cfg.train.global_batch_size)


def eval_skip(cfg: Config) -> int:
    """Evaluations not run at the start of a run: floor(0.125*GBS + 2) for llama2_70b_lora (and its proxy), else 0."""
    # A proxy follows its official benchmark's cadence (the registry resolves it); config validation has already
    # refused unknown names.
    return benchmarks.get(cfg.bench.benchmark).skipped_evals(cfg.train.global_batch_size)


def next_eval_step(cfg: Config, steps: int) -> int:
    """The step of the first evaluation after `steps` (0 = run start): a multiple of eval_every_steps past the skip."""
    every = eval_every_steps(cfg)
    return max(steps // every + 1, eval_skip(cfg) + 1) * every


def max_benchmark_steps(cfg: Config) -> int:
    """Step budget of a run, counted from the start checkpoint.

    train.max_steps when set; otherwise the steps left until the cosine decay ends (the schedule's origin is the
    checkpoint's step 0, so the checkpoint's steps are already spent).
    """
    if cfg.train.max_steps:
        return cfg.train.max_steps
    gbs = cfg.train.global_batch_size
    return max(1, cfg.optim.decay_steps(gbs) - cfg.optim.init_checkpoint_step(gbs))


class EvalSchedule:
    """A run's cadence and units: evaluation steps, step budget (`limit`), `target` eval loss, per-step counts."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.limit = max_benchmark_steps(cfg)
        self.target = cfg.train.target_eval_loss
        self.skip = eval_skip(cfg)
        self.tps = tokens_per_step(cfg)
        self.gbs = cfg.train.global_batch_size

    def next_stop(self, steps: int) -> int:
        """Where the block after `steps` ends: the next evaluation step, or the budget, whichever comes first."""
        return min(next_eval_step(self.cfg, steps), self.limit)
