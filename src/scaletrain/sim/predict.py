"""Predictions: step time, throughput, MFU, memory and MLPerf time-to-train for one workload, layout and cluster."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from scaletrain import benchmarks
from scaletrain.sim import memory, mlperf
from scaletrain.sim.catalog import Catalog, load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency, efficiency_for, pauses
from scaletrain.sim.fixed_costs import domains, eval_fixed_s, warmup_s
from scaletrain.sim.step import StepResult, step_time
from scaletrain.sim.workload import ClusterLayout, Workload, with_recipe


def benchmark_of(preset: str) -> str | None:
    """The MLPerf benchmark whose reference preset `preset` is (for steps, evaluations and time-to-train), or None."""
    spec = benchmarks.for_preset(preset)
    return spec.name if spec else None


@dataclass
class Prediction:
    """Everything `scaletrain predict --json` prints (the keys are a stable interface)."""

    model: str
    gpu: str
    node: str
    fabric: str
    gpus: int
    layout: dict
    calibration: str
    feasible: bool
    reasons: list
    step_time_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    """Model FLOP/s over the dense bf16 peak (even for FP8 runs)."""
    mfu_peak_tflops: float
    memory_gib_per_gpu: float
    memory: dict
    steps: float | None
    """Training steps to the target (fractional when it is an expectation over runs)."""
    evals: float | None
    eval_time_s: float | None
    train_time_s: float | None
    time_to_train_min: float | None
    breakdown: dict = field(default_factory=dict)
    """Seconds per step by cause (sums to step_time_s)."""
    ttt_breakdown: dict = field(default_factory=dict)
    """Minutes of time-to-train by cause: training steps split as in `breakdown`, plus evaluations and warm-up."""
    warmup_s: float | None = None
    """Timed warm-up beyond the steady steps: slower first steps and communicator creation (`fixed_costs`)."""
    phases_min: dict = field(default_factory=dict)
    """Time-to-train in minutes by phase: warmup, steps, evaluations (sums to time_to_train_min)."""
    one_off_s: float | None = None
    """The software release's one-off seconds inside the timed region (start-up, first validation set-up, the
    recipe's pauses), fitted on the public logs; part of warmup_s."""
    eval_first_s: float | None = None
    """Seconds of the first evaluation (eval_time_s plus the release's first-evaluation extra)."""
    healing_step: int = 0
    """FP4 layouts: the step after which the run continues with FP8 GEMMs (the recipe's healing step); 0 = no
    switch (not FP4, or switched off). step_time_s and eval_time_s are the FP4 ones before it."""
    step_time_post_switch_s: float | None = None
    """Seconds per step after the healing step (the same layout with FP8 GEMMs); None when the run does not get
    past the healing step."""
    eval_time_post_switch_s: float | None = None
    """Seconds per evaluation after the healing step; None as step_time_post_switch_s."""
    steps_post_switch: float | None = None
    """Of `steps`, those after the healing step; None as step_time_post_switch_s."""
    evals_post_switch: float | None = None
    """Of `evals`, those after the healing step; None as step_time_post_switch_s."""

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ExpectedRun:
    """Steps and evaluations of the run a score reflects (fractional when it is an average over runs)."""

    steps: float
    evals: float
    eval_tokens: int


def expected_convergence(bench: str, gbs: int, converge: float | None = None) -> ExpectedRun:
    """Steps and evaluations behind a benchmark score at `gbs`.

    With `converge` given (one run's published tokens/samples) it is that run, rounded up to its evaluation.
    Otherwise the RCP mean: gpt3 is scored on the median of 3 runs, which stops at an evaluation, so the RCP
    mean is rounded up to a whole evaluation interval; llama2_70b_lora's olympic mean over 10 runs averages
    runs stopping at different evaluations, and the checker normalises faster runs up to the RCP mean, so the
    expected point is the RCP mean itself (the checker's pruned reference), in fractional intervals.
    """
    # Scored on 3 runs, the olympic mean is the median run, which stopped at an evaluation.
    if converge is not None or mlperf.bench(bench).runs == 3:
        c = mlperf.convergence(bench, gbs, converge)
        return ExpectedRun(c.steps, c.evals, c.eval_tokens)
    b = mlperf.bench(bench)
    per_step = gbs * (b.seq_len if b.converge_unit == "tokens" else 1)
    interval = mlperf.eval_interval_steps(bench, gbs)
    skip = mlperf.skipped_evals(bench, gbs)
    steps = max(mlperf.rcp_mean(bench, gbs, pruned=True) / per_step, (skip + 1) * interval)
    return ExpectedRun(steps, steps / interval - skip, b.eval_tokens)


def eval_time(
    w: Workload, layout: ClusterLayout, fwd_rank_s: float, eval_tokens: int, eff: Efficiency, nvlink_domain: int = 8
) -> float:
    """Seconds for one evaluation: forward only over the eval set, split across DP replicas, pipelined, plus the
    fixed cost of an evaluation (`fixed_costs.eval_fixed_s`) over the NVLink domains the layout spans."""
    fixed = eval_fixed_s(domains(layout.gpus, nvlink_domain), eff)
    return eval_passes(w, layout, eval_tokens) * eval_forward_s(w, layout, fwd_rank_s, eff) + fixed


def eval_forward_s(w: Workload, layout: ClusterLayout, fwd_rank_s: float, eff: Efficiency) -> float:
    """Seconds of one evaluation micro-batch forward on the busiest rank: its GPU time at the evaluation efficiency,
    or the host time launching its layers' kernels without CUDA graphs (`Efficiency.eval_host_layer_s`), whichever
    is longer."""
    # The busiest rank's blocks: ceil(layers / pp) for the default splits, more on the inner ranks of uneven ones.
    layers = max(layout.rank_blocks(w))
    return max(fwd_rank_s / eff.eval_eff, layers * eff.eval_host_layer_s)


def eval_passes(w: Workload, layout: ClusterLayout, eval_tokens: int) -> float:
    """Micro-batch forward times one evaluation takes on the busiest rank: the eval set's sequences split across
    the DP replicas, plus the pipeline's fill."""
    seqs = math.ceil(eval_tokens / w.seq_len)
    micro = math.ceil(seqs / (layout.dp * layout.mbs))
    return micro + (layout.pp - 1) / layout.vp


def predict(
    w: Workload,
    layout: ClusterLayout,
    gpu: str,
    node: str | None = None,
    fabric: str | None = None,
    calibration: str | None = None,
    eff: Efficiency | None = None,
    converge: float | None = None,
    catalog: Catalog | None = None,
    event: bool = True,
    benchmark: str | None = None,
    mlperf_run: bool = True,
) -> Prediction:
    """Predict one configuration. `eff` overrides the fitted set picked by `calibration` (a release). The recipe
    choices `layout` leaves open (None: FP8 attention, the FP4 healing step) are the benchmark's (`with_recipe`).
    `mlperf_run=False` prices the step only, without the benchmark's run (steps, evaluations, time-to-train are None),
    as a pretraining run to a token budget (`sim.pretrain`) needs; the benchmark's fitted scalars still apply."""
    cat = catalog or load_catalog()
    g, n, f = cat.system(gpu, node, fabric)
    release = calibration or "latest"
    bench = benchmark or benchmark_of(w.name)
    if eff is None:
        release, eff = efficiency_for(calibration, g.key, bench, cat)
    layout = with_recipe(layout, bench)
    reasons = layout.problems(w)
    if layout.fp8 and g.fp8_tflops <= 0:
        reasons.append(f"{g.key} has no FP8 tensor cores")
    if layout.fp4 and g.fp4_tflops <= 0:
        reasons.append(f"{g.key} has no FP4 tensor cores")
    base: dict[str, Any] = dict(
        model=w.name,
        gpu=g.key,
        node=n.key,
        fabric=f.key,
        gpus=layout.gpus,
        layout=_layout_dict(layout, w),
        calibration=release,
    )
    if reasons:
        return Prediction(
            **base,
            feasible=False,
            reasons=reasons,
            step_time_s=math.nan,
            tokens_per_s_per_gpu=0.0,
            model_tflops_per_gpu=0.0,
            mfu=0.0,
            mfu_peak_tflops=g.bf16_tflops,
            memory_gib_per_gpu=math.nan,
            memory={},
            steps=None,
            evals=None,
            eval_time_s=None,
            train_time_s=None,
            time_to_train_min=None,
        )
    cl = Cluster(g, n, f, layout.gpus)
    st = step_time(w, layout, cl, eff, event=event)
    mem = memory.memory_per_gpu(w, layout, in_flight=st.in_flight)
    if not memory.fits(mem, g.hbm_gb):
        reasons.append(
            f"needs {mem.total / 2**30:.1f} GiB per GPU, more than the {g.hbm_gb:.0f} GB "
            f"{g.key} leaves after its runtime reserve"
        )
    tokens_per_s = layout.gbs * w.seq_len / st.step_time_s
    per_gpu = tokens_per_s / layout.gpus
    tflops = per_gpu * w.flops_per_token / 1e12
    peak = g.bf16_tflops  # MFU is always against the dense bf16 peak, as the trainer reports it
    run = (
        _time_to_train(w, layout, st, eff, bench, converge, n.nvlink_domain, cl, event) if bench and mlperf_run else {}
    )
    return Prediction(
        **base,
        feasible=not reasons,
        reasons=reasons,
        step_time_s=st.step_time_s,
        tokens_per_s_per_gpu=per_gpu,
        model_tflops_per_gpu=tflops,
        mfu=tflops / peak,
        mfu_peak_tflops=peak,
        memory_gib_per_gpu=mem.total / 2**30,
        memory=mem.gib(),
        steps=run.get("steps"),
        evals=run.get("evals"),
        eval_time_s=run.get("eval_time_s"),
        train_time_s=run.get("train_time_s"),
        time_to_train_min=run.get("time_to_train_min"),
        breakdown=st.breakdown,
        ttt_breakdown=run.get("ttt_breakdown", {}),
        warmup_s=run.get("warmup_s"),
        phases_min=run.get("phases_min", {}),
        one_off_s=run.get("one_off_s"),
        eval_first_s=run.get("eval_first_s"),
        healing_step=(layout.fp4_healing_step or 0) if layout.fp4 else 0,
        step_time_post_switch_s=run.get("step_time_post_switch_s"),
        eval_time_post_switch_s=run.get("eval_time_post_switch_s"),
        steps_post_switch=run.get("steps_post_switch"),
        evals_post_switch=run.get("evals_post_switch"),
    )


def _time_to_train(
    w: Workload,
    layout: ClusterLayout,
    st: StepResult,
    eff: Efficiency,
    bench: str,
    converge: float | None,
    nvlink_domain: int,
    cl: Cluster,
    event: bool,
) -> dict:
    """The MLPerf run of benchmark `bench` at step `st`, as Prediction fields: steps and evaluations to converge,
    seconds per evaluation, training and warm-up seconds, minutes to train and their breakdown by step term and
    by phase. An FP4 layout that gets past its healing step runs the steps and evaluations after it at the FP8
    layout's step and evaluation times (`mlperf.healing_split`)."""
    conv = expected_convergence(bench, layout.gbs, converge)
    steps, evals = conv.steps, conv.evals
    ev_s = eval_time(w, layout, st.forward_rank_s, conv.eval_tokens, eff, nvlink_domain)
    heal = (layout.fp4_healing_step or 0) if layout.fp4 else 0
    split = mlperf.healing_split(
        steps, evals, heal, mlperf.eval_interval_steps(bench, layout.gbs), mlperf.skipped_evals(bench, layout.gbs)
    )
    out: dict = {}
    train_s = split.steps_fp4 * st.step_time_s
    # The first evaluation builds its data loader and graphs: the release's extra seconds, once.
    evals_s = split.evals_fp4 * ev_s + (eff.eval_first_extra_s if evals > 0 else 0.0)
    parts = {k: split.steps_fp4 * v / 60 for k, v in st.breakdown.items()}
    extra = eff.pause_s * pauses(bench, steps)  # the recipe's pauses and, below, the precision switch
    if split.steps_fp8 > 0:
        fp8 = replace(layout, fp4=False)
        post = step_time(w, fp8, cl, eff, event=event)
        ev8 = eval_time(w, fp8, post.forward_rank_s, conv.eval_tokens, eff, nvlink_domain)
        train_s += split.steps_fp8 * post.step_time_s
        evals_s += split.evals_fp8 * ev8
        extra += eff.switch_s  # re-quantising and rebuilding the FP8 graphs, once
        for k, v in post.breakdown.items():
            parts[k] = parts.get(k, 0.0) + split.steps_fp8 * v / 60
        out = {
            "step_time_post_switch_s": post.step_time_s,
            "eval_time_post_switch_s": ev8,
            "steps_post_switch": split.steps_fp8,
            "evals_post_switch": split.evals_fp8,
        }
    warm = warmup_s(layout, st.step_time_s, eff) + extra
    parts["evaluation"] = evals_s / 60
    parts["warmup"] = warm / 60
    return {
        "steps": steps,
        "evals": evals,
        "eval_time_s": ev_s,
        "eval_first_s": ev_s + eff.eval_first_extra_s,
        "train_time_s": train_s,
        "time_to_train_min": (warm + train_s + evals_s) / 60,
        "ttt_breakdown": parts,
        "warmup_s": warm,
        "one_off_s": eff.one_off_s + extra,
        "phases_min": {"warmup": warm / 60, "steps": train_s / 60, "evaluations": evals_s / 60},
        **out,
    }


def _layout_dict(layout: ClusterLayout, w: Workload) -> dict:
    d = asdict(layout)
    if not d["shard_group"]:
        del d["shard_group"]  # the default (ZeRO over all of dp·cp); only HSDP layouts from a trainer config set it
    if not d["fp4"]:
        del d["fp4"], d["fp4_healing_step"]  # only FP4 layouts carry them, so other predictions print what they did
    if not d["fp8_attention"]:
        del d["fp8_attention"]  # likewise: only layouts with FP8 attention carry it
    if d["ep"] == 1 and d["moe_imbalance"] == 1.0:
        del d["ep"], d["moe_imbalance"]  # likewise: only MoE layouts carry them
    if d["pp_first_layers"] < 0 and d["pp_last_layers"] < 0 and not d["pp_stage_layers"]:
        del d["pp_first_layers"], d["pp_last_layers"], d["pp_stage_layers"]  # likewise: only uneven splits
    else:
        d["pp_stage_layers"] = list(d["pp_stage_layers"])
        d["chunk_layers"] = [list(row) for row in layout.chunks(w) or ()]
    if d["free_stage_outputs"]:
        del d["free_stage_outputs"]  # likewise: only layouts keeping stage outputs to backward (the trainer's)
    d["dp"] = layout.dp
    d["microbatches"] = layout.microbatches if layout.dp > 0 and layout.mbs > 0 else 0
    d["schedule"] = layout.pipeline_schedule
    return d
