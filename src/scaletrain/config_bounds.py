"""The range of every numeric configuration field, and of the numeric command-line flags that feed the same values.

One table, `BOUNDS`, keyed by the dotted field name, so `Config.validate` checks every int and float field the same
way and a test can insist that no numeric field is without an entry. The ranges are the envelope of meaningful (or
ignored) values; `scaletrain.config` and `config_model` keep the finer checks that depend on other fields (a
multiple of, at most another field, ...), and run first, so their messages win where both apply.

Why bounds at all: an unbounded int reaches numpy/torch as an int64 (or a C int) and overflows there as a
traceback, or makes a process allocate or loop without end (threads, batch sizes, layer counts) before anything
fails. Upper limits are far beyond any published model or cluster. Layer 0: stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

INT64_MAX = 2**63 - 1
"""Counts that numpy/torch hold as int64 (steps, tokens) must fit in it."""
SAMPLES_MAX = 2**53
"""Sample counts are divided in floating point (ceil(samples / GBS)): exact only up to 2**53."""
SEED_MAX = 2**32 - 1
"""numpy's seed range is [0, 2**32); the data shuffle seeds numpy with train.seed."""
DEGREE_MAX = 2**20
"""Parallel degrees and world sizes: about ten times the largest cluster ever trained on."""
BATCH_MAX = 2**24
"""Sequences per step (global or micro batch): 16.7M, about a thousand times MLPerf's largest GBS."""
WIDTH_MAX = 2**20
"""Hidden sizes; feed-forward widths may be WIDTH_MAX * 4."""
HEADS_MAX = 2**16
"""Attention heads, key/value heads, head dimensions, experts, latent ranks."""
LAYERS_MAX = 4096
"""Transformer blocks: thirty times the deepest published model (126)."""
SEQ_MAX = 2**24
"""Sequence length and vocabulary size: 16.7M."""
RUNS_MAX = 1000
"""Benchmark runs per `bench` (MLPerf asks for 10)."""
TOP_MAX = 100
"""Layouts `plan --top` prints: each one is event-simulated and turned into run lines."""


@dataclass(frozen=True)
class Bound:
    """An inclusive range [lo, hi]; lo_open / hi_open exclude the end. `why` explains an end that is not obvious."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def holds(self, value: float) -> bool:
        """Whether `value` is inside (NaN never is)."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def text(self) -> str:
        """'[0, 4294967295]', '(0, 1000]', '>= 0 and finite', ..."""
        if math.isinf(self.hi):
            return f"{'>' if self.lo_open else '>='} {self.lo:g} and finite"
        lo = f"{self.lo:g}" if isinstance(self.lo, float) else str(self.lo)
        hi = f"{self.hi:g}" if isinstance(self.hi, float) else str(self.hi)
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def _i(lo: int, hi: int, why: str = "") -> Bound:
    return Bound(lo, hi, why=why)


def _f(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False, why: str = "") -> Bound:
    return Bound(float(lo), float(hi), lo_open, hi_open, why)


_OFF = "0 = off"
BOUNDS: dict[str, Bound] = {
    # model
    "model.n_layers": _i(1, LAYERS_MAX),
    "model.d_model": _i(1, WIDTH_MAX),
    "model.n_heads": _i(1, HEADS_MAX),
    "model.n_kv_heads": _i(0, HEADS_MAX),
    "model.d_ff": _i(0, 4 * WIDTH_MAX),
    "model.seq_len": _i(1, SEQ_MAX),
    "model.vocab_size": _i(1, SEQ_MAX),
    "model.vocab_multiple": _i(1, HEADS_MAX),
    "model.ln_eps": _f(0, 1, lo_open=True, hi_open=True),
    "model.init_std": _f(0, 100, lo_open=True),
    "model.rope_theta": _f(0, 1e12, why="0 = the architecture's"),
    "model.rope_factor": _f(0, 1e6),
    "model.rope_low_freq_factor": _f(0, 1e6),
    "model.rope_high_freq_factor": _f(0, 1e6),
    "model.rope_original_seq_len": _i(0, SEQ_MAX),
    "model.head_dim": _i(0, HEADS_MAX),
    "model.swiglu_limit": _f(0, 1e6),
    "model.swiglu_alpha": _f(0, 1e6, lo_open=True),
    "model.sliding_window": _i(0, SEQ_MAX),
    "model.sliding_window_pattern": _i(0, LAYERS_MAX),
    "model.rope_beta_fast": _f(0, 1e6),
    "model.rope_beta_slow": _f(0, 1e6),
    # model.moe: a dense model ignores these, so the envelope admits 0; config_model checks an MoE model's finer
    "model.moe.n_experts": _i(0, HEADS_MAX),
    "model.moe.top_k": _i(0, HEADS_MAX),
    "model.moe.d_ff_expert": _i(0, 4 * WIDTH_MAX),
    "model.moe.n_shared": _i(0, 1024),
    "model.moe.route_scale": _f(0, 1e3),
    "model.moe.n_groups": _i(0, HEADS_MAX),
    "model.moe.topk_groups": _i(0, HEADS_MAX),
    "model.moe.aux_loss_coef": _f(0, 1e3),
    "model.moe.bias_update_rate": _f(0, 10),
    "model.moe.capacity_factor": _f(0, 1e6),
    "model.moe.first_dense": _i(0, LAYERS_MAX),
    "model.mla.kv_lora_rank": _i(0, HEADS_MAX),
    "model.mla.q_lora_rank": _i(0, HEADS_MAX),
    "model.mla.qk_nope_head_dim": _i(0, HEADS_MAX),
    "model.mla.qk_rope_head_dim": _i(0, HEADS_MAX),
    "model.mla.v_head_dim": _i(0, HEADS_MAX),
    # lora
    "lora.rank": _i(0, HEADS_MAX),
    "lora.alpha": _f(0, 1e6, lo_open=True),
    "lora.dropout": _f(0, 1, hi_open=True),
    # optim
    "optim.lr": _f(0, 1e3, lo_open=True, why="a larger step diverges at once"),
    "optim.end_lr_ratio": _f(0, 1),
    "optim.warmup_samples": _i(0, SAMPLES_MAX, "counts of samples are divided in floating point"),
    "optim.decay_samples": _i(1, SAMPLES_MAX, "counts of samples are divided in floating point"),
    "optim.checkpoint_samples": _i(0, SAMPLES_MAX, "counts of samples are divided in floating point"),
    "optim.beta1": _f(0, 1, hi_open=True),
    "optim.beta2": _f(0, 1, hi_open=True),
    "optim.eps": _f(0, 1, lo_open=True),
    "optim.weight_decay": _f(0, 100),
    "optim.grad_clip": _f(0, why=_OFF),
    # train
    "train.global_batch_size": _i(1, BATCH_MAX),
    "train.micro_batch_size": _i(1, BATCH_MAX),
    "train.seed": _i(0, SEED_MAX, "numpy's seed range"),
    "train.max_steps": _i(0, INT64_MAX, "step counts are int64"),
    "train.eval_interval_samples": _i(1, SAMPLES_MAX),
    "train.target_eval_loss": _f(0, why="a loss is never negative"),
    "train.threads": _i(0, HEADS_MAX, "0 = torch's default"),
    "train.probe_window_s": _f(0, 10, lo_open=True),
    "train.log_interval": _i(1, INT64_MAX),
    # parallel
    "parallel.dp_replicate": _i(1, DEGREE_MAX),
    "parallel.dp_shard": _i(-1, DEGREE_MAX, "-1 = the rest of the world size"),
    "parallel.tp": _i(1, DEGREE_MAX),
    "parallel.pp": _i(1, DEGREE_MAX),
    "parallel.pp_virtual": _i(1, DEGREE_MAX),
    "parallel.pp_first_layers": _i(-1, LAYERS_MAX, "-1 = the default split"),
    "parallel.pp_last_layers": _i(-1, LAYERS_MAX, "-1 = the default split"),
    "parallel.cp": _i(1, DEGREE_MAX),
    "parallel.ep": _i(1, DEGREE_MAX),
    # checkpoint
    "checkpoint.interval_steps": _i(0, INT64_MAX, _OFF),
    "checkpoint.interval_minutes": _f(0, why=_OFF),
    "checkpoint.keep": _i(0, DEGREE_MAX, "0 keeps all"),
    "checkpoint.interruptions_per_gpu_hour": _f(-1, 1, why="-1 = the published fleet rate"),
    "checkpoint.storage_gbps": _f(-1, 1e6, why="-1 = the catalog node's"),
    # bench
    "bench.runs": _i(1, RUNS_MAX),
}


def numeric_fields(root: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every int and float field of a config dataclass instance, nested sections too."""
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if dataclasses.is_dataclass(value):
            yield from numeric_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value


def bound_problems(cfg: Any) -> Iterator[str]:
    """One line per numeric field of `cfg` outside its range in BOUNDS, then the cross-field size limits."""
    for name, value in numeric_fields(cfg):
        bound = BOUNDS.get(name)
        if bound is not None and not bound.holds(value):
            why = f" ({bound.why})" if bound.why else ""
            yield f"{name}={value}: must be {bound.text()}{why}"
    yield from _size_problems(cfg)


def _size_problems(cfg: Any) -> Iterator[str]:
    t, m, o = cfg.train, cfg.model, cfg.optim
    if not all(BOUNDS[n].holds(v) for n, v in numeric_fields(cfg) if n in BOUNDS):
        return  # a field out of range was reported; the products below would only repeat it
    # Every token count of a run (consumed tokens, MLLOG's samples, metrics) is an int64 somewhere downstream.
    samples = t.max_steps * t.global_batch_size if t.max_steps else o.decay_samples
    if samples * m.seq_len > INT64_MAX:
        source = (
            f"train.max_steps={t.max_steps} x train.global_batch_size={t.global_batch_size}"
            if t.max_steps
            else f"optim.decay_samples={o.decay_samples}"
        )
        yield f"{source} x model.seq_len={m.seq_len}: the run's token count overflows int64 (max {INT64_MAX})"


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_problem(threads: int, cores: int | None = None) -> str | None:
    """Why train.threads cannot run on this host (more threads than cores), or None."""
    cores = available_cores() if cores is None else cores
    if threads > cores:
        return (
            f"train.threads={threads}: more than the {cores} CPU core{'s' if cores != 1 else ''} this process may "
            f"use (os.sched_getaffinity); use at most {cores}, or 0 for torch's default"
        )
    return None


# ---------------------------------------------------------------- argparse types for numeric flags
def int_flag(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse `type` accepting integers in [lo, hi]; anything else is argparse's one-line usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its "invalid <type> value" fallback
    return parse


def float_flag(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse `type` accepting finite numbers in [lo, hi] (NaN and infinities refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"must be a finite number in [{lo:g}, {hi:g}], got {text}")
        return value

    parse.__name__ = "number"
    return parse
