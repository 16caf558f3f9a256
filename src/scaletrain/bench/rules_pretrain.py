"""The init-phase MLLOG keys of MLPerf's AdamW pre-training benchmarks (rulesets 5.0.0-6.1.0): llama31_405b,
llama31_8b, gpt_oss_20b, deepseekv3_671b and their proxies.

Their rules files (closed_<name>.yaml + closed_common.yaml + common.yaml) require one shared key list -- the AdamW
cosine schedule, batch, sequence, evaluation size, 6.1.0's disclosure keys, the seed -- plus a few keys of their own;
`OWN_KEYS` is that table, so a new benchmark of this family is one entry here (and its closed-division checks in
its rules module: bench/rules_llama31.py, bench/rules_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scaletrain import benchmarks
from scaletrain.config import Config

from .mllog import C
from .rules_common import submission_benchmark

__all__ = ["OWN_KEYS", "follows_pretrain", "pretrain_hparams"]

OPT_NAME = "adamw"
DECAY_SCHEDULE = "cosine with linear warmup"


def _init_checkpoint_step(cfg: Config) -> int:
    return cfg.optim.init_checkpoint_step(cfg.train.global_batch_size)


def _max_steps(cfg: Config) -> int:
    # Where the cosine ends (warm-up + decay steps): 8B and gpt_oss check it is 1,200,000, DeepSeek-V3 only logs it.
    return cfg.optim.decay_steps(cfg.train.global_batch_size)


def _aux_loss_coeff(cfg: Config) -> float:
    return cfg.model.moe.aux_loss_coef


OWN_KEYS: dict[str, tuple[tuple[str, Callable[[Config], Any]], ...]] = {
    # closed_llama31_405b.yaml: init_checkpoint_step == 0 (continued pre-training whose schedule starts at step 0).
    "llama31_405b": ((C.INIT_CHECKPOINT_STEP, _init_checkpoint_step),),
    # closed_llama31_8b.yaml, closed_gpt_oss_20b.yaml: max_steps == 1200000.
    "llama31_8b": ((C.MAX_STEPS, _max_steps),),
    "gpt_oss_20b": ((C.MAX_STEPS, _max_steps),),
    # closed_deepseekv3_671b.yaml: max_steps (any), moe_aux_loss_coeff == 0.01.
    "deepseekv3_671b": ((C.MAX_STEPS, _max_steps), (C.MOE_AUX_LOSS_COEFF, _aux_loss_coeff)),
}
"""Official benchmark name -> the init keys its rules add to the shared list, each with the config's value."""


def follows_pretrain(benchmark: str) -> bool:
    """True for the benchmarks in OWN_KEYS and their proxies: the runs that log this family's init keys."""
    return benchmark in benchmarks.names() and benchmarks.get(benchmark).name in OWN_KEYS


def pretrain_hparams(
    cfg: Config, eval_samples: int, platform: str, accumulation: int, disclosure: list[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    """The init-phase keys of cfg.bench.benchmark's rules files, cache_clear first: the hyperparameters at cfg's GBS,
    gradient_accumulation_steps (`accumulation`), the validation set size in sequences (eval_samples; train_samples
    is logged at run end), the benchmark's own keys (OWN_KEYS), 6.1.0's disclosure keys (`disclosure`:
    rules.disclosure_hparams) and the seed. Called by rules.mllog_hparams."""
    name = cfg.bench.benchmark
    gbs, o = cfg.train.global_batch_size, cfg.optim
    warmup, total = o.warmup_steps(gbs), o.decay_steps(gbs)
    out: list[tuple[str, Any]] = [
        (C.CACHE_CLEAR, True),
        (C.SUBMISSION_BENCHMARK, submission_benchmark(name)),
        (C.SUBMISSION_ORG, cfg.bench.org),
        (C.SUBMISSION_DIVISION, cfg.bench.division),
        (C.SUBMISSION_PLATFORM, platform),
        (C.GLOBAL_BATCH_SIZE, gbs),
        (C.MAX_SEQUENCE_LENGTH, cfg.model.seq_len),
        (C.OPT_NAME, OPT_NAME),
        (C.OPT_BASE_LR, o.lr),
        (C.OPT_END_LR, float(f"{o.lr * o.end_lr_ratio:.12g}")),  # 8e-06, not 8.000000000000001e-06
        (C.OPT_LR_WARMUP_STEPS, warmup),
        # The rules count decay after warm-up: the cosine spans total - warm-up steps.
        (C.OPT_LR_DECAY_STEPS, total - warmup),
        (C.OPT_LR_DECAY_SCHEDULE, DECAY_SCHEDULE),
        (C.OPT_ADAMW_BETA_1, o.beta1),
        (C.OPT_ADAMW_BETA_2, o.beta2),
        (C.OPT_ADAMW_EPSILON, o.eps),
        (C.OPT_ADAMW_WEIGHT_DECAY, o.weight_decay),
        (C.OPT_GRADIENT_CLIP_NORM, o.grad_clip),
        (C.GRADIENT_ACCUMULATION_STEPS, accumulation),
        (C.EVAL_SAMPLES, int(eval_samples)),
    ]
    out += [(key, value(cfg)) for key, value in OWN_KEYS[benchmarks.get(name).name]]
    return [*out, *disclosure, (C.SEED, cfg.train.seed)]
