"""What is being trained, and how it is laid out: the simulator's two inputs besides the hardware.

A Workload holds the `ModelShape` of the same `ModelConfig` the trainer uses; its parameters and FLOPs come from
the per-layer inventory built from that shape (`sim/layers.py`), which the trainer's MFU formula
(`scaletrain.model.flops`) also counts with and a test ties to the real modules, so trainer MFU and simulator MFU
cannot disagree about the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from scaletrain import benchmarks
from scaletrain.config import Config, ConfigError, resolve
from scaletrain.sim.layers import Inventory, ModelShape, shape_of


@dataclass(frozen=True)
class Workload:
    """A model trained on sequences of `seq_len` tokens: the model is its `shape` (sim/layers.py's ModelShape, the
    one description the inventory is built from); the sequence length is the workload's own."""

    shape: ModelShape
    """The model's widths, MoE/MLA/window parts and LoRA rank and targets."""
    seq_len: int
    """s: tokens per sequence."""
    name: str = ""
    """Preset name it came from."""

    @cached_property
    def inventory(self) -> Inventory:
        """The per-layer GEMMs and attention ops of this model (sim/layers.py): its parameter counts too."""
        return Inventory(self.shape)

    @cached_property
    def flops_per_token(self) -> float:
        """Training model FLOPs per token at `seq_len` (the trainer's MFU numerator)."""
        return self.inventory.flops_per_token(self.seq_len)

    @cached_property
    def forward_flops(self) -> dict[str, float]:
        """Forward FLOPs per token at `seq_len`, split into "gemm", "attn" and "logits"."""
        return self.inventory.forward_flops(self.seq_len)


def workload_from_config(cfg: Config, name: str = "", seq_len: int | None = None) -> Workload:
    """The Workload of a resolved trainer config."""
    return Workload(shape=model_shape(cfg), seq_len=seq_len or cfg.model.seq_len, name=name or cfg.preset)


def model_shape(cfg: Config) -> ModelShape:
    """The inventory's view of a resolved trainer config (model widths, LoRA rank and targets)."""
    return shape_of(cfg.model, max(cfg.lora.rank, 0), tuple(cfg.lora.targets))


def load_config(model: str, overrides: tuple[str, ...] = (), config_file: str | None = None) -> Config:
    """The trainer config of a preset name (or benchmark alias: "gpt3", "llama2_70b_lora"), then `config_file`
    (TOML, or a run's config.json, as `train --config` reads it), then --set overrides."""
    alias = benchmarks.BENCHMARKS.get(model)  # a benchmark name means its reference preset
    preset = alias.reference_preset if alias else model
    try:
        # host=False: a priced config runs on the cluster it names, not on this machine's cores.
        return resolve(preset, config_file, overrides=list(overrides), host=False)
    except ConfigError as exc:
        raise ConfigError(f"--model {model}: {exc}") from None


def load_workload(model: str, overrides: tuple[str, ...] = ()) -> Workload:
    """Workload of a preset name (or benchmark alias: "gpt3", "llama2_70b_lora"), with --set style overrides."""
    cfg = load_config(model, overrides)
    return workload_from_config(cfg, name=cfg.preset)


@dataclass(frozen=True)
class ClusterLayout:
    """A parallel layout and batch shape for the simulator (Megatron notation: t, p, v, d, c, b, B)."""

    gpus: int
    """Total GPUs = tp * pp * cp * dp."""
    tp: int = 1
    """t: tensor-parallel degree (inside an NVLink domain in sane layouts)."""
    pp: int = 1
    """p: pipeline stages."""
    vp: int = 1
    """v: virtual stages per pipeline rank (interleaved 1F1B when > 1)."""
    cp: int = 1
    """c: context-parallel degree."""
    mbs: int = 1
    """b: micro-batch size in sequences."""
    gbs: int = 1
    """B: global batch size in sequences."""
    sp: bool = True
    """Sequence parallelism with TP (reduce-scatter/all-gather instead of all-reduce)."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" or "full"."""
    fp8: bool = False
    """FP8 GEMMs (Transformer Engine style) for every transformer-layer matmul; the output layer stays bf16."""
    fp4: bool = False
    """FP4 (NVFP4 / MXFP4) GEMMs where FP8 would apply (needs fp8: the rest follows the FP8 recipe: attention, output
    layer, embedding and adapters stay bf16, casts, gradients and memory as with FP8)."""
    fp8_attention: bool | None = None
    """The attention core (flash attention's QK^T, softmax and AV, forward and backward) in FP8, as Transformer
    Engine's FP8 dot-product attention runs it (NeMo's FP8_DPA=1 with NVTE_FP8_DPA_BWD=1); needs fp8. None = the
    benchmark recipe's (`with_recipe`: `BenchmarkSpec.fp8_attention` on FP8 layouts), bf16 for other models."""
    fp4_healing_step: int | None = None
    """FP4 layouts: the optimizer step after which the run continues with FP8 GEMMs (the "healing" precision
    switch of the published FP4 recipes); 0 = no switch. None = the benchmark recipe's (`with_recipe`:
    `BenchmarkSpec.fp4_healing_step`), 0 for other models. The step time is FP4's either way; the run's time
    (`predict`) prices the steps and evaluations after it at the FP8 rates. Ignored without fp4."""
    zero: int = 1
    """Optimizer sharding over DP: 0 none, 1 distributed optimizer (ZeRO-1: gradients whole, reduce-scattered once a
    step), 2 gradients sharded too and reduce-scattered after every micro-batch's backward, weights whole for the
    step (FSDP without resharding after forward, as Llama 3 405B trained), 3 fully sharded (ZeRO-3/FSDP)."""
    bf16_grads: bool = False
    """Keep and reduce gradients in bf16 (MLPerf gpt3 recipes); False = Megatron's default fp32 main grads."""
    schedule: str = ""
    """Pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b" or "zb_h1" (zero bubble: 1F1B with each weight gradient
    deferred to fill the bubble, Qi et al. 2023; simulator only); empty picks 1f1b, or interleaved when vp > 1."""
    ep: int = 1
    """Expert-parallel degree: an MoE model's routed experts shared out over ep ranks of the tp·cp·dp ranks of a
    pipeline stage (whole experts, expert tensor parallelism 1), tokens dispatched to them and combined back by
    all-to-all; their gradients reduce over the tp·cp·dp / ep ranks holding the same experts."""
    moe_imbalance: float = 1.0
    """Routed tokens on the busiest expert rank over the mean (1 = perfectly balanced): the routed-expert GEMMs and
    the all-to-all wait for that rank."""
    shard_group: int = 0
    """Ranks the ZeRO sharding spans; 0 = all of d = dp·cp. HSDP shards over dp_shard·cp and replicates the rest."""
    pp_first_layers: int = -1
    """Transformer blocks of the first virtual pipeline stage (with the embedding); -1 = the default split
    (`chunk_layers`). Megatron's `--decoder-first-pipeline-num-layers`."""
    pp_last_layers: int = -1
    """Transformer blocks of the last virtual pipeline stage (with the output layer and loss); -1 = the default
    split. Megatron's `--decoder-last-pipeline-num-layers`."""
    pp_stage_layers: tuple[int, ...] = ()
    """Blocks of every virtual stage in pipeline order (pp*vp entries); empty = first/last or the default split."""
    free_stage_outputs: bool = True
    """A pipeline stage frees its output's data once sent, as Megatron does (`deallocate_output_tensor`) and Llama 3
    did (Dubey et al. 2024, §3.3.2); False keeps each output to its micro-batch's backward, as
    torch.distributed.pipelining's PipelineStage does (its `fwd_cache` holds the output tuple until
    `backward_one_chunk`), costing one stage output per in-flight (micro-batch, chunk) (`memory.stage_io_bytes`)."""

    def chunks(self, w: Workload) -> tuple[tuple[int, ...], ...] | None:
        """Blocks of each (pipeline rank, virtual chunk) of `w` in this layout (`chunk_layers`); None if no split."""
        return chunk_layers(
            w.shape.layers, self.pp, self.vp, self.pp_first_layers, self.pp_last_layers, self.pp_stage_layers
        )

    def rank_blocks(self, w: Workload) -> list[int]:
        """Blocks each pipeline rank holds over its chunks (`rank_layers`)."""
        return rank_layers(
            w.shape.layers, self.pp, self.vp, self.pp_first_layers, self.pp_last_layers, self.pp_stage_layers
        )

    @property
    def zero_shards(self) -> int:
        """Ranks weights, gradients and optimizer state are sharded over under ZeRO (d = dp·cp unless HSDP)."""
        return self.shard_group or self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (their gradients reduce over these): tp·cp·dp / ep."""
        return max(1, self.tp * self.cp * self.dp // max(self.ep, 1))

    @property
    def dp(self) -> int:
        """d: data-parallel degree (0 when a degree is not positive; `problems` says which)."""
        model = self.tp * self.pp * self.cp
        return self.gpus // model if model > 0 else 0

    @property
    def microbatches(self) -> int:
        """m: micro-batches per step per pipeline = B / (d * b)."""
        return self.gbs // (self.dp * self.mbs) if self.dp > 0 and self.mbs > 0 else 0

    @property
    def pipeline_schedule(self) -> str:
        """The schedule actually simulated."""
        if self.schedule:
            return self.schedule
        if self.pp == 1:
            return "1f1b"
        return "interleaved_1f1b" if self.vp > 1 else "1f1b"

    def problems(self, w: Workload) -> list[str]:
        """Why this layout cannot run workload `w` (empty when it can)."""
        out = []
        for name in ("gpus", "tp", "pp", "vp", "cp", "mbs", "gbs", "ep"):
            if getattr(self, name) < 1:
                out.append(f"{name}={getattr(self, name)} must be >= 1")
        if out:
            return out
        if self.gpus % (self.tp * self.pp * self.cp):
            out.append(f"gpus={self.gpus} is not a multiple of tp*pp*cp={self.tp * self.pp * self.cp}")
            return out
        if self.ep > 1 and not w.shape.experts:
            out.append(f"ep={self.ep} needs a Mixture-of-Experts model ({w.name or w.shape.arch} is dense)")
        elif self.ep > 1 and w.shape.experts % self.ep:
            out.append(f"ep={self.ep} does not divide the {w.shape.experts} experts")
        elif (self.tp * self.cp * self.dp) % self.ep:
            out.append(f"ep={self.ep} does not divide tp*cp*dp={self.tp * self.cp * self.dp} (the ranks of a stage)")
        if not self.moe_imbalance >= 1:
            out.append(f"moe_imbalance={self.moe_imbalance} must be >= 1 (the busiest expert rank over the mean)")
        if w.shape.heads % self.tp or w.shape.kv_heads % self.tp and self.tp % w.shape.kv_heads:
            out.append(f"tp={self.tp} does not divide the {w.shape.heads} heads / {w.shape.kv_heads} kv heads")
        if w.shape.ffn % self.tp:
            out.append(f"tp={self.tp} does not divide the MLP width {w.shape.ffn}")
        if self.pp_stage_layers and (self.pp_first_layers >= 0 or self.pp_last_layers >= 0):
            out.append("give either the per-stage layer list or the first/last stage's layers, not both")
        elif self.chunks(w) is None:
            out.append(
                split_problem(
                    w.shape.layers,
                    self.pp,
                    self.vp,
                    self.pp_first_layers,
                    self.pp_last_layers,
                    self.pp_stage_layers,
                )
            )
        if w.seq_len % (2 * self.cp if self.cp > 1 else 1):
            out.append(f"cp={self.cp} needs the sequence {w.seq_len} to split into 2*cp chunks")
        if self.sp and self.tp > 1 and (w.seq_len // self.cp) % self.tp:
            out.append(f"sequence parallelism needs seq/cp={w.seq_len // self.cp} divisible by tp={self.tp}")
        if self.gbs % (self.dp * self.mbs):
            out.append(f"gbs={self.gbs} is not a multiple of dp*mbs={self.dp}*{self.mbs}")
        elif self.pp > 1 and self.microbatches < self.pp:
            out.append(f"{self.microbatches} micro-batches per step < pp={self.pp}")
        elif self.pipeline_schedule == "interleaved_1f1b" and self.microbatches % self.pp:
            out.append(
                f"interleaved schedule needs micro-batches ({self.microbatches}) to be a multiple of pp={self.pp}"
            )
        if self.fp4 and not self.fp8:
            out.append("fp4 needs fp8 (FP4 GEMMs replace the FP8 ones; the rest follows the FP8 recipe)")
        if self.fp8_attention and not self.fp8:
            out.append("fp8_attention needs fp8 (FP8 attention is part of the FP8 recipe)")
        step = self.fp4_healing_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            out.append(f"fp4_healing_step={step!r} must be a whole number of steps >= 0 (0 = no switch)")
        if self.recompute not in ("none", "selective", "full"):
            out.append(f"recompute={self.recompute!r} must be none, selective or full")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"zero={self.zero} must be 0, 1, 2 or 3")
        if self.schedule not in ("", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
            out.append(f"schedule={self.schedule!r} must be gpipe, 1f1b, interleaved_1f1b or zb_h1")
        if self.vp > 1 and self.schedule in ("gpipe", "1f1b", "zb_h1"):
            out.append(f"vp={self.vp} needs the interleaved_1f1b schedule")
        return out

    def describe(self) -> str:
        """Short text form, e.g. "TP4 PP8 VP12 CP1 DP336 mbs1 GBS2688 fp8"."""
        text = (
            f"TP{self.tp} PP{self.pp} VP{self.vp} CP{self.cp} DP{self.dp}{f' EP{self.ep}' if self.ep > 1 else ''}"
            f" mbs{self.mbs} GBS{self.gbs}"
            f"{' fp4' if self.fp4 else ' fp8' if self.fp8 else ''}{' fp8-attention' if self.fp8_attention else ''}"
            f"{'' if self.recompute == 'none' else ' ' + self.recompute}"
        )
        return text


def with_recipe(layout: ClusterLayout, benchmark: str | None) -> ClusterLayout:
    """`layout` with the recipe choices it leaves to the benchmark (None) filled in from `benchmark`'s spec: FP8
    attention on FP8 layouts where the reference recipe runs it, and the FP4 healing step; without a benchmark, bf16
    attention and no switch."""
    spec = benchmarks.BENCHMARKS.get(benchmark) if benchmark else None
    changes: dict = {}
    if layout.fp8_attention is None:
        changes["fp8_attention"] = bool(spec and spec.fp8_attention and layout.fp8)
    if layout.fp4_healing_step is None:
        changes["fp4_healing_step"] = spec.fp4_healing_step if spec else 0
    return replace(layout, **changes) if changes else layout


def chunk_layers(
    layers: int, pp: int, vp: int, first: int = -1, last: int = -1, stages: tuple[int, ...] = ()
) -> tuple[tuple[int, ...], ...] | None:
    """Transformer blocks of each (pipeline rank, virtual chunk), [rank][chunk]; None when they do not split.

    Virtual stage k (0 .. pp*vp-1) lives on rank k % pp as chunk k // pp (Megatron's and torch's loop placement).

    - `stages` given: the blocks of every virtual stage in order (pp*vp counts summing to `layers`; the first and
      last stage may hold none, keeping only the embedding or the output layer and loss; every other holds >= 1).
    - `first` and/or `last` >= 0: the first (last) virtual stage holds that many blocks and the others split the
      rest evenly, each >= 1 (Megatron's `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`,
      the way Llama 3 and DeepSeek-V3 lightened their end stages).
    - Neither: evenly when pp*vp divides the blocks. Otherwise Megatron's `account_for_embedding_in_pipeline_split`
      and `account_for_loss_in_pipeline_split`, which NVIDIA's llama31_405b configs set (126 blocks in pp8 x vp8 =
      64 chunks): the embedding and the loss count as one block each, so layers + 2 split evenly and the first chunk
      (rank 0, chunk 0, with the embedding) and the last (rank pp-1, chunk vp-1, with the output layer and loss)
      hold one block fewer (each keeps at least one).
    """
    return _chunk_layers(layers, pp, vp, first, last, tuple(stages))


@lru_cache(maxsize=4096)  # pure, and the memory model asks for the same split many times per layout
def _chunk_layers(
    layers: int, pp: int, vp: int, first: int, last: int, stages: tuple[int, ...]
) -> tuple[tuple[int, ...], ...] | None:
    n = pp * vp
    if min(layers, pp, vp) < 1:
        return None
    sizes = stage_split(layers, n, first, last, stages)
    if sizes is None:
        return None
    return tuple(tuple(sizes[c * pp + r] for c in range(vp)) for r in range(pp))


def stage_split(layers: int, n: int, first: int = -1, last: int = -1, stages: tuple[int, ...] = ()) -> list[int] | None:
    """Blocks of each of `n` virtual stages in pipeline order (see `chunk_layers`); None when they do not split."""
    if min(layers, n) < 1:
        return None
    if stages:
        ok = len(stages) == n and sum(stages) == layers and all(x >= 0 for x in stages)
        return list(stages) if ok and all(x >= 1 for x in stages[1:-1]) else None
    if first >= 0 or last >= 0:
        ends = [x for x in (first, last) if x >= 0]
        inner = n - len(ends)
        rest = layers - sum(ends)
        if n == 1:
            return [layers] if all(x == layers for x in ends) else None
        if inner == 0:
            return [first, last] if rest == 0 else None
        if rest < inner or rest % inner:
            return None
        sizes = [rest // inner] * n
        if first >= 0:
            sizes[0] = first
        if last >= 0:
            sizes[-1] = last
        return sizes
    if layers % n == 0:
        return [layers // n] * n
    per = (layers + 2) // n
    if (layers + 2) % n or per < 2:
        return None
    sizes = [per] * n
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes


def split_problem(layers: int, pp: int, vp: int, first: int = -1, last: int = -1, stages: tuple[int, ...] = ()) -> str:
    """Why `chunk_layers` refuses this split, in one sentence naming the numbers ("" when it splits)."""
    n = pp * vp
    if chunk_layers(layers, pp, vp, first, last, stages) is not None:
        return ""
    if stages:
        if len(stages) != n:
            return f"the stage layer list has {len(stages)} entries, but pp*vp = {n} virtual stages"
        if sum(stages) != layers:
            return f"the stage layer list sums to {sum(stages)} blocks, but the model has {layers}"
        return "every stage but the first and the last needs at least one block (and none may be negative)"
    if first >= 0 or last >= 0:
        ends = [x for x in (first, last) if x >= 0]
        inner = n - len(ends)
        return (
            f"with first={first} and last={last} blocks ({'-1 = even' if -1 in (first, last) else 'set'}), the other "
            f"{inner} virtual stages cannot split the remaining {layers - sum(ends)} blocks evenly (>= 1 each)"
        )
    return (
        f"pp*vp={n} divides neither the {layers} layers nor {layers}+2 (the embedding and the loss counted as layers)"
    )


def rank_layers(
    layers: int, pp: int, vp: int, first: int = -1, last: int = -1, stages: tuple[int, ...] = ()
) -> list[int]:
    """Transformer blocks each pipeline rank holds (all its chunks); ceil(layers / pp) each where they do not
    split (`chunk_layers`)."""
    table = chunk_layers(layers, pp, vp, first, last, stages)
    if table is None:
        return [ceil_div(layers, max(pp, 1))] * max(pp, 1)
    return [sum(row) for row in table]


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling division."""
    return -(-a // b)


__all__ = [
    "Workload",
    "ClusterLayout",
    "with_recipe",
    "load_workload",
    "load_config",
    "workload_from_config",
    "model_shape",
    "ceil_div",
    "chunk_layers",
    "stage_split",
    "split_problem",
    "rank_layers",
]
