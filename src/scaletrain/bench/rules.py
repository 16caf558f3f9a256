"""The MLPerf gpt3 and llama2_70b_lora rules as code: what the init phase logs and which closed-division rules a
config breaks. The eval cadence (with llama2_70b_lora's skipped first evaluations) and the step budget are the
training loop's schedule (train/schedule.py).

Sources: MLCommons training_policies (training_rules.adoc as of v4.1) and the `mlperf-logging` 4.1.x rules files
(training_4.1.0/closed_gpt3.yaml, closed_llama2_70b_lora.yaml); summarised in docs/benchmarks.md sections
1-2. The compliance checker verifies only what reaches the log and never the warmup/decay/checkpoint values, the
LR/GBS pairing, the model shape or the eval cadence; `official_rule_violations` checks what the config decides.

This module shares its name with the data folder bench/rules/ (the checker's YAML files). That works because the folder
has no __init__.py, and a module file wins over a namespace-package folder: never add one there.
"""

from __future__ import annotations

import math
from typing import Any

from mlperf_logging.mllog import constants as C

from scaletrain import benchmarks
from scaletrain.config import Config

from .rules_common import differs, fixed_recipe_problems, submission_benchmark
from .rules_llama31 import is_llama31, llama31_violations
from .rules_moe import is_moe_benchmark, moe_violations
from .rules_pretrain import follows_pretrain, pretrain_hparams

__all__ = [
    "GPT3",
    "LLAMA2_LORA",
    "submission_benchmark",
    "is_lora",
    "counts_samples",
    "mllog_hparams",
    "disclosure_hparams",
    "official_rule_violations",
    "gradient_accumulation_steps",
]


class GPT3:
    """Closed-division constants of MLPerf Training gpt3 (rulesets 3.0.0-4.1.0)."""

    N_LAYERS, D_MODEL, N_HEADS, FFN = 96, 12288, 96, 4 * 12288
    SEQ_LEN = benchmarks.GPT3.seq_len
    VOCAB = 50257
    CKPT_SAMPLES = 4000 * 1536
    WARMUP_SAMPLES = 265 * 1536
    DECAY_SAMPLES = 108600 * 1536
    END_LR_RATIO = 0.1
    BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
    WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0
    TARGET = benchmarks.GPT3.target
    EVAL_INTERVAL_SAMPLES = benchmarks.GPT3.eval_every_sequences
    OPT_NAME = "adam"
    DECAY_SCHEDULE = "cosine with linear warmup"
    # RCPs exist for GBS 1536..8192; LR 2e-5 up to 3072, 3e-5 from 4096; either in between.
    GBS_MIN, GBS_MAX = 1536, 8192
    LR_LOW, LR_LOW_MAX_GBS = 2e-5, 3072
    LR_HIGH, LR_HIGH_MIN_GBS = 3e-5, 4096


class LLAMA2_LORA:
    """Closed-division constants of MLPerf Training llama2_70b_lora (rulesets 4.0.0-4.1.0).

    Fixed by training_rules.adoc: clip 0.3, LoRA dropout 0.1, alpha 32, weight decay 1e-4, sequence length (the
    table says 8196, a typo: the reference and the packed dataset use 8192); closed_llama2_70b_lora.yaml checks
    rank 16.
    Not in the table, hence fixed to the reference (HF AdamW defaults and its cosine to 0, NVIDIA's NeMo config
    alike): betas 0.9/0.999, eps 1e-8, end LR 0. GBS, base LR, warmup and training steps are unconstrained.
    """

    N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, FFN = 80, 8192, 64, 8, 28672
    VOCAB = 32000
    SEQ_LEN = benchmarks.LLAMA2_70B_LORA.seq_len
    RANK, ALPHA, DROPOUT = 16, 32.0, 0.1
    TARGETS = frozenset({"qkv", "proj"})
    WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.3
    BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
    END_LR_RATIO = 0.0
    TARGET = benchmarks.LLAMA2_70B_LORA.target
    EVAL_INTERVAL_SAMPLES = benchmarks.LLAMA2_70B_LORA.eval_every_sequences
    # RCPs (rcp_checker/training_4.1.0/rcps_llama2_70b_lora.json) exist for GBS 8, 16, 32 and 128.
    GBS_MIN, GBS_MAX = 8, 128


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


def mllog_hparams(
    cfg: Config, eval_samples: int, platform: str, dp_size: int = 1, train_samples: int | None = None
) -> list[tuple[str, Any]]:
    """Every init-phase key the ruleset 4.1.0 requires for cfg.bench.benchmark (plus the recommended seed),
    as (key, value) pairs in the order the reference implementation logs them.

    gpt3: `eval_samples` is the validation label-token count (the reference logs 11,590,004 tokens under this key);
    train_samples is logged at run end by the harness. llama2_70b_lora: `eval_samples` and `train_samples` are the
    validation and training dataset sizes in sequences (reference: 173 and 3901), both logged here. llama31_405b,
    llama31_8b, gpt_oss_20b, deepseekv3_671b (bench/rules_pretrain.py): `eval_samples` is the validation set in
    sequences (5760, 1024, 1024, 1024).
    `platform` is submission_platform; `dp_size` is the data-parallel degree for gradient_accumulation_steps.
    cache_clear comes first: the harness logs it before init_start, the rest inside the init phase.
    """
    b = cfg.bench
    if b.benchmark not in benchmarks.names():
        raise ValueError(f"bench.benchmark={b.benchmark!r}: must be one of {sorted(benchmarks.names())}")
    if not platform:
        raise ValueError("submission_platform must not be empty (the checker rejects '')")
    if is_lora(cfg):
        return _lora_hparams(cfg, eval_samples, train_samples, platform, dp_size)
    if follows_pretrain(b.benchmark):
        accumulation = gradient_accumulation_steps(cfg, dp_size)
        return pretrain_hparams(cfg, eval_samples, platform, accumulation, disclosure_hparams(cfg))
    gbs = cfg.train.global_batch_size
    o = cfg.optim
    return [
        (C.CACHE_CLEAR, True),
        (C.SUBMISSION_BENCHMARK, submission_benchmark(b.benchmark)),
        (C.SUBMISSION_ORG, b.org),
        (C.SUBMISSION_DIVISION, b.division),
        (C.SUBMISSION_PLATFORM, platform),
        (C.GLOBAL_BATCH_SIZE, gbs),
        (C.MAX_SEQUENCE_LENGTH, cfg.model.seq_len),
        (C.OPT_NAME, GPT3.OPT_NAME),
        (C.OPT_BASE_LR, o.lr),
        (C.OPT_END_LR, _clean(o.lr * o.end_lr_ratio)),
        (C.OPT_LR_DECAY_STEPS, o.decay_steps(gbs)),
        (C.OPT_LR_WARMUP_STEPS, o.warmup_steps(gbs)),
        (C.OPT_LR_DECAY_SCHEDULE, GPT3.DECAY_SCHEDULE),
        (C.OPT_ADAM_BETA_1, o.beta1),
        (C.OPT_ADAM_BETA_2, o.beta2),
        (C.OPT_ADAM_EPSILON, o.eps),
        (C.OPT_GRADIENT_CLIP_NORM, o.grad_clip),
        (C.OPT_WEIGHT_DECAY, o.weight_decay),
        (C.GRADIENT_ACCUMULATION_STEPS, gradient_accumulation_steps(cfg, dp_size)),
        (C.EVAL_SAMPLES, int(eval_samples)),
        (C.INIT_CHECKPOINT_STEP, o.init_checkpoint_step(gbs)),
        (C.SEED, cfg.train.seed),
    ]


def _lora_hparams(
    cfg: Config, eval_samples: int, train_samples: int | None, platform: str, dp_size: int
) -> list[tuple[str, Any]]:
    # closed_llama2_70b_lora.yaml + closed_common.yaml + common.yaml, in the reference's order (mlcommons/training
    # llama2_70b_lora/scripts/mlperf_logging_utils.py); max_sequence_length is not required there but states the
    # fixed 8192 in the log. opt_learning_rate_training_steps is where the cosine ends (reference: max_steps 1024).
    if train_samples is None:
        raise ValueError("llama2_70b_lora logs train_samples (the training set size) in the init phase; pass it")
    gbs, o, lo = cfg.train.global_batch_size, cfg.optim, cfg.lora
    alpha = int(lo.alpha) if float(lo.alpha).is_integer() else lo.alpha  # 32, as the reference logs it
    return [
        (C.CACHE_CLEAR, True),
        (C.SUBMISSION_BENCHMARK, submission_benchmark(cfg.bench.benchmark)),
        (C.SUBMISSION_ORG, cfg.bench.org),
        (C.SUBMISSION_DIVISION, cfg.bench.division),
        (C.SUBMISSION_PLATFORM, platform),
        (C.GLOBAL_BATCH_SIZE, gbs),
        (C.MAX_SEQUENCE_LENGTH, cfg.model.seq_len),
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


def official_rule_violations(cfg: Config) -> list[str]:
    """Closed-division rules `cfg` breaks that the compliance checker cannot see; [] when compliant.

    Only the official benchmarks (gpt3, llama2_70b_lora, llama31_405b, llama31_8b: bench/rules_llama31.py,
    gpt_oss_20b, deepseekv3_671b: bench/rules_moe.py) have such rules: proxies scale model, data and target by design.
    """
    if cfg.bench.benchmark == "llama2_70b_lora":
        return _lora_violations(cfg)
    if is_llama31(cfg.bench.benchmark):
        return llama31_violations(cfg)
    if is_moe_benchmark(cfg.bench.benchmark):
        return moe_violations(cfg)
    if cfg.bench.benchmark != "gpt3":
        return []
    m, o, t = cfg.model, cfg.optim, cfg.train
    gbs = t.global_batch_size
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    need(m.seq_len == GPT3.SEQ_LEN, f"model.seq_len={m.seq_len}: gpt3 requires {GPT3.SEQ_LEN}")
    need(
        (m.n_layers, m.d_model, m.n_heads) == (GPT3.N_LAYERS, GPT3.D_MODEL, GPT3.N_HEADS),
        f"model n_layers/d_model/n_heads={m.n_layers}/{m.d_model}/{m.n_heads}: gpt3 requires "
        f"{GPT3.N_LAYERS}/{GPT3.D_MODEL}/{GPT3.N_HEADS}",
    )
    need(m.ffn_size == GPT3.FFN, f"model.d_ff={m.ffn_size}: gpt3 requires {GPT3.FFN} (4 x d_model)")
    need(m.vocab_size == GPT3.VOCAB, f"model.vocab_size={m.vocab_size}: gpt3 requires {GPT3.VOCAB}")

    if not GPT3.GBS_MIN <= gbs <= GPT3.GBS_MAX:
        out.append(
            f"train.global_batch_size={gbs}: gpt3 reference convergence points cover "
            f"{GPT3.GBS_MIN}..{GPT3.GBS_MAX} only"
        )
    if gbs <= GPT3.LR_LOW_MAX_GBS:
        allowed = [GPT3.LR_LOW]
    elif gbs >= GPT3.LR_HIGH_MIN_GBS:
        allowed = [GPT3.LR_HIGH]
    else:  # between the two reference batch sizes the rules accept either LR
        allowed = [GPT3.LR_LOW, GPT3.LR_HIGH]
    if all(differs(o.lr, lr) for lr in allowed):
        out.append(f"optim.lr={o.lr:g}: gpt3 at GBS {gbs} requires {' or '.join(f'{x:g}' for x in allowed)}")
    need(
        not differs(o.end_lr_ratio, GPT3.END_LR_RATIO),
        f"optim.end_lr_ratio={o.end_lr_ratio:g}: gpt3 requires end LR = base/10",
    )

    # Compare steps, not samples: the logged steps are what the rule fixes, and rounding may make other sample
    # counts give the same steps at this GBS.
    for name, have, want in (
        ("warmup", o.warmup_steps(gbs), math.ceil(GPT3.WARMUP_SAMPLES / gbs)),
        ("decay", o.decay_steps(gbs), math.ceil(GPT3.DECAY_SAMPLES / gbs)),
        ("checkpoint", o.init_checkpoint_step(gbs), math.ceil(GPT3.CKPT_SAMPLES / gbs)),
    ):
        field = {"warmup": "warmup_samples", "decay": "decay_samples", "checkpoint": "checkpoint_samples"}[name]
        need(
            have == want,
            f"optim.{field}={getattr(o, field)} gives {name} step {have} at GBS {gbs}; gpt3 requires {want}",
        )

    fixed = {
        "beta1": GPT3.BETA1,
        "beta2": GPT3.BETA2,
        "eps": GPT3.EPS,
        "weight_decay": GPT3.WEIGHT_DECAY,
        "grad_clip": GPT3.GRAD_CLIP,
    }
    out += fixed_recipe_problems(cfg, "gpt3", fixed, GPT3.TARGET, GPT3.EVAL_INTERVAL_SAMPLES)
    return out


def _lora_violations(cfg: Config) -> list[str]:
    m, o, t, lo, L = cfg.model, cfg.optim, cfg.train, cfg.lora, LLAMA2_LORA
    gbs = t.global_batch_size
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    arch = benchmarks.LLAMA2_70B_LORA.arch
    need(m.arch == arch, f"model.arch={m.arch!r}: llama2_70b_lora requires {arch!r}")
    need(m.seq_len == L.SEQ_LEN, f"model.seq_len={m.seq_len}: llama2_70b_lora requires {L.SEQ_LEN}")
    shape = (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_size, m.vocab_size)
    want = (L.N_LAYERS, L.D_MODEL, L.N_HEADS, L.N_KV_HEADS, L.FFN, L.VOCAB)
    need(
        shape == want,
        f"model n_layers/d_model/n_heads/n_kv_heads/d_ff/vocab_size={'/'.join(map(str, shape))}: "
        f"llama2_70b_lora requires {'/'.join(map(str, want))}",
    )
    need(lo.rank == L.RANK, f"lora.rank={lo.rank}: llama2_70b_lora requires {L.RANK}")
    need(
        set(lo.targets) == L.TARGETS,
        f"lora.targets={list(lo.targets)}: llama2_70b_lora requires {sorted(L.TARGETS)} (attention QKV and output)",
    )
    for field, have, want_v in (
        ("lora.alpha", lo.alpha, L.ALPHA),
        ("lora.dropout", lo.dropout, L.DROPOUT),
        ("optim.weight_decay", o.weight_decay, L.WEIGHT_DECAY),
        ("optim.grad_clip", o.grad_clip, L.GRAD_CLIP),
        ("optim.beta1", o.beta1, L.BETA1),
        ("optim.beta2", o.beta2, L.BETA2),
        ("optim.eps", o.eps, L.EPS),
        ("optim.end_lr_ratio", o.end_lr_ratio, L.END_LR_RATIO),
        ("train.target_eval_loss", t.target_eval_loss, L.TARGET),
    ):
        need(not differs(have, want_v), f"{field}={have:g}: llama2_70b_lora requires {want_v:g}")
    need(
        o.checkpoint_samples == 0,
        f"optim.checkpoint_samples={o.checkpoint_samples}: LoRA fine-tuning starts its schedule at step 0",
    )
    need(
        t.eval_interval_samples == L.EVAL_INTERVAL_SAMPLES,
        f"train.eval_interval_samples={t.eval_interval_samples}: llama2_70b_lora requires {L.EVAL_INTERVAL_SAMPLES}",
    )
    need(
        L.GBS_MIN <= gbs <= L.GBS_MAX,
        f"train.global_batch_size={gbs}: llama2_70b_lora reference convergence "
        f"points cover {L.GBS_MIN}..{L.GBS_MAX} only",
    )
    return out
