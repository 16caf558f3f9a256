"""The MLPerf benchmarks scaletrain knows, one `BenchmarkSpec` each: the only table keyed by benchmark name.

Config validation, the harness's init-phase MLLOG keys and scoring, the closed-division checker (bench/closed.py),
the compliance checker, the CLI's preset choice and the simulator's convergence arithmetic all look a benchmark up
here, so adding one is one entry in `BENCHMARKS` (plus its preset TOMLs, its proxy rules YAML in bench/rules/, and
its bundled results CSV in sim/data/). Its closed-division rules are data here (`Fixed`, `Shape`, `GbsRange`, `Steps`
and the LR rules), which bench/closed.py checks a config against.

Every benchmark has a CPU proxy named "<name>-proxy": it follows the official benchmark's event protocol and
counting, with its own preset and rules file. Layer 0: stdlib only, imports nothing from scaletrain, so the
torch-free simulator and `config` can both read it. Numbers the installed `mlperf-logging` package holds (RCP
tables, the submission_benchmark constant) are read from the package where they are used; the entries here name
where to find them.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = [
    "BenchmarkSpec",
    "Fixed",
    "Shape",
    "GbsRange",
    "Steps",
    "LrSteps",
    "LrLinear",
    "LrSqrt",
    "ClosedRule",
    "SPEC_VALUES",
    "INIT_KEY_LISTS",
    "BENCHMARKS",
    "PROXY_SUFFIX",
    "DEFAULT_RULESET",
    "get",
    "is_proxy",
    "names",
    "preset_for",
    "for_preset",
    "for_model",
    "choices_text",
    "package_rulesets",
    "resolve_ruleset",
]

PROXY_SUFFIX = "-proxy"
DEFAULT_RULESET = "4.1.0"
"""gpt3's mlperf-logging ruleset (and the simulator's RCP table version): gpt3 rules exist only in rulesets
3.0.0-4.1.0 (it was retired after 4.1), and the package's default (newer) ruleset crashes on gpt3 logs."""


# ---------------------------------------------------------------- closed-division rules, as data


@dataclass(frozen=True)
class Fixed:
    """A config value the closed division fixes."""

    field: str
    """Dotted Config attribute, e.g. "optim.beta1", "model.moe.first_dense"."""
    value: float | int | str | frozenset[str] | None = None
    """The value required; None = the spec's own (model.arch, model.seq_len, train.target_eval_loss,
    train.eval_interval_samples: `SPEC_VALUES`). A float is compared within float noise, a frozenset as a set."""
    label: str = ""
    """What the message calls the field when not `field` ("model.d_ff" for model.ffn_size)."""
    note: str = ""
    """Said after the required value, e.g. "(4 x d_model)"."""
    why: str = ""
    """Said instead of "<benchmark> requires <value>"; "{name}" stands for the benchmark."""
    exact: bool = False
    """Compare a float with == (as the rules file does) rather than within float noise."""

    def required(self, spec: BenchmarkSpec) -> float | int | str | frozenset[str]:
        """The value `spec`'s closed division requires."""
        return getattr(spec, SPEC_VALUES[self.field]) if self.value is None else self.value


SPEC_VALUES = {
    "model.arch": "arch",
    "model.seq_len": "seq_len",
    "train.target_eval_loss": "target",
    "train.eval_interval_samples": "eval_every_sequences",
}
"""Config field -> the BenchmarkSpec field holding its closed-division value (a `Fixed` with value None)."""


@dataclass(frozen=True)
class Shape:
    """Model dimensions the closed division fixes, compared (and reported) as one tuple."""

    dims: tuple[tuple[str, str, int], ...]
    """(label in the message, dotted Config attribute, required value), in message order."""


@dataclass(frozen=True)
class GbsRange:
    """The global batch sizes the reference convergence points (RCP tables) cover."""

    low: int
    """Smallest GBS with reference convergence points."""
    high: int
    """Largest GBS with reference convergence points."""


@dataclass(frozen=True)
class Steps:
    """A schedule point in optimizer steps the closed division fixes: `steps` at every GBS, or with `base_gbs`,
    ceil(steps * base_gbs / GBS) (the same number of samples at every GBS)."""

    point: str
    """"warmup" (optim.warmup_samples), "decay" (where the cosine ends: optim.decay_samples) or "checkpoint" (the
    step the schedule starts at: optim.checkpoint_samples)."""
    steps: int
    """The step required (at `base_gbs` when that is set)."""
    base_gbs: int = 0
    """The GBS at which `steps` holds, the step scaling as 1 / GBS; 0 = `steps` at every GBS."""

    def __post_init__(self) -> None:
        if self.point not in ("warmup", "decay", "checkpoint"):
            raise ValueError(f"Steps.point={self.point!r}: expected 'warmup', 'decay' or 'checkpoint'")

    def at(self, gbs: int) -> int:
        """The step required at global batch size `gbs`."""
        return math.ceil(self.steps * self.base_gbs / gbs) if self.base_gbs else self.steps


@dataclass(frozen=True)
class LrSteps:
    """Base LR `low` up to GBS `low_max_gbs`, `high` from `high_min_gbs`, either in between (gpt3)."""

    low: float
    """The LR of the small batch sizes."""
    low_max_gbs: int
    """Largest GBS that requires `low`."""
    high: float
    """The LR of the large batch sizes."""
    high_min_gbs: int
    """Smallest GBS that requires `high`."""


@dataclass(frozen=True)
class LrLinear:
    """Base LR = base_lr * GBS / base_gbs, compared exactly as the rules file does: lr * base_gbs == GBS * base_lr."""

    base_lr: float
    """The LR at `base_gbs`."""
    base_gbs: int
    """The GBS at which the LR is `base_lr`."""

    def at(self, gbs: int) -> float:
        """The LR required at `gbs`."""
        return gbs * self.base_lr / self.base_gbs


@dataclass(frozen=True)
class LrSqrt:
    """Base LR = base_lr * sqrt(GBS / base_gbs), within 1e-9 as the rules file compares."""

    base_lr: float
    """The LR at `base_gbs`."""
    base_gbs: int
    """The GBS at which the LR is `base_lr`."""

    def at(self, gbs: int) -> float:
        """The LR required at `gbs`."""
        return self.base_lr * (gbs / self.base_gbs) ** 0.5


ClosedRule = Fixed | Shape | GbsRange | Steps | LrSteps | LrLinear | LrSqrt
"""One closed-division rule; a benchmark's `closed` lists them in the order their messages are reported."""
_Rule = TypeVar("_Rule", Fixed, Shape, GbsRange, Steps, LrSteps, LrLinear, LrSqrt)

INIT_KEY_LISTS = ("adam", "lora", "adamw")
"""The init-phase MLLOG key lists bench/rules.py writes: "adam" (gpt3, rulesets 3.0.0-4.1.0), "lora"
(llama2_70b_lora) and "adamw" (the 5.0.0+ pre-training benchmarks, plus each one's `own_init_keys`)."""


def _shape(*dims: tuple[str, str, int]) -> Shape:
    return Shape(dims)


def _llama_shape(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab: int) -> Shape:
    return _shape(
        ("n_layers", "model.n_layers", n_layers),
        ("d_model", "model.d_model", d_model),
        ("n_heads", "model.n_heads", n_heads),
        ("n_kv_heads", "model.kv_heads", n_kv_heads),
        ("d_ff", "model.ffn_size", d_ff),
        ("vocab_size", "model.vocab_size", vocab),
    )


def _moe_shape(n_layers: int, d_model: int, n_heads: int, vocab: int, experts: int, top_k: int, d_ff: int, shared: int):
    return _shape(
        ("n_layers", "model.n_layers", n_layers),
        ("d_model", "model.d_model", d_model),
        ("n_heads", "model.n_heads", n_heads),
        ("vocab_size", "model.vocab_size", vocab),
        ("moe.n_experts", "model.moe.n_experts", experts),
        ("moe.top_k", "model.moe.top_k", top_k),
        ("moe.d_ff_expert", "model.moe.d_ff_expert", d_ff),
        ("moe.n_shared", "model.moe.n_shared", shared),
    )


def _recipe(beta2: float, eps: float, weight_decay: float, clip: float) -> tuple[Fixed, ...]:
    """Fixed optimizer constants (beta1 0.9 in every rules file), then the quality target and evaluation cadence."""
    return (
        Fixed("optim.beta1", 0.9),
        Fixed("optim.beta2", beta2),
        Fixed("optim.eps", eps),
        Fixed("optim.weight_decay", weight_decay),
        Fixed("optim.grad_clip", clip),
        Fixed("train.target_eval_loss"),
        Fixed("train.eval_interval_samples"),
    )


_FULL_WEIGHTS = Fixed("lora.rank", 0, why="{name} trains every weight")
_FROM_SCRATCH = Fixed("optim.checkpoint_samples", 0, why="{name} starts from scratch")


@dataclass(frozen=True)
class BenchmarkSpec:
    """Everything about one MLPerf Training benchmark that code outside its closed-division checks needs."""

    name: str
    """Official benchmark name: bench.benchmark value, RCP file stem (rcps_<name>.json), results CSV `benchmark`."""
    mllog_constant: str
    """Attribute of `mlperf_logging.mllog.constants` holding the submission_benchmark value to log; "" = the package
    has none, log `name` itself (`submission_benchmark`)."""
    ruleset: str
    """Compliance-checker ruleset (`--ruleset`) and RCP table version its logs are judged by when bench.ruleset is
    empty; "" = the newest the installed mlperf-logging ships for the benchmark (`resolve_ruleset`)."""
    proxy_rules_file: str
    """Rules file of the "<name>-proxy" variant, in the package folder scaletrain/bench/rules/; "" = no proxy yet."""
    reference_preset: str
    """Preset with the closed-division model and hyperparameters (`bench --benchmark NAME`, `predict --model NAME`)."""
    proxy_preset: str
    """Preset of the CPU proxy ("<name>-proxy"); "" = the benchmark has no proxy yet (`names()` leaves it out)."""
    arch: str
    """model.arch the benchmark trains."""
    seq_len: int
    """Tokens per training sequence."""
    eval_every_sequences: int
    """Training sequences between evaluations: every ceil(this / GBS) steps."""
    eval_tokens: int
    """Tokens in one evaluation pass (the simulator prices evaluations with it)."""
    target: float
    """Closed-division target quality: the evaluation loss (log perplexity) a run must reach."""
    runs: int
    """Runs per submission, scored by the olympic mean (mlperf_logging benchmark_meta.py)."""
    converge_unit: str
    """"tokens" or "samples": what the RCP tables, the results files and MLLOG's block/eval metadata count."""
    rcp_key: str
    """Field holding the converge list in the package's RCP JSON (rcp_checker/training_<ruleset>/rcps_<name>.json)."""
    lora: bool
    """LoRA fine-tuning protocol: samples_count metadata, the LoRA init hyperparameters, skipped first evaluations."""
    eval_skip_gbs_divisor: int
    """Evaluations not run at the start: floor(GBS / this) + eval_skip_offset; 0 = none skipped."""
    eval_skip_offset: int
    """See eval_skip_gbs_divisor."""
    calibration_file: str
    """Published results bundled in scaletrain/sim/data/ (calibration and `sim validate`); "" = none yet."""
    default_gbs: int
    """Global batch size `predict`/`sim` use when --gbs is not given."""
    plot_gpu_counts: tuple[int, ...]
    """GPU counts on the x axis of `sim plot`."""
    proxy_base_preset: str
    """Preset of the pretrained base the proxy starts from, which `bench` trains once (fixed seed, to that preset's
    target) and caches as <data dir>/<preset>-base when checkpoint.init_from is empty; "" = trains from scratch."""
    init_keys: str
    """Which init-phase MLLOG key list the benchmark logs (`INIT_KEY_LISTS`); anything else is refused here, so a new
    benchmark can never fall back to another's hyperparameters."""
    own_init_keys: tuple[str, ...]
    """MLLOG keys its rules files add to the "adamw" list, in log order (bench/rules.py holds each one's value)."""
    closed: tuple[ClosedRule, ...]
    """Closed-division rules the compliance checker cannot see (model shape, LR/GBS pairing, schedule, fixed recipe,
    cadence), in report order: bench/closed.py checks a config against them. Proxies follow their rules files."""
    extra_calibration_files: tuple[str, ...] = ()
    """More published results in scaletrain/sim/data/ (other rounds, other column layouts), used with calibration_file."""
    eval_skip_samples: int = 0
    """More evaluations not run at the start: floor(this / GBS) (added to eval_skip_gbs_divisor's and the offset)."""
    eval_skip_min_gbs: int = 0
    """No evaluation is skipped below this GBS: a rule stated for the legal batch sizes only, which would skip
    hundreds of evaluations at a CPU proxy's (which follows its benchmark's cadence rules); 0 = any GBS."""
    fp4_healing_step: int = 0
    """FP4 runs' precision switch: the optimizer step after which an FP4 run continues with FP8 GEMMs ("healing"), as
    the benchmark's published FP4 recipes set it; 0 = no switch. The simulator prices the steps up to it at the FP4
    step time and those after it at the FP8 one (`predict --fp4-healing-step` overrides it)."""
    fp8_attention: bool = False
    """Whether the benchmark's reference recipe runs attention (the dot-product attention core, forward and
    backward) in FP8: the default of `predict`/`plan --fp8-attention` for FP8 layouts."""

    def __post_init__(self) -> None:
        if self.init_keys not in INIT_KEY_LISTS:
            raise ValueError(f"benchmark {self.name!r}: init_keys={self.init_keys!r} is not one of {INIT_KEY_LISTS}")
        if self.lora != (self.init_keys == "lora"):
            raise ValueError(f"benchmark {self.name!r}: lora={self.lora} needs init_keys 'lora' (and only then)")
        if self.own_init_keys and self.init_keys != "adamw":
            raise ValueError(f"benchmark {self.name!r}: own_init_keys extend the 'adamw' list only")
        if not self.closed:
            raise ValueError(f"benchmark {self.name!r} states no closed-division rules (closed)")

    def skipped_evals(self, gbs: int) -> int:
        """Evaluations not run (nor logged) at the start of a run at global batch size `gbs`."""
        if not (self.eval_skip_gbs_divisor or self.eval_skip_samples) or gbs < self.eval_skip_min_gbs:
            return 0
        skip = self.eval_skip_offset + self.eval_skip_samples // gbs
        return skip + (gbs // self.eval_skip_gbs_divisor if self.eval_skip_gbs_divisor else 0)

    def rule(self, kind: type[_Rule], key: str = "") -> _Rule:
        """Its closed-division rule of type `kind`: for Fixed the one on config field `key`, for Steps the one at
        point `key`; LookupError when it has none."""
        for r in self.closed:
            if isinstance(r, kind) and key in ("", getattr(r, "field", None), getattr(r, "point", None)):
                return r
        raise LookupError(f"benchmark {self.name!r} has no {kind.__name__} rule {key}".rstrip())

    def required(self, field: str) -> float | int | str | frozenset[str]:
        """The value its closed division fixes for config `field` (a dotted name like "optim.beta1")."""
        return self.rule(Fixed, field).required(self)

    @property
    def proxy_needs_base(self) -> bool:
        """The proxy starts from a pretrained base (proxy_base_preset)."""
        return bool(self.proxy_base_preset)

    @property
    def has_proxy(self) -> bool:
        """Whether "<name>-proxy" exists (a preset and a rules file)."""
        return bool(self.proxy_preset)

    @property
    def proxy_name(self) -> str:
        """bench.benchmark value of the CPU proxy."""
        return self.name + PROXY_SUFFIX


GPT3 = BenchmarkSpec(
    name="gpt3",
    mllog_constant="GPT3",
    ruleset=DEFAULT_RULESET,
    proxy_rules_file="gpt3_proxy.yaml",
    reference_preset="gpt3-175b",
    proxy_preset="gpt3-proxy",
    arch="gpt3",
    seq_len=2048,
    eval_every_sequences=24_576,
    eval_tokens=11_590_004,  # the validation subset's label tokens, as the reference logs eval_samples
    target=2.69,
    runs=3,
    converge_unit="tokens",
    rcp_key="Epochs to converge",
    lora=False,
    eval_skip_gbs_divisor=0,
    eval_skip_offset=0,
    calibration_file="mlperf_gpt3_calibration.csv",
    default_gbs=2048,
    plot_gpu_counts=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    proxy_base_preset="",
    init_keys="adam",
    own_init_keys=(),
    # training_rules.adoc v4.1 and training_4.1.0/closed_gpt3.yaml; the checker sees none of these in the log.
    closed=(
        Fixed("model.seq_len"),
        _shape(
            ("n_layers", "model.n_layers", 96), ("d_model", "model.d_model", 12288), ("n_heads", "model.n_heads", 96)
        ),
        Fixed("model.ffn_size", 4 * 12288, label="model.d_ff", note="(4 x d_model)"),
        Fixed("model.vocab_size", 50257),
        GbsRange(1536, 8192),  # the RCPs' batch sizes
        LrSteps(low=2e-5, low_max_gbs=3072, high=3e-5, high_min_gbs=4096),
        Fixed("optim.end_lr_ratio", 0.1, why="{name} requires end LR = base/10"),
        # In steps, not samples: the logged steps are what the rule fixes (265, 108,600 and 4,000 steps at 1536).
        Steps("warmup", 265, base_gbs=1536),
        Steps("decay", 108_600, base_gbs=1536),
        Steps("checkpoint", 4000, base_gbs=1536),
        *_recipe(beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0),
    ),
)

LLAMA2_70B_LORA = BenchmarkSpec(
    name="llama2_70b_lora",
    mllog_constant="LLAMA2_70B_LORA",
    # Newest: closed_llama2_70b_lora.yaml is the same file from 4.1.0 to 6.1.0 (mlperf-logging 4.1.68).
    ruleset="",
    proxy_rules_file="llama2_70b_lora_proxy.yaml",
    reference_preset="llama2-70b-lora",
    proxy_preset="llama2-70b-lora-proxy",
    arch="llama",
    seq_len=8192,
    eval_every_sequences=384,
    eval_tokens=173 * 8192,  # GovReport's 173 validation sequences, packed to 8192 tokens
    target=0.925,
    runs=10,
    converge_unit="samples",
    rcp_key="samples to converge",
    lora=True,
    # training_rules.adoc v4.1: "Skipping first FLOOR(0.125*global_batch_size+2) evaluations" = GBS // 8 + 2.
    eval_skip_gbs_divisor=8,
    eval_skip_offset=2,
    calibration_file="mlperf_llama2_lora_calibration.csv",
    default_gbs=8,
    plot_gpu_counts=(8, 16, 32, 64, 128, 256, 512, 1024),
    proxy_base_preset="llama-proxy",
    extra_calibration_files=("mlperf_v5_llama2_70b_lora_calibration.csv",),
    init_keys="lora",
    own_init_keys=(),
    # training_rules.adoc: clip 0.3, LoRA dropout 0.1, alpha 32, weight decay 1e-4, sequence length 8192 (its table
    # says 8196, a typo: the reference and the packed dataset use 8192); closed_llama2_70b_lora.yaml: rank 16. Not in
    # the table, hence the reference's (HF AdamW defaults and its cosine to 0, NVIDIA's NeMo config alike): betas
    # 0.9/0.999, eps 1e-8, end LR 0. GBS (within the RCPs' 8-128), base LR, warm-up and training steps are free.
    closed=(
        Fixed("model.arch"),
        Fixed("model.seq_len"),
        _llama_shape(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab=32000),
        Fixed("lora.rank", 16),
        Fixed("lora.targets", frozenset({"qkv", "proj"}), note="(attention QKV and output)"),
        Fixed("lora.alpha", 32.0),
        Fixed("lora.dropout", 0.1),
        Fixed("optim.weight_decay", 1e-4),
        Fixed("optim.grad_clip", 0.3),
        Fixed("optim.beta1", 0.9),
        Fixed("optim.beta2", 0.999),
        Fixed("optim.eps", 1e-8),
        Fixed("optim.end_lr_ratio", 0.0),
        Fixed("train.target_eval_loss"),
        Fixed("optim.checkpoint_samples", 0, why="LoRA fine-tuning starts its schedule at step 0"),
        Fixed("train.eval_interval_samples"),
        GbsRange(8, 128),  # rcp_checker/training_4.1.0/rcps_llama2_70b_lora.json: GBS 8, 16, 32, 128
    ),
    # Every published v5.1 FP4 config sets HEALING_ITER=350 with HEALING_PRECISION=FP8_DS (FP8 delayed scaling), e.g.
    # mlcommons/training_results_v5.1:NVIDIA/benchmarks/llama2_70b_lora/implementations/nemo/
    # config_GB200_2x4x2xtp1pp1cp2_fp4.sh and config_common_fp4.sh (custom_callbacks.py switches the GEMM recipe
    # there); the v5.1 logs show the slower post-switch steps from step 350 on (sim/data/mlperf_terms README).
    fp4_healing_step=350,
    # The MLCommons reference (mlcommons/training:llama2_70b_lora/run_llama_70B_scrolls_r16.sh) trains in bf16 with
    # flash attention (--bf16 True --use_flash_attn, accelerate mixed_precision bf16): no FP8 attention. NVIDIA's
    # NeMo submissions set FP8_DPA=1 (config_common.sh), which `--fp8-attention` prices.
    fp8_attention=False,
)

LLAMA31_405B = BenchmarkSpec(
    name="llama31_405b",
    mllog_constant="LLAMA31_405B",
    # Newest: rulesets 5.0.0-6.0.0 (mlperf-logging 4.1.68); retired in 6.1.0, whose closed_common.yaml refuses it.
    ruleset="",
    proxy_rules_file="llama31_405b_proxy.yaml",
    reference_preset="llama31-405b",
    proxy_preset="llama31-405b-proxy",
    arch="llama31",
    seq_len=8192,  # closed_llama31_405b.yaml: max_sequence_length == 8192
    # Not in the rules files: every converged sample count in rcps_llama31_405b.json (6.0.0) at GBS 1152, 2304 and
    # 4608 is a multiple of 18,432 (5.0.0's pre-submission RCPs: of 46,080, the interval the 5.0 rules started with).
    eval_every_sequences=18_432,
    eval_tokens=5760 * 8192,  # closed_llama31_405b.yaml: eval_samples == 5760 sequences of 8192 tokens
    target=5.6,  # closed_llama31_405b.yaml: eval_accuracy <= 5.6 (log perplexity)
    runs=3,  # mlperf_logging benchmark_meta.py
    converge_unit="samples",
    rcp_key="Epochs to converge",  # which holds samples (samples_count at the converging evaluation)
    lora=False,
    eval_skip_gbs_divisor=0,
    eval_skip_offset=0,
    calibration_file="mlperf_v5_llama31_405b_calibration.csv",
    default_gbs=1152,  # the reference's: the RCPs' smallest batch size and the LR formula's base
    plot_gpu_counts=(256, 512, 1024, 2048, 4096, 8192, 16384),
    # Continued pre-training, like 405B from Meta's checkpoint: the base is llama31_8b's proxy trained to its target.
    proxy_base_preset="llama31-8b-proxy",
    init_keys="adamw",
    own_init_keys=("init_checkpoint_step",),  # closed_llama31_405b.yaml: init_checkpoint_step == 0
    # closed_llama31_405b.yaml (5.0.0-6.0.0): continued pre-training from Meta's checkpoint, whose schedule still
    # starts at step 0. opt_base_learning_rate * 1152 == GBS * 8e-5; warm-up ceil(8000 * 1152 / GBS) steps; the
    # cosine ends at ceil(1200000 * 1152 / GBS) steps (logged as decay steps = that - warm-up, 5.1.0 on).
    closed=(
        Fixed("model.arch"),
        Fixed("model.seq_len"),
        _llama_shape(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab=128256),
        GbsRange(1152, 4608),  # rcps_llama31_405b.json, 6.0.0: GBS 1152, 2304, 4608 (5.0.0's table: 1008-9216)
        LrLinear(base_lr=8e-5, base_gbs=1152),
        Steps("warmup", 8000, base_gbs=1152),
        Steps("decay", 1_200_000, base_gbs=1152),
        Fixed("optim.checkpoint_samples", 0, why="{name} starts its schedule at step 0 (init_checkpoint_step == 0)"),
        *_recipe(beta2=0.95, eps=1e-5, weight_decay=0.1, clip=1.0),
        _FULL_WEIGHTS,
    ),
)

LLAMA31_8B = BenchmarkSpec(
    name="llama31_8b",
    mllog_constant="LLAMA31_8B",
    ruleset="",  # newest: rulesets 5.1.0-6.1.0, the same closed_llama31_8b.yaml throughout
    proxy_rules_file="llama31_8b_proxy.yaml",
    reference_preset="llama31-8b",
    proxy_preset="llama31-8b-proxy",
    arch="llama31",
    seq_len=8192,  # closed_llama31_8b.yaml: max_sequence_length == 8192
    # Not in the rules files: every converged sample count in rcps_llama31_8b.json is a multiple of 12,288 (but
    # GBS 96's, whose reference evaluated every 129 steps).
    eval_every_sequences=12_288,
    eval_tokens=1024 * 8192,  # closed_llama31_8b.yaml: eval_samples == 1024
    target=3.3,  # closed_llama31_8b.yaml: eval_accuracy <= 3.3
    runs=10,  # mlperf_logging benchmark_meta.py
    converge_unit="samples",
    rcp_key="Epochs to converge",
    lora=False,
    eval_skip_gbs_divisor=0,
    eval_skip_offset=0,
    calibration_file="mlperf_v5_llama31_8b_calibration.csv",
    default_gbs=64,  # the llama31-8b preset's, an RCP batch size (16-128)
    plot_gpu_counts=(8, 16, 32, 64, 128, 256),
    proxy_base_preset="",
    init_keys="adamw",
    own_init_keys=("max_steps",),  # closed_llama31_8b.yaml: max_steps == 1200000
    # closed_llama31_8b.yaml (5.1.0-6.1.0): from scratch; LR and warm-up are free, the cosine ends at step 1,200,000
    # at every GBS (decay steps = 1200000 - warm-up).
    closed=(
        Fixed("model.arch"),
        Fixed("model.seq_len"),
        _llama_shape(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256),
        GbsRange(16, 128),  # rcps_llama31_8b.json, 5.1.0-6.1.0: GBS 16, 32, 64, 96, 128
        Steps("decay", 1_200_000),
        _FROM_SCRATCH,
        *_recipe(beta2=0.95, eps=1e-5, weight_decay=0.1, clip=1.0),
        _FULL_WEIGHTS,
    ),
)

DEEPSEEKV3_671B = BenchmarkSpec(
    name="deepseekv3_671b",
    mllog_constant="DEEPSEEKV3_671B",
    ruleset="",  # newest: rulesets 6.0.0-6.1.0, the same closed_deepseekv3_671b.yaml
    proxy_rules_file="deepseekv3_671b_proxy.yaml",
    reference_preset="deepseek-v3-671b",
    proxy_preset="deepseek-v3-671b-proxy",
    arch="deepseek_v3",
    seq_len=4096,  # closed_deepseekv3_671b.yaml: max_sequence_length == 4096
    # Not in the rules files: the RCPs' converged counts (rcps_deepseekv3_671b.json, GBS 15,360-18,432) are whole
    # steps at consecutive counts (45-48): an evaluation every step at every legal GBS (>= 15,360). 6.1.0's
    # FIRST_CHECK puts the first at step floor(42 + 24576 / GBS): 41 + 24576 // GBS evaluations skipped.
    eval_every_sequences=15_360,
    eval_tokens=1024 * 4096,  # closed_deepseekv3_671b.yaml: eval_samples == 1024
    target=3.6,  # closed_deepseekv3_671b.yaml: eval_accuracy <= 3.6
    runs=3,  # mlperf_logging benchmark_meta.py
    converge_unit="samples",
    rcp_key="Epochs to converge",
    lora=False,
    eval_skip_gbs_divisor=0,
    eval_skip_offset=41,  # with eval_skip_samples: floor(42 + 24576 / GBS) - 1 at every legal GBS
    calibration_file="",  # no published result yet
    default_gbs=16384,  # the LR formula's base, an RCP batch size (15,360-18,432)
    plot_gpu_counts=(256, 512, 1024, 2048, 4096, 8192),
    proxy_base_preset="",
    eval_skip_samples=24576,
    eval_skip_min_gbs=15360,  # closed_deepseekv3_671b.yaml: global_batch_size >= 15360
    init_keys="adamw",
    own_init_keys=("max_steps", "moe_aux_loss_coeff"),  # closed_deepseekv3_671b.yaml: max_steps (any), coeff 0.01
    # closed_deepseekv3_671b.yaml: continued pre-training whose schedule starts at step 0, GBS >= 15,360, LR
    # 2.4e-5 * sqrt(GBS / 16384), 4 warm-up steps, the cosine ending at step 12,000, auxiliary loss coefficient 0.01.
    closed=(
        Fixed("model.arch"),
        Fixed("model.seq_len"),
        _moe_shape(61, 7168, 128, 129280, experts=256, top_k=8, d_ff=2048, shared=1),
        GbsRange(15360, 18432),  # rules: >= 15360; rcps_deepseekv3_671b.json, 6.0.0-6.1.0: 15360, 16384, 18432
        Fixed("model.moe.first_dense", 3),
        LrSqrt(base_lr=2.4e-5, base_gbs=16384),
        Steps("warmup", 4),
        Steps("decay", 12_000),
        Fixed("model.moe.aux_loss_coef", 0.01, exact=True),
        Fixed("optim.checkpoint_samples", 0, why="{name} starts at step 0"),
        *_recipe(beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0),
        _FULL_WEIGHTS,
    ),
)

GPT_OSS_20B = BenchmarkSpec(
    name="gpt_oss_20b",
    mllog_constant="",  # mlperf-logging 4.1.68 checks gpt_oss_20b logs but has no mllog constant for the name
    ruleset="",  # newest: rulesets 6.0.0-6.1.0, the same closed_gpt_oss_20b.yaml
    proxy_rules_file="gpt_oss_20b_proxy.yaml",
    reference_preset="gpt-oss-20b",
    proxy_preset="gpt-oss-20b-proxy",
    arch="gpt_oss",
    seq_len=8192,  # closed_gpt_oss_20b.yaml: max_sequence_length == 8192
    # Not in the rules files: every converged sample count in rcps_gpt_oss_20b.json is a multiple of 12,288.
    eval_every_sequences=12_288,
    eval_tokens=1024 * 8192,  # closed_gpt_oss_20b.yaml: eval_samples == 1024
    target=3.34,  # closed_gpt_oss_20b.yaml: eval_accuracy <= 3.34
    runs=10,  # mlperf_logging benchmark_meta.py
    converge_unit="samples",
    rcp_key="Epochs to converge",
    lora=False,
    eval_skip_gbs_divisor=0,
    eval_skip_offset=0,
    calibration_file="",  # no published result yet
    default_gbs=16,  # the RCP reference's (AMD, 1x MI355X); RCPs for 16, 32 and 64
    plot_gpu_counts=(8, 16, 32, 64, 128),
    proxy_base_preset="",
    init_keys="adamw",
    own_init_keys=("max_steps",),  # closed_gpt_oss_20b.yaml: max_steps == 1200000
    # closed_gpt_oss_20b.yaml (6.0.0-6.1.0): from scratch; LR and warm-up are free, the cosine ends at step 1,200,000.
    closed=(
        Fixed("model.arch"),
        Fixed("model.seq_len"),
        _moe_shape(24, 2880, 64, 201088, experts=32, top_k=4, d_ff=2880, shared=0),
        GbsRange(16, 64),  # rcps_gpt_oss_20b.json, 6.0.0-6.1.0: GBS 16, 32, 64
        Steps("decay", 1_200_000),
        _FROM_SCRATCH,
        *_recipe(beta2=0.95, eps=1e-5, weight_decay=0.1, clip=1.0),
        _FULL_WEIGHTS,
    ),
)

BENCHMARKS: dict[str, BenchmarkSpec] = {
    b.name: b for b in (GPT3, LLAMA2_70B_LORA, LLAMA31_405B, LLAMA31_8B, GPT_OSS_20B, DEEPSEEKV3_671B)
}
"""Official name -> spec. Read at call time everywhere (never copied at import), so a test can add an entry."""


def is_proxy(name: str) -> bool:
    """True for "<official name>-proxy" of a registered benchmark."""
    spec = BENCHMARKS.get(name.removesuffix(PROXY_SUFFIX)) if name.endswith(PROXY_SUFFIX) else None
    return spec is not None and spec.has_proxy


def get(name: str) -> BenchmarkSpec:
    """The spec of an official benchmark or of its proxy; ValueError naming the known ones otherwise."""
    spec = BENCHMARKS.get(name.removesuffix(PROXY_SUFFIX) if is_proxy(name) else name)
    if spec is None:
        raise ValueError(f"unknown benchmark {name!r} (known: {', '.join(names())})")
    return spec


def names() -> tuple[str, ...]:
    """Every bench.benchmark value: each official benchmark followed by its proxy (if it has one), in registry order."""
    return tuple(n for b in BENCHMARKS.values() for n in ((b.name, b.proxy_name) if b.has_proxy else (b.name,)))


def preset_for(name: str) -> str:
    """The preset a benchmark (or proxy) runs when none is given."""
    spec = get(name)
    return spec.proxy_preset if is_proxy(name) else spec.reference_preset


def for_preset(preset: str) -> BenchmarkSpec | None:
    """The benchmark whose reference preset is `preset`, or None (a preset that is no MLPerf benchmark)."""
    return next((b for b in BENCHMARKS.values() if b.reference_preset == preset), None)


def for_model(model: str) -> BenchmarkSpec | None:
    """The benchmark `predict --model` means: an official name or a reference preset; None for other presets."""
    return BENCHMARKS.get(model) or for_preset(model)


def choices_text(items, last: str = "or") -> str:
    """'a, b, c or d' for help and error texts."""
    items = list(items)
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else "".join(items)


OLDEST_RULESET = "4.1.0"
"""The oldest ruleset scaletrain's logs follow: older ones require keys the harness does not log (4.0.0:
submission_status)."""


def _version(ruleset: str) -> tuple[int, ...]:
    return tuple(int(x) for x in ruleset.split(".") if x.isdigit())


def package_rulesets(name: str) -> tuple[str, ...]:
    """Training rulesets from OLDEST_RULESET on, oldest first, for which the installed mlperf-logging ships both the
        closed-division rules
    (compliance_checker/training_<r>/closed_<name>.yaml) and the RCP table (rcp_checker/training_<r>/rcps_<name>.json) of
        benchmark `name` (or its proxy's benchmark); () when the package is not installed.

        Read from the package's folders without importing it, so layer 0 stays stdlib-only.
    """
    bench = get(name).name
    spec = importlib.util.find_spec("mlperf_logging")
    if spec is None or not spec.origin:
        return ()
    root = Path(spec.origin).parent
    found = [
        d.name.removeprefix("training_")
        for d in (root / "compliance_checker").glob("training_*")
        if (d / f"closed_{bench}.yaml").is_file()
        and (root / "rcp_checker" / d.name / f"rcps_{bench}.json").is_file()
        and _version(d.name.removeprefix("training_")) >= _version(OLDEST_RULESET)
    ]
    return tuple(sorted(found, key=_version))


def resolve_ruleset(name: str, requested: str = "") -> str:
    """The ruleset a run of benchmark `name` (official or proxy) is logged and checked by: `requested`
    (bench.ruleset) when given, else the registry's fixed one, else the newest the installed package ships for it.

    ValueError naming the rulesets the package has when `requested` is not one of them (or nothing is installed).
    """
    spec = get(name)
    if not requested and spec.ruleset:
        return spec.ruleset
    have = package_rulesets(spec.name)
    if requested and requested in have:
        return requested
    if not requested and have:
        return have[-1]
    try:
        from importlib.metadata import version

        pkg = f"mlperf-logging {version('mlperf-logging')}"
    except Exception:  # noqa: BLE001 - any metadata problem: name the package without its version
        pkg = "mlperf-logging"
    if not have:
        raise ValueError(f"bench.ruleset: the installed {pkg} ships no {spec.name} rules (is it installed?)")
    raise ValueError(f"bench.ruleset={requested!r}: {pkg} has no {spec.name} rules for it; it has {', '.join(have)}")
