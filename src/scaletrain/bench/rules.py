"""The init-phase MLLOG keys of every benchmark: what the harness logs before run_start, in the reference's order.

A benchmark's `BenchmarkSpec.init_keys` names its list: "adam" (gpt3, rulesets 3.0.0-4.1.0: closed_gpt3.yaml),
"lora" (llama2_70b_lora: closed_llama2_70b_lora.yaml) or "adamw" (the 5.0.0+ pre-training benchmarks llama31_405b,
llama31_8b, gpt_oss_20b and deepseekv3_671b, whose closed_<name>.yaml + closed_common.yaml + common.yaml require one
shared list plus a few keys of their own: `own_init_keys`, valued by `OWN_KEY_VALUES`). Proxies log their
benchmark's list. The closed-division rules a config breaks are bench/closed.py's; the eval cadence (with skipped
first evaluations) and the step budget are the training loop's schedule (train/schedule.py).

This module shares its name with the data folder bench/rules/ (the checker's YAML files). That works because the folder
has no __init__.py, and a module file wins over a namespace-package folder: never add one there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlperf_logging.mllog import constants as C

from scaletrain import benchmarks
from scaletrain.config import Config

__all__ = [
    "OWN_KEY_VALUES",
    "submission_benchmark",
    "is_lora",
    "counts_samples",
    "mllog_hparams",
    "disclosure_hparams",
    "gradient_accumulation_steps",
]

DECAY_SCHEDULE = "cosine with linear warmup"


def submission_benchmark(name: str) -> str:
    """What a scaletrain benchmark logs as submission_benchmark: the package's constant for its official name. A
    proxy logs it too: it follows that benchmark's event protocol, and its own rules file (bench/rules/*_proxy.yaml)
    accepts exactly that value."""
    spec = benchmarks.get(name)
    return str(getattr(C, spec.mllog_constant)) if spec.mllog_constant else spec.name


def counts_samples(benchmark: str | Config) -> bool:
    """True where MLLOG's block/eval/run_stop metadata is `samples_count` (training samples since run_start), as the
    RCP checker reads it: llama2_70b_lora, llama31_405b, llama31_8b (and their proxies); gpt3 counts tokens."""
    name = benchmark.bench.benchmark if isinstance(benchmark, Config) else benchmark
    return name in benchmarks.names() and benchmarks.get(name).converge_unit == "samples"


def is_lora(benchmark: str | Config) -> bool:
    """True for llama2_70b_lora and its proxy: samples_count metadata and skipped first evaluations."""
    name = benchmark.bench.benchmark if isinstance(benchmark, Config) else benchmark
    return name in benchmarks.names() and benchmarks.get(name).lora


def _clean(x: float) -> float:
    # lr * ratio carries binary noise (2e-5 * 0.1 == 2.0000000000000003e-06); the log should read 2e-06 like the
    # reference's, and 12 significant digits are far below any LR that matters.
    return float(f"{x:.12g}")


def gradient_accumulation_steps(cfg: Config, dp_size: int = 1) -> int:
    """GBS / (micro_batch_size * dp_size); ValueError when that does not divide evenly."""
    per_pass = cfg.train.micro_batch_size * dp_size
    if dp_size <= 0 or cfg.train.global_batch_size % per_pass:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={cfg.train.micro_batch_size} x dp_size={dp_size}"
        )
    return cfg.train.global_batch_size // per_pass


def _max_steps(cfg: Config) -> int:
    # Where the cosine ends (warm-up + decay steps): 8B and gpt_oss check it is 1,200,000, DeepSeek-V3 only logs it.
    return cfg.optim.decay_steps(cfg.train.global_batch_size)


OWN_KEY_VALUES: dict[str, Callable[[Config], Any]] = {
    C.INIT_CHECKPOINT_STEP: lambda cfg: cfg.optim.init_checkpoint_step(cfg.train.global_batch_size),
    C.MAX_STEPS: _max_steps,
    C.MOE_AUX_LOSS_COEFF: lambda cfg: cfg.model.moe.aux_loss_coef,
}
"""MLLOG key a benchmark's `own_init_keys` may name -> its value in a config: each written once, whoever logs it."""


def mllog_hparams(
    cfg: Config, eval_samples: int, platform: str, dp_size: int = 1, train_samples: int | None = None
) -> list[tuple[str, Any]]:
    """Every init-phase key cfg.bench.benchmark's rules require (plus the recommended seed), as (key, value) pairs in
    the order the reference implementation logs them; the list is the benchmark's `init_keys`.

    `eval_samples`: gpt3's validation label-token count (the reference logs 11,590,004 tokens under this key); the
    validation set in sequences for the others (llama2_70b_lora 173; 5760, 1024, 1024, 1024 for llama31_405b,
    llama31_8b, gpt_oss_20b, deepseekv3_671b). `train_samples`: llama2_70b_lora's training set in sequences (3901),
    logged here; the others log the samples trained at run end (the harness). `platform` is submission_platform;
    `dp_size` is the data-parallel degree for gradient_accumulation_steps. cache_clear comes first: the harness
    logs it before init_start, the rest inside the init phase.
    """
    b = cfg.bench
    if b.benchmark not in benchmarks.names():
        raise ValueError(f"bench.benchmark={b.benchmark!r}: must be one of {sorted(benchmarks.names())}")
    if not platform:
        raise ValueError("submission_platform must not be empty (the checker rejects '')")
    spec = benchmarks.get(b.benchmark)
    gbs, o = cfg.train.global_batch_size, cfg.optim
    head: list[tuple[str, Any]] = [
        (C.CACHE_CLEAR, True),
        (C.SUBMISSION_BENCHMARK, submission_benchmark(b.benchmark)),
        (C.SUBMISSION_ORG, b.org),
        (C.SUBMISSION_DIVISION, b.division),
        (C.SUBMISSION_PLATFORM, platform),
        (C.GLOBAL_BATCH_SIZE, gbs),
        (C.MAX_SEQUENCE_LENGTH, cfg.model.seq_len),
    ]
    if spec.init_keys == "lora":
        return head + _lora_hparams(cfg, eval_samples, train_samples, dp_size)
    accumulation = gradient_accumulation_steps(cfg, dp_size)
    if spec.init_keys == "adamw":
        return head + _adamw_hparams(cfg, spec, eval_samples, accumulation)
    if spec.init_keys != "adam":  # BenchmarkSpec refuses other lists; a new one must be written here first
        raise ValueError(f"benchmark {spec.name!r}: no init-phase key list {spec.init_keys!r}")
    return head + [
        (C.OPT_NAME, "adam"),
        (C.OPT_BASE_LR, o.lr),
        (C.OPT_END_LR, _clean(o.lr * o.end_lr_ratio)),
        (C.OPT_LR_DECAY_STEPS, o.decay_steps(gbs)),
        (C.OPT_LR_WARMUP_STEPS, o.warmup_steps(gbs)),
        (C.OPT_LR_DECAY_SCHEDULE, DECAY_SCHEDULE),
        (C.OPT_ADAM_BETA_1, o.beta1),
        (C.OPT_ADAM_BETA_2, o.beta2),
        (C.OPT_ADAM_EPSILON, o.eps),
        (C.OPT_GRADIENT_CLIP_NORM, o.grad_clip),
        (C.OPT_WEIGHT_DECAY, o.weight_decay),
        (C.GRADIENT_ACCUMULATION_STEPS, accumulation),
        (C.EVAL_SAMPLES, int(eval_samples)),
        (C.INIT_CHECKPOINT_STEP, o.init_checkpoint_step(gbs)),
        (C.SEED, cfg.train.seed),
    ]


def _lora_hparams(cfg: Config, eval_samples: int, train_samples: int | None, dp_size: int) -> list[tuple[str, Any]]:
    # closed_llama2_70b_lora.yaml + closed_common.yaml + common.yaml, in the reference's order (mlcommons/training
    # llama2_70b_lora/scripts/mlperf_logging_utils.py); max_sequence_length is not required there but states the
    # fixed 8192 in the log. opt_learning_rate_training_steps is where the cosine ends (reference: max_steps 1024).
    if train_samples is None:
        raise ValueError("llama2_70b_lora logs train_samples (the training set size) in the init phase; pass it")
    gbs, o, lo = cfg.train.global_batch_size, cfg.optim, cfg.lora
    alpha = int(lo.alpha) if float(lo.alpha).is_integer() else lo.alpha  # 32, as the reference logs it
    return [
        (C.TRAIN_SAMPLES, int(train_samples)),
        (C.EVAL_SAMPLES, int(eval_samples)),
        (C.OPT_BASE_LR, o.lr),
        (C.OPT_LR_TRAINING_STEPS, o.decay_steps(gbs)),
        (C.OPT_ADAMW_WEIGHT_DECAY, o.weight_decay),
        (C.OPT_GRADIENT_CLIP_NORM, o.grad_clip),
        (C.GRADIENT_ACCUMULATION_STEPS, gradient_accumulation_steps(cfg, dp_size)),
        (C.LORA_ALPHA, alpha),
        ("lora_rank", lo.rank),  # mllog 4.1 has no constant for it; closed_llama2_70b_lora.yaml checks == 16
        *disclosure_hparams(cfg),
        (C.SEED, cfg.train.seed),
    ]


def _adamw_hparams(
    cfg: Config, spec: benchmarks.BenchmarkSpec, eval_samples: int, accumulation: int
) -> list[tuple[str, Any]]:
    # The AdamW cosine schedule at cfg's GBS, gradient_accumulation_steps, the validation set size in sequences
    # (train_samples is logged at run end), the benchmark's own keys, 6.1.0's disclosure keys and the seed.
    gbs, o = cfg.train.global_batch_size, cfg.optim
    warmup, total = o.warmup_steps(gbs), o.decay_steps(gbs)
    unknown = [key for key in spec.own_init_keys if key not in OWN_KEY_VALUES]
    if unknown:
        raise ValueError(f"benchmark {spec.name!r}: no value known for its init key(s) {unknown} (bench/rules.py)")
    return [
        (C.OPT_NAME, "adamw"),
        (C.OPT_BASE_LR, o.lr),
        (C.OPT_END_LR, _clean(o.lr * o.end_lr_ratio)),  # 8e-06, not 8.000000000000001e-06
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
        *((key, OWN_KEY_VALUES[key](cfg)) for key in spec.own_init_keys),
        *disclosure_hparams(cfg),
        (C.SEED, cfg.train.seed),
    ]


def disclosure_hparams(cfg: Config) -> list[tuple[str, Any]]:
    """The precision, parallelism and run-config keys training_6.1.0/common.yaml requires (older rulesets ignore
    them, so a llama2_70b_lora log carries them at any ruleset and its proxy rules can require them too).

    Lowest precisions: linear layers FP8 under train.fp8, else the compute dtype; attention runs in the compute
    dtype; communication is the compute dtype (FSDP gathers bf16 parameters and TP/CP/PP move bf16 activations,
    gradients are reduced in fp32). expert_parallelism is parallel.ep (1 without MoE); the run's config is its
    config.json.
    """
    dtype = "bfloat16" if cfg.train.dtype == "bf16" else "fp32"
    p = cfg.parallel
    return [
        (C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR, "fp8" if cfg.train.fp8 else dtype),
        (C.LOWEST_NUMERICAL_PRECISION_IN_ATTN, dtype),
        (C.LOWEST_NUMERICAL_PRECISION_IN_COMM, dtype),
        (C.TENSOR_PARALLELISM, p.tp),
        (C.PIPELINE_PARALLELISM, p.pp),
        (C.CONTEXT_PARALLELISM, p.cp),
        (C.EXPERT_PARALLELISM, p.ep),
        (C.MICRO_BATCH_SIZE, cfg.train.micro_batch_size),
        (C.CONFIG_FILENAME, "config.json"),
    ]
