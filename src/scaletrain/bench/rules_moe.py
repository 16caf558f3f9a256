"""Closed-division rules of MLPerf Training gpt_oss_20b and deepseekv3_671b, the two Mixture-of-Experts benchmarks
(rulesets 6.0.0-6.1.0): the rules the compliance checker cannot see (model shape, RCP batch sizes, evaluation
cadence), stated on the config so `bench` says what to change before a run. Their init-phase MLLOG keys are
bench/rules_pretrain.py's; the evaluation skip 6.1.0 requires of deepseekv3_671b is the registry's
(`benchmarks.DEEPSEEKV3_671B.skipped_evals`).

Every constant here is read off mlperf-logging 4.1.68: compliance_checker/training_<r>/closed_{gpt_oss_20b,
deepseekv3_671b}.yaml, rcp_checker/training_<r>/rcps_*.json and benchmark_meta.py; tests/unit/test_bench_moe.py
compares them with the installed package.
"""

from __future__ import annotations

import math

from scaletrain import benchmarks
from scaletrain.config import Config

from .rules_common import fixed_recipe_problems

__all__ = ["GPT_OSS_20B", "DEEPSEEKV3_671B", "DEEPSEEKV3_671B_PROXY", "is_moe_benchmark", "moe_violations"]


class _MoERules:
    """What both MoE rules files fix the same way: AdamW betas, weight decay, clip, 1,024 evaluation sequences."""

    SPEC: benchmarks.BenchmarkSpec
    BETA1, BETA2, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 0.1, 1.0
    EPS: float
    EVAL_SAMPLES = 1024
    # Model shape: (n_layers, d_model, n_heads, vocab_size, n_experts, top_k, d_ff_expert, n_shared).
    SHAPE: tuple[int, ...]
    GBS_MIN: int
    GBS_MAX: int


class GPT_OSS_20B(_MoERules):
    """gpt_oss_20b: GPT-OSS 20B from scratch at sequence 8192. LR and warm-up are free; the cosine ends at step
    1,200,000 at every GBS (`max_steps == 1200000`, decay steps = 1200000 - warm-up)."""

    SPEC = benchmarks.GPT_OSS_20B
    EPS = 1e-5
    MAX_STEPS = 1_200_000
    SHAPE = (24, 2880, 64, 201088, 32, 4, 2880, 0)
    GBS_MIN, GBS_MAX = 16, 64  # rcps_gpt_oss_20b.json, 6.0.0-6.1.0: GBS 16, 32, 64


class DEEPSEEKV3_671B(_MoERules):
    """deepseekv3_671b: continued pre-training of DeepSeek-V3 671B at sequence 4096, GBS >= 15,360, LR
    2.4e-5 * sqrt(GBS / 16384), 4 warm-up steps, the cosine ending at step 12,000 (decay 12000 - 4), MoE auxiliary
    loss coefficient 0.01; 6.1.0: the first evaluation after floor(42 + 24576 / GBS) steps."""

    SPEC = benchmarks.DEEPSEEKV3_671B
    EPS = 1e-8
    BASE_GBS, BASE_LR = 16384, 2.4e-5
    WARMUP_STEPS, TOTAL_STEPS = 4, 12_000
    AUX_LOSS_COEFF = 0.01
    SHAPE = (61, 7168, 128, 129280, 256, 8, 2048, 1)
    FIRST_DENSE = 3
    GBS_MIN = 15360  # closed_deepseekv3_671b.yaml: global_batch_size >= 15360
    GBS_MAX = 18432  # rcps_deepseekv3_671b.json, 6.0.0-6.1.0: GBS 15360, 16384, 18432

    @classmethod
    def lr(cls, gbs: int) -> float:
        """The base LR the rules require at `gbs`: 2.4e-5 * sqrt(GBS / 16384)."""
        return cls.BASE_LR * (gbs / cls.BASE_GBS) ** 0.5

    @classmethod
    def first_eval_step(cls, gbs: int) -> int:
        """6.1.0's FIRST_CHECK: the first evaluation's samples_count is GBS * floor(42 + 24576 / GBS)."""
        return math.floor(42 + 24576 / gbs)


class DEEPSEEKV3_671B_PROXY:
    """deepseekv3_671b-proxy's form of the LR rule (bench/rules/deepseekv3_671b_proxy.yaml): LR 3e-3 * sqrt(GBS / 32).
    The warm-up (4 steps), the cosine's end (step 12,000) and the auxiliary loss coefficient are the official ones."""

    BASE_GBS, BASE_LR = 32, 3e-3

    @classmethod
    def lr(cls, gbs: int) -> float:
        """3e-3 * sqrt(GBS / 32)."""
        return cls.BASE_LR * (gbs / cls.BASE_GBS) ** 0.5


_RULES: dict[str, type[GPT_OSS_20B] | type[DEEPSEEKV3_671B]] = {
    "gpt_oss_20b": GPT_OSS_20B,
    "deepseekv3_671b": DEEPSEEKV3_671B,
}


def is_moe_benchmark(benchmark: str) -> bool:
    """True for the official gpt_oss_20b and deepseekv3_671b (their proxies follow their own rules files)."""
    return benchmark in _RULES


def moe_violations(cfg: Config) -> list[str]:
    """Closed-division rules of gpt_oss_20b / deepseekv3_671b that `cfg` breaks; [] when compliant (or another
    benchmark). The logged values are the checker's to judge too; these also cover what it cannot see."""
    name = cfg.bench.benchmark
    R = _RULES.get(name)
    if R is None:
        return []
    m, o, t = cfg.model, cfg.optim, cfg.train
    gbs = t.global_batch_size
    out: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    spec = R.SPEC
    need(m.arch == spec.arch, f"model.arch={m.arch!r}: {name} requires {spec.arch!r}")
    need(m.seq_len == spec.seq_len, f"model.seq_len={m.seq_len}: {name} requires {spec.seq_len}")
    mo = m.moe
    shape = (m.n_layers, m.d_model, m.n_heads, m.vocab_size, mo.n_experts, mo.top_k, mo.d_ff_expert, mo.n_shared)
    need(
        shape == R.SHAPE,
        "model n_layers/d_model/n_heads/vocab_size/moe.n_experts/moe.top_k/moe.d_ff_expert/moe.n_shared="
        f"{'/'.join(map(str, shape))}: {name} requires {'/'.join(map(str, R.SHAPE))}",
    )
    need(
        R.GBS_MIN <= gbs <= R.GBS_MAX,
        f"train.global_batch_size={gbs}: {name} reference convergence points cover {R.GBS_MIN}..{R.GBS_MAX} only",
    )
    warmup, total = o.warmup_steps(gbs), o.decay_steps(gbs)
    if R is DEEPSEEKV3_671B:
        need(mo.first_dense == R.FIRST_DENSE, f"model.moe.first_dense={mo.first_dense}: {name} requires 3")
        # As closed_deepseekv3_671b.yaml compares: within 1e-9 of the formula.
        need(
            abs(o.lr - R.lr(gbs)) < 1e-9,
            f"optim.lr={o.lr:g}: {name} at GBS {gbs} requires {R.lr(gbs)!r} (2.4e-5 * sqrt(GBS / 16384))",
        )
        need(
            warmup == R.WARMUP_STEPS,
            f"optim.warmup_samples={o.warmup_samples} gives {warmup} warm-up steps at GBS {gbs}; {name} requires "
            f"{R.WARMUP_STEPS} (warmup_samples = {R.WARMUP_STEPS} * GBS)",
        )
        need(
            total == R.TOTAL_STEPS,
            f"optim.decay_samples={o.decay_samples} ends the cosine at step {total} at GBS {gbs}; {name} requires "
            f"{R.TOTAL_STEPS} (decay_samples = {R.TOTAL_STEPS} * GBS)",
        )
        need(
            mo.aux_loss_coef == R.AUX_LOSS_COEFF,
            f"model.moe.aux_loss_coef={mo.aux_loss_coef:g}: {name} requires {R.AUX_LOSS_COEFF:g}",
        )
        # 671B continues from the benchmark checkpoint, but its schedule starts at step 0 (warm-up 4 from there).
        need(o.checkpoint_samples == 0, f"optim.checkpoint_samples={o.checkpoint_samples}: {name} starts at step 0")
    else:
        need(
            total == GPT_OSS_20B.MAX_STEPS,
            f"optim.decay_samples={o.decay_samples} ends the cosine at step {total} at GBS {gbs}; "
            f"{name} requires {GPT_OSS_20B.MAX_STEPS} (decay_samples = {GPT_OSS_20B.MAX_STEPS} * GBS)",
        )
        need(o.checkpoint_samples == 0, f"optim.checkpoint_samples={o.checkpoint_samples}: {name} starts from scratch")
    fixed = {"beta1": R.BETA1, "beta2": R.BETA2, "eps": R.EPS, "weight_decay": R.WEIGHT_DECAY, "grad_clip": R.GRAD_CLIP}
    out += fixed_recipe_problems(cfg, name, fixed, spec.target, spec.eval_every_sequences)
    need(cfg.lora.rank == 0, f"lora.rank={cfg.lora.rank}: {name} trains every weight")
    return out
