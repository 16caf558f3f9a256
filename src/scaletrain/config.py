"""One typed configuration, resolved once: preset TOML -> --config FILE -> --set overrides -> validate.

Every field carries a docstring (the string literal under it); `describe()` turns those into help text.
The resolved config is written to `config.json` in the run directory and is the only source of truth
for everything a run does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain import architectures, benchmarks
from scaletrain import config_io as _io
from scaletrain.config_bounds import LAYERS_MAX, available_cores, bound_problems, threads_problem
from scaletrain.config_io import ConfigError, list_presets, parse_override, preset_dict
from scaletrain.config_model import MLAConfig, ModelConfig, MoEConfig, model_problems
from scaletrain.log import get_logger

log = get_logger(__name__)

# Re-exported: callers import these from scaletrain.config (config_io holds the TOML machinery).
__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "MoEConfig",
    "MLAConfig",
    "LoraConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "ParallelConfig",
    "CheckpointConfig",
    "BenchConfig",
    "resolve",
    "from_dict",
    "describe",
    "list_presets",
    "preset_dict",
    "parse_override",
    "default_data_dir",
    "parse_step_range",
    "parse_ranks",
]


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r; 0 trains the whole model (no adapters)."""
    alpha: float = 32.0
    """LoRA alpha; the adapter output is scaled by alpha / rank."""
    dropout: float = 0.1
    """Dropout on the adapter input."""
    targets: list = field(default_factory=lambda: ["qkv", "proj"])
    """Projections that get adapters: any of "qkv", "proj" (attention output), "fc1", "fc2"."""


@dataclass
class DataConfig:
    train_prefix: str = ""
    """Path prefix of the training .bin/.idx pair; empty means the default corpus under data_dir."""
    valid_prefix: str = ""
    """Path prefix of the validation .bin/.idx pair; empty means the default corpus under data_dir."""
    tokenizer: str = ""
    """SentencePiece .model or Hugging Face tokenizer.json the datasets were encoded with; empty means the
    default corpus's."""
    default_tokenizer: str = "sentencepiece"
    """The default corpus's tokenizer: "sentencepiece" (DATA_DIR/shakespeare) or "bpe" (byte-level BPE tokenizer.json,
    DATA_DIR/shakespeare-bpe: `scaletrain data fetch --tokenizer bpe`)."""
    data_dir: str = ""
    """Where `scaletrain data fetch` puts the default corpus; empty means $SCALETRAIN_DATA or ~/.cache/scaletrain."""
    format: str = "pretrain"
    """'pretrain' (token stream cut into samples) or 'sft' (packed input/output pairs, loss on outputs; default set: KJV)."""


@dataclass
class OptimConfig:
    lr: float = 2e-5
    """Base (peak) learning rate of the gpt3 rule."""
    end_lr_ratio: float = 0.1
    """End LR as a fraction of the base LR (gpt3: base/10)."""
    warmup_samples: int = 265 * 1536
    """Linear warm-up length in samples; warm-up steps = ceil(warmup_samples / global_batch_size)."""
    decay_samples: int = 108600 * 1536
    """Where the cosine decay ends, in samples from the schedule's origin; steps = ceil(decay_samples / GBS)."""
    checkpoint_samples: int = 0
    """Samples the start checkpoint was trained on; the schedule starts this far in (gpt3: 4000 * 1536)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter (gpt3 rule: LayerNorm and biases too)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""

    def warmup_steps(self, gbs: int) -> int:
        """Warm-up steps at global batch size `gbs` (gpt3: ceil(265*1536/GBS))."""
        return math.ceil(self.warmup_samples / gbs)

    def decay_steps(self, gbs: int) -> int:
        """Step at which the cosine reaches the end LR (gpt3: ceil(108600*1536/GBS))."""
        return math.ceil(self.decay_samples / gbs)

    def init_checkpoint_step(self, gbs: int) -> int:
        """Step count of the start checkpoint in this batch size (gpt3: ceil(4000*1536/GBS))."""
        return math.ceil(self.checkpoint_samples / gbs)


@dataclass
class TrainConfig:
    global_batch_size: int = 32
    """Sequences per optimizer step = micro_batch_size * grad accumulation * data-parallel size."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass."""
    dtype: str = "bf16"
    """Compute precision: "bf16" (autocast, fp32 master weights) or "fp32"."""
    seed: int = 1234
    """Seed for init and the sample shuffle."""
    max_steps: int = 0
    """Stop after this many steps even without reaching the target; 0 = no limit but the decay end."""
    eval_interval_samples: int = 24576
    """Evaluate after every this many training sequences (gpt3: 24576)."""
    target_eval_loss: float = 2.69
    """Stop when the validation log perplexity is at or below this (gpt3: 2.69)."""
    threads: int = 0
    """torch intra-op threads on CPU for the whole node, split evenly among its ranks; 0 keeps torch's default."""
    probe_window_s: float = 0.03
    """On CPU, seconds each start-up measurement of the device (GEMM rates, copy bandwidth; prediction.json's device
    block) averages over, three of them per run on rank 0; longer reads a busy host more steadily
    (benchmarks/cpu_calibration.py uses 0.3)."""
    log_interval: int = 1
    """Write a metrics.jsonl line, and off a terminal print a log line, every this many steps (evaluations: always)."""
    run_dir: str = "runs/latest"
    """Run directory for config.json, metrics.jsonl, mllog.txt, result.json and TensorBoard events."""
    device: str = "auto"
    """"auto" (CUDA if available, else CPU), "cpu" or "cuda"."""
    compile: bool = False
    """Wrap each block in torch.compile."""
    fp8: bool = False
    """FP8 GEMMs for the transformer-block linears via torchao.float8 (the [fp8] extra; Ada/Hopper+, emulated elsewhere); first and last blocks, embedding and head stay bf16"""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling (torchao recipe): "tensorwise" (one dynamic scale per tensor; FP8 TP and FSDP all-gathers) or "rowwise" (one per row); "current" = tensorwise"""
    progress: bool = True
    """Show a rich progress bar on an interactive terminal; off a terminal, or when false, print plain log lines."""
    profile_steps: str = ""
    """torch.profiler trace of these global steps, inclusive: "A-B" or "N"; "" = off. Written to
    <run_dir>/profile/trace_rank<R>_steps<A>-<B>.pt.trace.json (Chrome/Perfetto JSON); steps before a resume's step
    are never profiled."""
    profile_ranks: str = "0"
    """Ranks that profile (and take memory snapshots): "all" or a comma-separated list of global ranks, e.g. "0,3"."""
    profile_with_stack: bool = False
    """Record Python stacks in the profiler trace (torch.profiler with_stack): larger traces, more overhead."""
    memory_snapshot: bool = False
    """CUDA memory history of the profile_steps (or of the first 3 steps when profile_steps is ""), dumped to
    <run_dir>/profile/memory_snapshot_rank<R>.UNTRUSTED.pickle plus a pickle-free .json summary; a warning on CPU."""
    wandb_project: str = ""
    """Weights & Biases project that also receives the TensorBoard scalars ([wandb] extra); "" = off."""
    wandb_run_name: str = ""
    """Weights & Biases run name; "" = the run directory's name."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas: DDP when dp_shard is 1 (and tp, cp are 1), else HSDP's replicate dimension."""
    dp_shard: int = -1
    """FSDP2 shard degree; -1 = whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree: column/row-split attention and MLP, vocabulary-parallel embedding and loss."""
    sequence_parallel: bool = True
    """With tp > 1, split LayerNorm regions along the sequence (reduce-scatter/all-gather instead of all-reduce)."""
    pp: int = 1
    """Pipeline-parallel stages across ranks (torch.distributed.pipelining)."""
    pp_virtual: int = 1
    """Virtual pipeline stages per pipeline rank; > 1 needs pp_schedule "interleaved_1f1b"."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b" or "interleaved_1f1b"; micro-batches are train.micro_batch_size."""
    pp_first_layers: int = -1
    """Transformer blocks of the first virtual pipeline stage (the one with the embedding); the other stages split
    the rest evenly. -1 = the default split. Megatron's `--decoder-first-pipeline-num-layers`; 0 leaves the first
    stage only the embedding."""
    pp_last_layers: int = -1
    """Transformer blocks of the last virtual pipeline stage (the one with the final norm, output layer and loss);
    -1 = the default split. Megatron's `--decoder-last-pipeline-num-layers`; 0 leaves it only the output layer."""
    pp_stage_layers: list[int] = field(default_factory=list)
    """Blocks of every virtual pipeline stage in pipeline order (pp x pp_virtual counts summing to model.n_layers;
    stage k runs on pipeline rank k % pp); only the first and last may be 0. Empty = pp_first_layers /
    pp_last_layers, or the default split (even, or Megatron's embedding-and-loss-as-a-layer rule)."""
    cp: int = 1
    """Context-parallel degree: each rank holds a load-balanced 1/cp of every sequence; attention gathers K/V."""
    ep: int = 1
    """Expert-parallel degree (MoE models): each EP rank holds model.moe.n_experts / ep routed experts and tokens
    reach them by all-to-all. EP borrows ranks of dp_shard x cp (as torchtitan), so ep must divide that product;
    the experts are FSDP-sharded over the dp_shard x cp / ep ranks that hold the same ones."""
    activation_checkpoint: str = "none"
    """Recompute in backward: "none", "full" (whole blocks) or "selective" (keep matmul/attention outputs)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them to backward (ZeRO-2-like)."""


@dataclass
class CheckpointConfig:
    interval_steps: int | str = 0
    """Save after the first evaluation at least this many steps after the last save; 0 = no step trigger. "auto":
    the interval the failure model finds best for the cluster the run starts on (sim/goodput.py, Daly's optimum from
    the checkpoint's save time and the job's mean time between failures, in steps of the predicted step time; the
    time trigger with that many seconds when the run has no prediction), logged at start."""
    final: bool = True
    """Save the last step of a run that converges or uses up its budget, after its time to train stopped, so
    `export RUN_DIR` gives the final model (a diverged run saves none). `scaletrain bench` runs save it only when
    an interval trigger or `dir` is set (N seeds of a benchmark need no N copies of the model)."""
    interval_minutes: float = 0.0
    """Save after the first evaluation at least this many minutes after the last save; 0 = no time trigger."""
    keep: int = 2
    """Complete checkpoints kept (oldest deleted first); 0 keeps all."""
    async_save: bool = False
    """Write in a background thread (DCP async_save); the checkpoint is published at the next save or run end."""
    dir: str = ""
    """Where checkpoints go; empty means <run_dir>/checkpoints. Set, it also asks for the final checkpoint of a run
    that converges or uses up its budget, even with checkpoint.final=false."""
    resume: str = "none"
    """"none", "auto" (newest complete checkpoint in dir, if any) or a checkpoint directory."""
    verify: str = "sha256"
    """Check before loading: "sha256" (every file's hash) or "size" (presence and sizes; for huge checkpoints).
    Only "sha256" catches flipped bytes; with "size" a damaged shard loads, and a divergence after it names the
    checkpoint it resumed from."""
    init_from: str = ""
    """Start weights (untimed init): a scaletrain checkpoint or run directory, or a Hugging Face directory; the
    frozen base of a LoRA run. Empty: the seed's random init."""
    interruptions_per_gpu_hour: float = -1.0
    """Job interruptions per GPU-hour that interval_steps="auto" plans for; -1 = the published fleet rate
    (sim/goodput.py: Llama 3's 419 unexpected interruptions in 54 days on 16,384 H100s)."""
    storage_gbps: float = -1.0
    """Checkpoint write bandwidth per node, GB/s, that interval_steps="auto" plans for; -1 = the catalog node's
    storage_gbps (the host device's default on CPU)."""


@dataclass
class BenchConfig:
    benchmark: str = "gpt3"
    """MLPerf benchmark rules to follow: "gpt3" (official, ruleset 4.1.0) or "gpt3-proxy" (CPU proxy rules file),
    "llama2_70b_lora" (newest ruleset, see `ruleset`) or "llama2_70b_lora-proxy"."""
    runs: int = 3
    """Runs with distinct seeds; scored by the olympic mean."""
    org: str = "scaletrain"
    """submission_org logged in MLLOG."""
    division: str = "closed"
    """submission_division logged in MLLOG."""
    platform: str = ""
    """submission_platform; empty means derived from the machine (e.g. "1xCPU")."""
    check: bool = True
    """Run MLCommons' compliance checker on every log."""
    ruleset: str = ""
    """mlperf-logging training ruleset the logs are written for and checked against ("6.1.0", ...); empty = the
    benchmark's own: gpt3 4.1.0 (its last round), llama2_70b_lora the newest the installed package ships rules and
    RCPs for. Must be one the installed package has for the benchmark."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (llama2_70b_lora); rank 0 = full training."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and tokenizer."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR rule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout (degrees multiply to the world size)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Distributed checkpoints: when, where, how many, resume."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """MLPerf benchmark protocol."""
    preset: str = ""
    """Name of the preset this config started from (informational)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (what config.json holds)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """config.json text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, run_dir: str | Path) -> Path:
        """Write config.json into run_dir and return its path."""
        path = Path(run_dir) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(self.to_json() + "\n")
            tmp.replace(path)  # a full disk mid-write leaves the previous config.json (a resumed run's) whole
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def validate(self) -> Config:
        """Raise ConfigError naming the first wrong field; return self when all is well."""
        for problem in _problems(self):
            raise ConfigError(problem)
        return self


FP8_RECIPES = ("tensorwise", "rowwise", "current")
"""train.fp8_recipe values: torchao's recipes, and "current" (the former name of tensorwise)."""


def _fp8_problems(c: Config):
    # FP8 GEMMs (torch._scaled_mm) need both dimensions of each operand a multiple of 16, per rank: the weight's
    # (its tensor-parallel shard) and, for the weight-gradient GEMM, the token count, whose inner dimension it is.
    m, p, t = c.model, c.parallel, c.train
    if m.n_heads <= 0 or m.d_model % m.n_heads or p.tp <= 0 or p.cp <= 0:
        return  # reported by the checks on those fields
    head_dim = m.d_model // m.n_heads
    dims = {
        "model.d_model": (m.d_model, 1),
        "model.d_model / parallel.tp": (m.d_model, p.tp),
        "the qkv width (model.n_heads + 2 * key/value heads) * head dim / parallel.tp": (
            (m.n_heads + 2 * m.kv_heads) * head_dim,
            p.tp,
        ),
        "the MLP width (model.d_ff) / parallel.tp": (m.ffn_size, p.tp),
        "the tokens per micro-batch and context rank (train.micro_batch_size * model.seq_len / parallel.cp)": (
            t.micro_batch_size * m.seq_len,
            p.cp,
        ),
    }
    for what, (num, den) in dims.items():
        if num % den == 0 and (num // den) % 16:
            yield (
                f"train.fp8: {what} = {num // den} is not a multiple of 16, which FP8 GEMMs (torch._scaled_mm, "
                "torchao.float8) need; change the shape or train in bf16"
            )
            return


def _problems(c: Config):
    yield from _io.nonfinite(c)  # no float field documents inf as meaningful
    m, t, o, b = c.model, c.train, c.optim, c.bench
    lo = c.lora
    if lo.rank < 0 or lo.alpha <= 0 or not (0 <= lo.dropout < 1):
        yield "lora.rank must be >= 0, lora.alpha > 0 and lora.dropout in [0, 1)"
    for target in lo.targets:
        if target not in LORA_TARGETS:
            yield f"lora.targets: {target!r} is not one of {list(LORA_TARGETS)}"
    yield from model_problems(m)
    if t.global_batch_size <= 0 or t.micro_batch_size <= 0:
        yield "train.global_batch_size and train.micro_batch_size must be > 0"
    elif t.global_batch_size % t.micro_batch_size:
        yield (
            f"train.global_batch_size={t.global_batch_size}: must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if t.dtype not in ("bf16", "fp32"):
        yield f"train.dtype={t.dtype!r}: must be 'bf16' or 'fp32'"
    if t.fp8_recipe == "delayed":
        yield (
            "train.fp8_recipe='delayed': removed with the move to torchao.float8, which has dynamic scaling only; "
            "use 'tensorwise' (what 'current' was) or 'rowwise'"
        )
    elif t.fp8_recipe not in FP8_RECIPES:
        yield f"train.fp8_recipe={t.fp8_recipe!r}: must be one of {list(FP8_RECIPES)}"
    if t.fp8 and t.dtype != "bf16":
        yield f"train.fp8 needs train.dtype='bf16' (got {t.dtype!r}): the FP8 GEMMs produce bf16"
    if t.fp8 and importlib.util.find_spec("torchao") is None:
        yield "train.fp8 needs torchao, a dependency of scaletrain missing here: pip install torchao==0.18.0"
    if t.fp8:
        yield from _fp8_problems(c)
    if t.device not in ("auto", "cpu", "cuda"):
        yield f"train.device={t.device!r}: must be 'auto', 'cpu' or 'cuda'"
    if c.data.format not in ("pretrain", "sft"):
        yield f"data.format={c.data.format!r}: must be 'pretrain' or 'sft'"
    if c.data.default_tokenizer not in ("sentencepiece", "bpe"):
        yield f"data.default_tokenizer={c.data.default_tokenizer!r}: must be 'sentencepiece' or 'bpe'"
    if t.eval_interval_samples <= 0:
        yield f"train.eval_interval_samples={t.eval_interval_samples}: must be > 0"
    for name in ("max_steps", "threads"):
        if getattr(t, name) < 0:
            yield f"train.{name}={getattr(t, name)}: must be >= 0"
    if t.log_interval <= 0:
        yield f"train.log_interval={t.log_interval}: must be > 0"
    if not (0 < t.probe_window_s <= 10):  # NaN fails too
        yield f"train.probe_window_s={t.probe_window_s}: must be in (0, 10] seconds"
    yield from _on_demand_problems(t)
    if o.lr <= 0:
        yield f"optim.lr={o.lr}: must be > 0"
    if not (0 <= o.end_lr_ratio <= 1):
        yield f"optim.end_lr_ratio={o.end_lr_ratio}: must be in [0, 1]"
    if o.warmup_samples < 0 or o.checkpoint_samples < 0:
        yield "optim.warmup_samples and optim.checkpoint_samples must be >= 0"
    if o.decay_samples <= o.warmup_samples:
        yield f"optim.decay_samples={o.decay_samples}: must exceed optim.warmup_samples={o.warmup_samples}"
    for name in ("beta1", "beta2"):
        if not (0 <= getattr(o, name) < 1):
            yield f"optim.{name}={getattr(o, name)}: must be in [0, 1)"
    if o.eps <= 0 or o.weight_decay < 0 or o.grad_clip < 0:
        yield "optim.eps must be > 0, optim.weight_decay and optim.grad_clip >= 0"
    if b.benchmark not in benchmarks.names():
        yield f"bench.benchmark={b.benchmark!r}: must be one of {sorted(benchmarks.names())}"
    if b.runs <= 0:
        yield f"bench.runs={b.runs}: must be > 0"
    if b.ruleset and b.benchmark in benchmarks.names():
        try:
            benchmarks.resolve_ruleset(b.benchmark, b.ruleset)
        except ValueError as exc:
            yield str(exc)
    p = c.parallel
    for name in ("dp_replicate", "tp", "pp", "pp_virtual", "cp", "ep"):
        if getattr(p, name) < 1:
            yield f"parallel.{name}={getattr(p, name)}: must be >= 1"
    if p.dp_shard == 0 or p.dp_shard < -1:
        yield f"parallel.dp_shard={p.dp_shard}: must be >= 1, or -1 for the rest of the world size"
    if p.ep > 1 and m.moe.n_experts == 0:
        yield f"parallel.ep={p.ep}: expert parallelism needs an MoE model (model.moe.n_experts is 0: dense)"
    elif p.ep > 1 and m.moe.n_experts % p.ep:
        yield f"parallel.ep={p.ep}: must divide model.moe.n_experts={m.moe.n_experts}"
    for i, n in enumerate(p.pp_stage_layers):
        if not 0 <= n <= LAYERS_MAX:
            yield f"parallel.pp_stage_layers[{i}]={n}: must be in [0, {LAYERS_MAX}] blocks"
            break
    if p.pp_schedule not in PP_SCHEDULES:
        yield f"parallel.pp_schedule={p.pp_schedule!r}: must be one of {list(PP_SCHEDULES)}"
    k = c.checkpoint
    steps = 0 if k.interval_steps == "auto" else k.interval_steps
    if isinstance(steps, str):
        yield f"checkpoint.interval_steps={steps!r}: must be a whole number of steps >= 0 or 'auto'"
    elif steps < 0 or k.interval_minutes < 0 or k.keep < 0:
        yield "checkpoint.interval_steps, checkpoint.interval_minutes and checkpoint.keep must be >= 0"
    for name in ("interruptions_per_gpu_hour", "storage_gbps"):
        value = getattr(k, name)
        if value != -1 and not value > 0:
            yield f"checkpoint.{name}={value}: must be above 0, or -1 for the default"
    if k.verify not in ("sha256", "size"):
        yield f"checkpoint.verify={k.verify!r}: must be 'sha256' or 'size'"
    if p.activation_checkpoint not in ("none", "full", "selective"):
        yield f"parallel.activation_checkpoint={p.activation_checkpoint!r}: must be 'none', 'full' or 'selective'"
    # Last: the finer checks above name a wrong value more precisely where both apply.
    yield from bound_problems(c)


def parse_step_range(text: str) -> tuple[int, int] | None:
    """train.profile_steps -> (first, last) step, inclusive; None for ""; ValueError for anything else."""
    text = text.strip()
    if not text:
        return None
    first, sep, last = text.partition("-")
    if not (first.strip().isdecimal() and (not sep or last.strip().isdecimal())):
        raise ValueError(f"train.profile_steps={text!r}: must be 'A-B' or 'N' with steps >= 1, or '' (off)")
    lo, hi = int(first), int(last) if sep else int(first)
    if lo < 1 or hi < lo:
        raise ValueError(f"train.profile_steps={text!r}: needs 1 <= A <= B (steps count from 1)")
    return lo, hi


def parse_ranks(text: str) -> frozenset[int] | None:
    """train.profile_ranks -> the set of global ranks; None means "all"; ValueError for anything else."""
    if text.strip() == "all":
        return None
    # `--set train.profile_ranks=0,3` reaches here as "(0, 3)" (a Python literal) and a TOML list as "[0, 3]".
    parts = [p.strip() for p in text.strip().strip("()[]").split(",")]
    if not all(p.isdecimal() for p in parts):
        raise ValueError(f"train.profile_ranks={text!r}: must be 'all' or comma-separated ranks >= 0, e.g. '0,3'")
    return frozenset(int(p) for p in parts)


def _on_demand_problems(t: TrainConfig):
    for parse, value in ((parse_step_range, t.profile_steps), (parse_ranks, t.profile_ranks)):
        try:
            parse(value)
        except ValueError as exc:
            yield str(exc)


WANDB_MISSING = "train.wandb_project needs wandb, the [wandb] extra: pip install 'scaletrain[wandb]'"


def _check_wandb(cfg: Config) -> Config:
    # Only for a run being configured (resolve), not when a finished run's config.json is read back (from_dict).
    # sys.modules first: a test may stand a fake wandb module in (find_spec fails on a module without __spec__).
    if cfg.train.wandb_project and sys.modules.get("wandb") is None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)
    return cfg


LORA_TARGETS = tuple(architectures.LORA_TARGETS)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def resolve(
    preset: str = "gpt3-proxy",
    config_file: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    host: bool = True,
    dataset_vocab: Callable[[Config], tuple[int, str] | None] | None = None,
) -> Config:
    """Build the one Config of a run: preset, then a file (TOML, or a run's config.json), then --set overrides,
    then validate.

    `host`: the config is for a run on this machine, so train.threads is checked against its cores too; the
    simulator, which prices a config for other machines, passes False.
    `dataset_vocab`: (vocabulary, where it was read) of the datasets cfg.data names, or None when they do not say
    (the CLI passes scaletrain.data's reader: this layer reads no data). When the file and the overrides leave
    model.vocab_size alone, a preset's value that differs gives way to the datasets', with one status line; a value
    the user set stays, and a dataset that disagrees with it is refused when the run opens it.
    """
    cfg = Config(preset=preset)
    if preset:
        _io.merge(cfg, preset_dict(preset), f"preset {preset}")
    preset_threads = cfg.train.threads
    user_tables = []
    if config_file:
        path = Path(config_file)
        text = _io.read_text_file(path, f"--config {config_file}")
        user_tables.append(_io.load_config_file(text, str(path)))
        _io.merge(cfg, user_tables[-1], str(path))
    for text in overrides:
        key, value = parse_override(text)
        user_tables.append(_io.nest(key, value))
        _io.merge(cfg, user_tables[-1], f"--set {text}")
    if dataset_vocab is not None and not any(_sets_vocab(t) for t in user_tables):
        _adopt_dataset_vocab(cfg, dataset_vocab)
    if host:  # first: a huge thread count is better refused with the cores it should not exceed
        _check_threads(cfg, preset_threads)
    return _check_wandb(cfg.validate())


def _sets_vocab(table: dict[str, Any]) -> bool:
    model = table.get("model")
    return isinstance(model, dict) and "vocab_size" in model


def _adopt_dataset_vocab(cfg: Config, dataset_vocab: Callable[[Config], tuple[int, str] | None]) -> None:
    found = dataset_vocab(cfg)
    if found is None or found[0] == cfg.model.vocab_size:
        return
    vocab, where = found
    log.info(
        f"model.vocab_size={vocab} from {where} (the {'preset ' + cfg.preset if cfg.preset else 'default'}'s "
        f"{cfg.model.vocab_size} does not fit this data; --set model.vocab_size=N to choose)"
    )
    cfg.model.vocab_size = vocab


def _check_threads(cfg: Config, preset_threads: int) -> None:
    # Thousands of threads make torch start that many OpenMP workers: fork fails machine-wide, then the run dies.
    problem = threads_problem(cfg.train.threads)
    if problem is None:
        return
    if cfg.train.threads == preset_threads:
        # The CPU presets' 2 threads were not the user's choice: on a 1-core host they become 1, not an error.
        cfg.train.threads = available_cores()
        return
    raise ConfigError(problem)


def from_dict(table: dict[str, Any]) -> Config:
    """Rebuild a Config from config.json's dict (what `save` wrote)."""
    cfg = Config()
    _io.merge(cfg, table, "config.json")
    return cfg.validate()


def describe(cls: type = Config, prefix: str = "", values: Any = None) -> list[tuple[str, str, str]]:
    """(dotted name, value, docstring) for every field of `cls` (default: Config), read from the field docstrings.

    The value is the dataclass default, or the field's value in `values` (a resolved Config) when given.
    """
    return _io.describe(cls, prefix, values)


def default_data_dir(cfg: DataConfig) -> Path:
    """Resolved directory of the default corpus."""
    if cfg.data_dir:
        return Path(cfg.data_dir).expanduser()
    env = os.environ.get("SCALETRAIN_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "scaletrain"
