"""A pretraining run to a token budget: days, tokens/s, MFU and the step breakdown, over a global-batch ramp.

MLPerf runs stop at a quality target after minutes; a pretraining run stops after N tokens, weeks later, and its
global batch often grows on the way (DeepSeek-V3: 3,072 to 15,360 sequences over the first 469B tokens; Llama 3:
4M, 8M, then 16M tokens per step). Each stage of the ramp is priced with `predict` at its own batch, in the same
layout (the micro-batches per step change, the layout does not), and the run's time is the sum of the stages'
steps. Failures, checkpoints, cost and energy come on top (`goodput`, `cost`), from these ideal seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from scaletrain.sim.predict import Prediction, predict
from scaletrain.sim.units import parse_count
from scaletrain.sim.workload import ClusterLayout, Workload

TOKENS_MAX = 1e16
"""Largest token budget taken: 10 quadrillion tokens, 600x the largest published pretraining run (15.6T)."""


@dataclass(frozen=True)
class RampStage:
    """One stage of a global-batch ramp: from `start_tokens` on, `gbs` sequences per step."""

    gbs: int
    start_tokens: float


def parse_ramp(text: str) -> tuple[RampStage, ...]:
    """`--gbs-ramp GBS@TOKENS,...` ("3072@0,9216@200B,15360@469B"): the batch from each token count on; the first
    stage must start at 0 and the starts must increase. ValueError, one line, otherwise."""
    stages = []
    for part in str(text).split(","):
        gbs, sep, start = part.strip().partition("@")
        if not sep or not gbs.strip().isdecimal() or int(gbs) < 1:
            raise ValueError(f"--gbs-ramp {text!r}: each stage is GBS@TOKENS with GBS >= 1, e.g. 3072@0,15360@469B")
        at = 0.0 if start.strip() == "0" else float(parse_count(start, f"--gbs-ramp {text!r}: start"))
        stages.append(RampStage(int(gbs), at))
    if stages[0].start_tokens != 0:
        raise ValueError(f"--gbs-ramp {text!r}: the first stage must start at 0 tokens")
    if any(b.start_tokens <= a.start_tokens for a, b in zip(stages, stages[1:])):
        raise ValueError(f"--gbs-ramp {text!r}: the stages' token starts must increase")
    return tuple(stages)


@dataclass
class StagePrice:
    """One ramp stage of the run, priced."""

    gbs: int
    tokens: float
    """Tokens trained in this stage."""
    steps: int
    """Optimizer steps of this stage: its tokens over the batch's, rounded up (the budget's last step is whole)."""
    step_time_s: float
    seconds: float
    tokens_per_s: float
    """Whole-cluster tokens per second."""
    mfu: float
    """Model FLOP/s over the dense bf16 peak."""


@dataclass
class Pretraining:
    """A run to a token budget (`predict --tokens`); `--json` prints it under "pretraining"."""

    tokens: float
    seq_len: int
    stages: list[StagePrice]
    steps: int
    """Optimizer steps of the whole run (each stage's rounded up)."""
    train_s: float | None
    """Seconds of training steps without failures or checkpoints (the ideal run); None when a stage cannot run."""
    days: float | None
    """train_s in days (24 h); None as train_s."""
    tokens_per_s: float
    """The run's average whole-cluster tokens per second."""
    tokens_per_s_per_gpu: float
    mfu: float
    """Time-weighted model FLOP/s over the dense bf16 peak, for the whole run."""
    step_breakdown: dict
    """Seconds per step by cause in the last (largest-batch) stage, where most tokens go."""
    memory_gib_per_gpu: float
    """The most any stage needs per GPU."""
    feasible: bool
    reasons: list = field(default_factory=list)
    goodput: dict | None = None
    """Failures and checkpoints (`sim.goodput`): expected days, interval, goodput; None when not priced."""
    cost: dict | None = None
    """Money and energy (`sim.cost`); None when not priced."""

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def stage_tokens(tokens: float, ramp: tuple[RampStage, ...]) -> list[float]:
    """Tokens each ramp stage trains within a `tokens` budget (stages starting past the budget train none)."""
    starts = [s.start_tokens for s in ramp] + [math.inf]
    return [max(0.0, min(tokens, starts[i + 1]) - min(tokens, starts[i])) for i in range(len(ramp))]


def price_pretraining(
    w: Workload,
    layout: ClusterLayout,
    tokens: float,
    gpu: str,
    node: str | None = None,
    fabric: str | None = None,
    calibration: str | None = None,
    ramp: tuple[RampStage, ...] = (),
    catalog=None,
) -> tuple[Prediction, Pretraining]:
    """(the prediction at the run's largest batch, the run to `tokens` tokens of `w.seq_len`) in `layout`.

    Without `ramp` the whole run is at `layout.gbs`. With it, each stage is priced at its batch in the same layout;
    a batch the layout cannot run (not a multiple of dp·mbs, fewer micro-batches than pipeline stages) makes the run
    infeasible with that reason. The prediction returned carries no MLPerf time-to-train (`mlperf_run=False`).
    """
    ramp = ramp or (RampStage(layout.gbs, 0.0),)
    parts = stage_tokens(tokens, ramp)
    preds: list[Prediction] = []
    for stage in ramp:
        preds.append(
            predict(
                w,
                replace(layout, gbs=stage.gbs),
                gpu,
                node,
                fabric,
                calibration,
                catalog=catalog,
                mlperf_run=False,
            )
        )
    last = max(range(len(ramp)), key=lambda i: ramp[i].gbs)
    main = preds[last]
    reasons: list[str] = []
    for stage, p in zip(ramp, preds):
        for r in p.reasons:
            reasons.append(r if len(ramp) == 1 else f"GBS {stage.gbs}: {r}")
    priced = [
        _stage(stage, n, p, w) for stage, n, p in zip(ramp, parts, preds) if n > 0 and math.isfinite(p.step_time_s)
    ]
    ok = bool(priced) and len(priced) == sum(1 for n in parts if n > 0)
    train_s = sum(s.seconds for s in priced) if ok else 0.0
    ok = ok and train_s > 0
    # What the whole steps train (the budget rounded up to them) over the time they take.
    trained = sum(s.steps * s.gbs * w.seq_len for s in priced)
    flops = trained * w.flops_per_token
    run = Pretraining(
        tokens=tokens,
        seq_len=w.seq_len,
        stages=priced,
        steps=sum(s.steps for s in priced),
        train_s=train_s if ok else None,
        days=train_s / 86400 if ok else None,
        tokens_per_s=trained / train_s if ok else 0.0,
        tokens_per_s_per_gpu=trained / train_s / layout.gpus if ok else 0.0,
        mfu=flops / (train_s * layout.gpus * main.mfu_peak_tflops * 1e12) if ok else 0.0,
        step_breakdown=dict(main.breakdown),
        # An unpriced stage (its layout refused) has NaN memory; the others say what the run needs.
        memory_gib_per_gpu=max(
            [p.memory_gib_per_gpu for p in preds if math.isfinite(p.memory_gib_per_gpu)] or [math.nan]
        ),
        feasible=not reasons,
        reasons=reasons,
    )
    return main, run


def _stage(stage: RampStage, tokens: float, p: Prediction, w: Workload) -> StagePrice:
    per_step = stage.gbs * w.seq_len
    steps = math.ceil(tokens / per_step)  # whole steps: the last one fills up the budget
    return StagePrice(
        gbs=stage.gbs,
        tokens=tokens,
        steps=steps,
        step_time_s=p.step_time_s,
        seconds=steps * p.step_time_s,
        tokens_per_s=per_step / p.step_time_s,
        mfu=p.mfu,
    )


__all__ = [
    "parse_count",
    "parse_ramp",
    "RampStage",
    "StagePrice",
    "Pretraining",
    "price_pretraining",
    "stage_tokens",
    "layout_of",
]


def layout_of(p: Prediction) -> ClusterLayout:
    """The ClusterLayout a prediction priced, back from its `layout` dict (the keys `predict` drops at their
    defaults come back as the defaults; the derived ones, dp, microbatches, schedule and chunk_layers, are
    dropped)."""
    names = {f.name for f in fields(ClusterLayout)}
    d = {k: v for k, v in p.layout.items() if k in names}
    d["schedule"] = p.layout.get("schedule", "") if p.layout.get("pp", 1) > 1 else ""
    d["pp_stage_layers"] = tuple(d.get("pp_stage_layers", ()))
    d["fp8_attention"] = bool(p.layout.get("fp8_attention", False))  # resolved already: no recipe default again
    return ClusterLayout(**d)
