"""Closed-division rules of MLPerf Training llama31_405b and llama31_8b (docs/benchmarks.md sections 2a-2b): the
rules the compliance checker cannot see (the init-phase MLLOG keys their rules files require: bench/rules_pretrain.py).

Every constant here is read off mlperf-logging 4.1.68: compliance_checker/training_<r>/closed_llama31_*.yaml (the
checks), rcp_checker/training_<r>/rcps_llama31_*.json (the batch sizes with reference convergence points) and
benchmark_meta.py (runs); tests/unit/test_bench_llama31.py compares them with the installed package.
"""

from __future__ import annotations

import math

from scaletrain import benchmarks
from scaletrain.config import Config

from .rules_common import fixed_recipe_problems

__all__ = [
    "LLAMA31",
    "LLAMA31_405B",
    "LLAMA31_405B_PROXY",
    "LLAMA31_8B",
    "is_llama31",
    "llama31_violations",
]


class LLAMA31:
    """What the two Llama 3.1 benchmarks share (closed_llama31_{405b,8b}.yaml)."""

    VOCAB = 128256
    OPT_NAME = "adamw"
    DECAY_SCHEDULE = "cosine with linear warmup"
    BETA1, BETA2, EPS = 0.9, 0.95, 1e-5
    WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0


class LLAMA31_405B(LLAMA31):
    """llama31_405b (rulesets 5.0.0-6.0.0): continued pre-training of Llama 3.1 405B from Meta's checkpoint, whose
    schedule nevertheless starts at step 0 (`init_checkpoint_step == 0`)."""

    SPEC = benchmarks.LLAMA31_405B
    N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, FFN = 126, 16384, 128, 8, 53248
    # opt_base_learning_rate * 1152 == GBS * 8e-5; warm-up ceil(8000*1152/GBS) steps; the cosine ends at
    # ceil(1200000*1152/GBS) steps, logged as opt_learning_rate_decay_steps = that - warm-up (5.1.0 on).
    BASE_GBS, BASE_LR = 1152, 8e-5
    WARMUP_STEPS_AT_BASE, TOTAL_STEPS_AT_BASE = 8000, 1_200_000
    EVAL_SAMPLES = 5760
    # rcps_llama31_405b.json, 6.0.0: GBS 1152, 2304, 4608 (5.0.0's pre-submission table: 1008-9216).
    GBS_MIN, GBS_MAX = 1152, 4608

    @classmethod
    def lr(cls, gbs: int) -> float:
        """The base LR the rules require at `gbs`: 8e-5 * GBS / 1152."""
        return gbs * cls.BASE_LR / cls.BASE_GBS

    @classmethod
    def warmup_steps(cls, gbs: int) -> int:
        """ceil(8000 * 1152 / GBS)."""
        return math.ceil(cls.WARMUP_STEPS_AT_BASE * cls.BASE_GBS / gbs)

    @classmethod
    def total_steps(cls, gbs: int) -> int:
        """Where the cosine ends: ceil(1200000 * 1152 / GBS)."""
        return math.ceil(cls.TOTAL_STEPS_AT_BASE * cls.BASE_GBS / gbs)


class LLAMA31_8B(LLAMA31):
    """llama31_8b (rulesets 5.1.0-6.1.0): Llama 3.1 8B from scratch. LR and warm-up are free; the cosine ends at step
    1,200,000 at every GBS (`max_steps == 1200000`, decay steps = 1200000 - warm-up)."""

    SPEC = benchmarks.LLAMA31_8B
    N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, FFN = 32, 4096, 32, 8, 14336
    MAX_STEPS = 1_200_000
    EVAL_SAMPLES = 1024
    GBS_MIN, GBS_MAX = 16, 128  # rcps_llama31_8b.json, 5.1.0-6.1.0: GBS 16, 32, 64, 96, 128


class LLAMA31_405B_PROXY:
    """llama31_405b-proxy's form of the 405B schedule rules (bench/rules/llama31_405b_proxy.yaml): the same formulas
    with the constants scaled to the CPU proxy. LR 2e-3 * GBS / 32, warm-up ceil(64 * 32 / GBS) steps, cosine to
    ceil(20000 * 32 / GBS) steps; at GBS 32 an evaluation every 16 steps, as 405B's every 18,432 samples at 1152."""

    BASE_GBS, BASE_LR = 32, 2e-3
    WARMUP_STEPS_AT_BASE, TOTAL_STEPS_AT_BASE = 64, 20_000


_RULES: dict[str, type[LLAMA31_405B] | type[LLAMA31_8B]] = {"llama31_405b": LLAMA31_405B, "llama31_8b": LLAMA31_8B}


def is_llama31(benchmark: str) -> bool:
    """True for the official llama31_405b and llama31_8b (their proxies follow their own rules files)."""
    return benchmark in _RULES


def llama31_violations(cfg: Config) -> list[str]:
    """Closed-division rules of llama31_405b / llama31_8b that `cfg` breaks; [] when compliant (or another benchmark).

    The checker sees the logged values; these are the same rules stated on the config (plus the model shape, the
    cadence and the RCP batch-size range, which it cannot see), so `bench` says what to change before a run.
    """
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
    shape = (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_size, m.vocab_size)
    want = (R.N_LAYERS, R.D_MODEL, R.N_HEADS, R.N_KV_HEADS, R.FFN, R.VOCAB)
    need(
        shape == want,
        f"model n_layers/d_model/n_heads/n_kv_heads/d_ff/vocab_size={'/'.join(map(str, shape))}: "
        f"{name} requires {'/'.join(map(str, want))}",
    )
    need(
        R.GBS_MIN <= gbs <= R.GBS_MAX,
        f"train.global_batch_size={gbs}: {name} reference convergence points cover {R.GBS_MIN}..{R.GBS_MAX} only",
    )
    warmup, total = o.warmup_steps(gbs), o.decay_steps(gbs)
    if R is LLAMA31_405B:
        # Exactly as closed_llama31_405b.yaml compares: lr * 1152 == GBS * 8e-5 in floating point.
        need(
            o.lr * R.BASE_GBS == gbs * R.BASE_LR,
            f"optim.lr={o.lr:g}: {name} at GBS {gbs} requires {R.lr(gbs)!r} (8e-5 * GBS / 1152)",
        )
        need(
            warmup == R.warmup_steps(gbs),
            f"optim.warmup_samples={o.warmup_samples} gives {warmup} warm-up steps at GBS {gbs}; "
            f"{name} requires {R.warmup_steps(gbs)} (ceil(8000 * 1152 / GBS))",
        )
        need(
            total == R.total_steps(gbs),
            f"optim.decay_samples={o.decay_samples} ends the cosine at step {total} at GBS {gbs}; "
            f"{name} requires {R.total_steps(gbs)} (ceil(1200000 * 1152 / GBS))",
        )
        need(
            o.checkpoint_samples == 0,
            f"optim.checkpoint_samples={o.checkpoint_samples}: {name} starts its schedule at step 0 "
            "(init_checkpoint_step == 0)",
        )
    else:
        need(
            total == LLAMA31_8B.MAX_STEPS,
            f"optim.decay_samples={o.decay_samples} ends the cosine at step {total} at GBS {gbs}; "
            f"{name} requires {LLAMA31_8B.MAX_STEPS} (decay_samples = {LLAMA31_8B.MAX_STEPS} * GBS)",
        )
        need(o.checkpoint_samples == 0, f"optim.checkpoint_samples={o.checkpoint_samples}: {name} starts from scratch")
    fixed = {"beta1": R.BETA1, "beta2": R.BETA2, "eps": R.EPS, "weight_decay": R.WEIGHT_DECAY, "grad_clip": R.GRAD_CLIP}
    out += fixed_recipe_problems(cfg, name, fixed, spec.target, spec.eval_every_sequences)
    need(cfg.lora.rank == 0, f"lora.rank={cfg.lora.rank}: {name} trains every weight")
    return out
