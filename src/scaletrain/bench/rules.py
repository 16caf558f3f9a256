"""The MLPerf gpt3 rules as code: what the init phase logs, which closed-division rules a config breaks, eval cadence.

Sources: MLCommons training_policies and the `mlperf-logging` 4.1.x rules files (training_4.1.0/closed_gpt3.yaml);
summarised in ../shared/docs/benchmarks.md section 1. The compliance checker verifies only what reaches the log and
never the warmup/decay/checkpoint values, the LR/GBS pairing or the model shape; `official_rule_violations` does.

This module shares its name with the data folder bench/rules/ (the checker's YAML files). That works because the folder
has no __init__.py, and a module file wins over a namespace-package folder: never add one there.
"""

from __future__ import annotations

import math
from typing import Any

from mlperf_logging.mllog import constants as C

from scaletrain.config import Config

__all__ = [
    "GPT3", "BENCHMARK_NAMES", "mllog_hparams", "official_rule_violations", "eval_every_steps",
    "tokens_per_step", "gradient_accumulation_steps", "max_benchmark_steps",
]

# What each scaletrain benchmark logs as submission_benchmark. The proxy logs "gpt3" too: it follows the gpt3 event
# protocol, and its own rules file (bench/rules/gpt3_proxy.yaml) accepts exactly that value.
BENCHMARK_NAMES = {"gpt3": C.GPT3, "gpt3-proxy": C.GPT3}


class GPT3:
    """Closed-division constants of MLPerf Training gpt3 (rulesets 3.0.0-4.1.0)."""

    N_LAYERS, D_MODEL, N_HEADS, FFN = 96, 12288, 96, 4 * 12288
    SEQ_LEN = 2048
    VOCAB = 50257
    CKPT_SAMPLES = 4000 * 1536
    WARMUP_SAMPLES = 265 * 1536
    DECAY_SAMPLES = 108600 * 1536
    END_LR_RATIO = 0.1
    BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
    WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0
    TARGET = 2.69
    EVAL_INTERVAL_SAMPLES = 24576
    OPT_NAME = "adam"
    DECAY_SCHEDULE = "cosine with linear warmup"
    # RCPs exist for GBS 1536..8192; LR 2e-5 up to 3072, 3e-5 from 4096; either in between.
    GBS_MIN, GBS_MAX = 1536, 8192
    LR_LOW, LR_LOW_MAX_GBS = 2e-5, 3072
    LR_HIGH, LR_HIGH_MIN_GBS = 3e-5, 4096


def _clean(x: float) -> float:
    # lr * ratio carries binary noise (2e-5 * 0.1 == 2.0000000000000003e-06); the log should read 2e-06 like the
    # reference's, and 12 significant digits are far below any LR that matters.
    return float(f"{x:.12g}")


def gradient_accumulation_steps(cfg: Config, dp_size: int = 1) -> int:
    """GBS / (micro_batch_size * dp_size); ValueError when that does not divide evenly."""
    per_pass = cfg.train.micro_batch_size * dp_size
    if dp_size <= 0 or cfg.train.global_batch_size % per_pass:
        raise ValueError(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
                         f"train.micro_batch_size={cfg.train.micro_batch_size} x dp_size={dp_size}")
    return cfg.train.global_batch_size // per_pass


def tokens_per_step(cfg: Config) -> int:
    """Training tokens one optimizer step consumes: GBS * seq_len (every position of a training sample has a label)."""
    return cfg.train.global_batch_size * cfg.model.seq_len


def eval_every_steps(cfg: Config) -> int:
    """Optimizer steps between evaluations: ceil(eval_interval_samples / GBS) (gpt3: 12 at GBS 2048)."""
    return math.ceil(cfg.train.eval_interval_samples / cfg.train.global_batch_size)


def max_benchmark_steps(cfg: Config) -> int:
    """Step budget of a timed run, counted from the start checkpoint.

    train.max_steps when set; otherwise the steps left until the cosine decay ends (the schedule's origin is the
    checkpoint's step 0, so the checkpoint's steps are already spent).
    """
    if cfg.train.max_steps:
        return cfg.train.max_steps
    gbs = cfg.train.global_batch_size
    return max(1, cfg.optim.decay_steps(gbs) - cfg.optim.init_checkpoint_step(gbs))


def mllog_hparams(cfg: Config, eval_samples: int, platform: str, dp_size: int = 1) -> list[tuple[str, Any]]:
    """Every init-phase key the gpt3 ruleset 4.1.0 requires (plus the recommended seed and weight decay),
    as (key, value) pairs in the order the reference implementation logs them.

    `eval_samples` is the validation label-token count (the gpt3 reference logs 11,590,004 tokens under this key);
    `platform` is submission_platform; `dp_size` is the data-parallel degree for gradient_accumulation_steps.
    cache_clear comes first: the harness logs it before init_start, the rest inside the init phase.
    """
    gbs = cfg.train.global_batch_size
    o, b = cfg.optim, cfg.bench
    if b.benchmark not in BENCHMARK_NAMES:
        raise ValueError(f"bench.benchmark={b.benchmark!r}: must be one of {sorted(BENCHMARK_NAMES)}")
    if not platform:
        raise ValueError("submission_platform must not be empty (the checker rejects '')")
    return [
        (C.CACHE_CLEAR, True),
        (C.SUBMISSION_BENCHMARK, BENCHMARK_NAMES[b.benchmark]),
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


def _neq(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def official_rule_violations(cfg: Config) -> list[str]:
    """Closed-division gpt3 rules `cfg` breaks that the compliance checker cannot see; [] when compliant.

    Only cfg.bench.benchmark == "gpt3" has such rules: the proxy scales model, data and target by design.
    """
    if cfg.bench.benchmark != "gpt3":
        return []
    m, o, t = cfg.model, cfg.optim, cfg.train
    gbs = t.global_batch_size
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    need(m.seq_len == GPT3.SEQ_LEN, f"model.seq_len={m.seq_len}: gpt3 requires {GPT3.SEQ_LEN}")
    need((m.n_layers, m.d_model, m.n_heads) == (GPT3.N_LAYERS, GPT3.D_MODEL, GPT3.N_HEADS),
         f"model n_layers/d_model/n_heads={m.n_layers}/{m.d_model}/{m.n_heads}: gpt3 requires "
         f"{GPT3.N_LAYERS}/{GPT3.D_MODEL}/{GPT3.N_HEADS}")
    need(m.ffn_size == GPT3.FFN, f"model.d_ff={m.ffn_size}: gpt3 requires {GPT3.FFN} (4 x d_model)")
    need(m.vocab_size == GPT3.VOCAB, f"model.vocab_size={m.vocab_size}: gpt3 requires {GPT3.VOCAB}")

    if not GPT3.GBS_MIN <= gbs <= GPT3.GBS_MAX:
        out.append(f"train.global_batch_size={gbs}: gpt3 reference convergence points cover "
                   f"{GPT3.GBS_MIN}..{GPT3.GBS_MAX} only")
    if gbs <= GPT3.LR_LOW_MAX_GBS:
        allowed = [GPT3.LR_LOW]
    elif gbs >= GPT3.LR_HIGH_MIN_GBS:
        allowed = [GPT3.LR_HIGH]
    else:  # between the two reference batch sizes the rules accept either LR
        allowed = [GPT3.LR_LOW, GPT3.LR_HIGH]
    if all(_neq(o.lr, lr) for lr in allowed):
        out.append(f"optim.lr={o.lr:g}: gpt3 at GBS {gbs} requires {' or '.join(f'{x:g}' for x in allowed)}")
    need(not _neq(o.end_lr_ratio, GPT3.END_LR_RATIO),
         f"optim.end_lr_ratio={o.end_lr_ratio:g}: gpt3 requires end LR = base/10")

    # Compare steps, not samples: the logged steps are what the rule fixes, and rounding may make other sample
    # counts give the same steps at this GBS.
    for name, have, want in (
            ("warmup", o.warmup_steps(gbs), math.ceil(GPT3.WARMUP_SAMPLES / gbs)),
            ("decay", o.decay_steps(gbs), math.ceil(GPT3.DECAY_SAMPLES / gbs)),
            ("checkpoint", o.init_checkpoint_step(gbs), math.ceil(GPT3.CKPT_SAMPLES / gbs))):
        field = {"warmup": "warmup_samples", "decay": "decay_samples", "checkpoint": "checkpoint_samples"}[name]
        need(have == want, f"optim.{field}={getattr(o, field)} gives {name} step {have} at GBS {gbs}; "
                           f"gpt3 requires {want}")

    for field, want in (("beta1", GPT3.BETA1), ("beta2", GPT3.BETA2), ("eps", GPT3.EPS),
                        ("weight_decay", GPT3.WEIGHT_DECAY), ("grad_clip", GPT3.GRAD_CLIP)):
        need(not _neq(getattr(o, field), want), f"optim.{field}={getattr(o, field):g}: gpt3 requires {want:g}")
    need(not _neq(t.target_eval_loss, GPT3.TARGET),
         f"train.target_eval_loss={t.target_eval_loss:g}: gpt3 requires {GPT3.TARGET}")
    need(t.eval_interval_samples == GPT3.EVAL_INTERVAL_SAMPLES,
         f"train.eval_interval_samples={t.eval_interval_samples}: gpt3 requires {GPT3.EVAL_INTERVAL_SAMPLES}")
    return out
