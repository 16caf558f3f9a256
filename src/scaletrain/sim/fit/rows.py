"""Published results as simulator inputs: each row's catalog system, layout and fitted set, and its predicted run
minutes priced fast enough to be refitted hundreds of times (`calibrate.fit`, `validate` leave-one-out).

A row's run time is one-off + steps x step + evaluations x evaluation (+ the first evaluation's extra; `predict`), and
each calibration row carries the terms its public logs measured (`terms.MeasuredTerms`), which the fit matches term
by term. Only the "core" of the step
(compute, exposed TP/CP/DP communication, pipeline bubble, optimizer) needs the step model; it depends on four
`Efficiency` scalars (gemm_eff, tp_exposed, dp_overlap, overlap_slowdown) and is cached per system and layout,
keyed on the scalars the row's layout actually uses (tp_exposed only with TP, the DP ones only with DP traffic).
The fixed costs (`fixed_costs`) and the evaluation are arithmetic on top, so fitting them costs no step model call.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from scaletrain.sim import mlperf
from scaletrain.sim.catalog import Catalog, CatalogError, default_catalog, load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency, pauses
from scaletrain.sim.fit.results import PublishedResult
from scaletrain.sim.fit.terms import MeasuredTerms, bundled_terms
from scaletrain.sim.fixed_costs import comm_init_units, domains, expected_max_normal
from scaletrain.sim.predict import eval_passes, expected_convergence
from scaletrain.sim.step import StepResult, step_time
from scaletrain.sim.workload import ClusterLayout, load_workload


def host_network(interconnect: str) -> str:
    """The scale-out part of a results row's interconnect text: what follows "host:" up to the next "|" (v5 rows:
    "NVLINK Gen5 1800 GB/s | host: 8x ConnectX-7 IB NDR 400Gb/s | topo: ..."), else the text without its NVLink /
    Infinity Fabric segments (older rows: "8x400Gb/s IB NDR"). Where storage, compute and management networks are
    listed, the compute one."""
    text = interconnect.lower()
    if "host:" in text:
        host = text.split("host:", 1)[1].split("|", 1)[0]
        if "compute:" in host:  # "Storage: ..., Compute: 8x ConnectX-7 IB NDR, Management: 100Gb/s Ethernet"
            host = re.split(r"management:|storage:", host.split("compute:", 1)[1])[0]
        return host
    scale_up = ("nvlink", "nvswitch", "xgmi", "infinity fabric")
    return " | ".join(p for p in text.split("|") if not any(k in p for k in scale_up) and "topo:" not in p)


def row_system(row: PublishedResult, cat: Catalog | None = None) -> tuple[str, str]:
    """(node, fabric) catalog keys for a published row, read from its system and interconnect text.

    The node is the GPU's platform (`Catalog.node_for_system`: a cloud node type whose patterns the system text
    matches, else the GPU's default node); the fabric is read from the host network ("" = the node's default): XDR,
    HDR or other InfiniBand, else RoCE/Ethernet.
    """
    cat = cat or default_catalog()
    node = cat.node_for_system(cat.gpu(row.gpu), f"{row.submitter} {row.system}").key
    host = host_network(row.interconnect)
    if "xdr" in host or re.search(r"\b800 ?gb", host):
        fabric = "ib-xdr"
    elif "hdr" in host and "ndr" not in host:
        fabric = "ib-hdr"
    elif "ndr" in host or "infiniband" in host or re.search(r"\bib\b", host):
        fabric = "ib-ndr"
    elif "roce" in host or "ethernet" in host or "spectrum" in host or "slingshot" in host:
        fabric = "roce"
    else:
        fabric = ""
    return node, fabric


def fp8_attention(row: PublishedResult, generation: str) -> bool:
    """Whether a published row ran attention in FP8 (FP8_DPA=1). Every NeMo 25.x llama2_70b_lora config of v5.0 and
    v5.1 on Blackwell sets it (config_common.sh, which every FP4 config sources too), and so do the Hopper configs
    without context parallelism (TP2/TP4 CP1: HPE, Krai, Oracle, Supermicro, ASUSTeK, Dell); every Hopper CP2 config
    sets FP8_DPA=0, as do AMD's and MangoBoost's (mlcommons/training_results_v5.0 and v5.1,
    <submitter>/benchmarks/llama2_70b_lora/implementations/*/config_*.sh, followed through what they source). No
    other benchmark's published config sets it, and v4.x LoRA configs did not."""
    if row.benchmark != "llama2_70b_lora" or not row.fp8 or row.round < "v5.0":
        return False
    return generation == "blackwell" or (generation == "hopper" and row.cp == 1)


def row_layout(row: PublishedResult) -> ClusterLayout:
    """The simulator layout of a published row.

    FP8 rows are NVIDIA's MLPerf recipes, which reduce gradients in bf16 (docs/perf-model.md: "a distributed optimizer
    with bf16 gradient reduction"); FP4 rows run the FP8 recipe with FP4 GEMMs.
    """
    return ClusterLayout(
        gpus=row.gpus,
        tp=row.tp,
        pp=row.pp,
        vp=row.vp,
        cp=row.cp,
        mbs=row.mbs,
        gbs=row.gbs,
        sp=row.tp > 1,
        fp8=row.fp8,
        fp4=row.fp4,
        bf16_grads=row.fp8,
    )


ROUND_EVAL_EVERY = {("llama31_405b", "v5.0"): 46_080}
"""Sequences between evaluations where a round's rules differ from the benchmark's current cadence: the v5.0
llama31_405b rules evaluated every 46,080 samples (its runs stopped at 276,480 = 6 x 46,080 at GBS 1152 and at
276,864 = 6 x 103 steps of 448 at GBS 448), 18,432 from v5.1 on."""


def _published_run(bench: str, gbs: int, converge: int, round_: str = "") -> mlperf.Convergence:
    """Steps and evaluations of a published run that stopped after `converge` tokens/samples.

    The count is where the run stopped, so a count of whole steps is taken as it is, even where the submission's
    evaluation cadence differs from the rules' ceil(384 / GBS) steps (v5.0 evaluated GBS 9 every 42 steps, not 43).
    Its evaluations follow its round's cadence (`ROUND_EVAL_EVERY`).
    """
    conv = mlperf.convergence(bench, gbs, converge)
    b = mlperf.bench(bench)
    per_step = gbs * (b.seq_len if b.converge_unit == "tokens" else 1)
    if converge % per_step == 0 and converge // per_step < conv.steps:
        conv = replace(conv, steps=converge // per_step, train_sequences=converge // per_step * gbs)
    every = ROUND_EVAL_EVERY.get((bench, round_))
    if every:
        interval = -(-every // gbs)
        conv = replace(conv, eval_interval_steps=interval, evals=-(-conv.steps // interval) - b.skipped_evals(gbs))
    return conv


_NO_FIXED = {"step_overhead_s": 0.0, "sync_log2_s": 0.0, "fabric_sync_s": 0.0, "straggler_cv": 0.0}
_CORE_CACHE: dict[tuple, tuple[float, float, float]] = {}
_CORE_CACHE_MAX = 400_000


class _Row:
    """A row with everything precomputed that does not depend on the efficiencies."""

    def __init__(self, row: PublishedResult, cat: Catalog, terms: MeasuredTerms | None = None):
        self.row = row
        self.terms = terms
        """What the row's public logs measured (None for a results row without decomposed logs)."""
        self.bench = row.benchmark
        self.w = load_workload(mlperf.bench(row.benchmark).reference_preset)
        self.layout = row_layout(row)
        problems = self.layout.problems(self.w)
        if problems:
            raise ValueError("layout " + "; ".join(problems))
        node, fabric = row_system(row, cat)
        g, n, f = cat.system(row.gpu, node, fabric or None)
        # FP4 rows switch to FP8 where their logs show it (not every config that sets HEALING_ITER does: terms
        # README); without logs, at the recipe's step.
        heal = (terms.switch_step if terms else mlperf.bench(row.benchmark).fp4_healing_step) if row.fp4 else 0
        self.layout = replace(self.layout, fp8_attention=fp8_attention(row, g.generation), fp4_healing_step=heal)
        self.cluster = Cluster(g, n, f, row.gpus)
        self.set = f"{row.round}/{g.generation}"  # the fitted set the row belongs to
        # A generation's reference SKU is its set; only the others get a fitted gemm_eff multiplier (`calibrate.fit`).
        self.reference_sku = cat.is_reference(g)
        # A run that did not converge (no count, inf minutes) is the olympic mean's dropped slowest on both sides.
        self.runs = [_published_run(self.bench, row.gbs, c, row.round) for c in row.run_converge if c > 0]
        self.failed = sum(1 for c in row.run_converge if c <= 0)
        self.rcp = expected_convergence(self.bench, row.gbs)
        self.ratio = 1.0
        lay = self.layout
        # Inside one NVLink domain the scale-out fabric carries nothing: such rows share their cached steps.
        fab = f.key if row.gpus > n.nvlink_domain else ""
        self._key = (
            g.key, n.key, fab, row.gpus, lay.tp, lay.pp, lay.vp, lay.cp, lay.mbs, lay.gbs, lay.fp8, lay.fp4,
            lay.fp8_attention,
        )  # fmt: skip
        self._uses_tp = lay.tp > 1
        self._uses_dp = lay.dp * lay.cp > 1
        self._comm_units = comm_init_units(lay)
        self._max_n = expected_max_normal(row.gpus)
        self._log2d = math.log2(domains(row.gpus, n.nvlink_domain))
        self._crosses = 1.0 if domains(row.gpus, n.nvlink_domain) > 1 else 0.0
        # One evaluation's forward passes = this factor x the busiest rank's forward time (predict.eval_time).
        self._eval_passes = eval_passes(self.w, lay, mlperf.bench(self.bench).eval_tokens)
        self._rank_layers = max(lay.rank_blocks(self.w))  # the busiest rank's blocks, as predict.eval_forward_s
        self._obs = row.olympic_minutes
        self._log_obs = math.log(self._obs)
        # A run's minutes grow with its steps and evaluations, which grow together, so the olympic mean always drops
        # the runs with the fewest and the most steps (a failed run is the most): it is the run-time formula at the
        # mean steps and evaluations of the others.
        ordered: list[tuple[float, float]] = sorted((float(c.steps), float(c.evals)) for c in self.runs)
        self.median_steps = ordered[len(ordered) // 2][0] if ordered else 0.0
        """Steps of the row's median converged run."""
        ordered += [(math.inf, math.inf)] * self.failed
        kept = ordered[1:-1] if len(ordered) >= 3 else []
        self._mid = (
            (sum(k[0] for k in kept) / len(kept), sum(k[1] for k in kept) / len(kept)) if kept else (math.nan, math.nan)
        )
        self._post: _Row | None = None
        if heal:
            # The same row after the healing step: FP8 GEMMs (its own cache key, its own event ratio).
            self._post = _Row.__new__(_Row)
            self._post.__dict__.update(self.__dict__)
            self._post.layout = replace(self.layout, fp4=False, fp4_healing_step=0)
            self._post._key = (*self._key[:11], False, self.layout.fp8_attention)
            self._post._post = None

    def step(self, eff: Efficiency, event: bool) -> StepResult:
        """The full step model (breakdown and all) at `eff`."""
        return step_time(self.w, self.layout, self.cluster, eff, event=event)

    def core(self, eff: Efficiency, event: bool) -> tuple[float, float, float]:
        """(step seconds without the fixed per-step terms, pipeline makespan, busiest forward seconds), cached."""
        key = (
            self._key,
            event,
            eff.gemm_eff,
            eff.fp4_eff if self.layout.fp4 else 1.0,
            eff.tp_exposed if self._uses_tp else 0.0,
            (eff.dp_overlap, eff.overlap_slowdown) if self._uses_dp else (),
        )
        hit = _CORE_CACHE.get(key)
        if hit is None:
            if len(_CORE_CACHE) > _CORE_CACHE_MAX:
                _CORE_CACHE.clear()
            st = self.step(replace(eff, **_NO_FIXED), event)
            hit = _CORE_CACHE[key] = (st.step_time_s, st.details["makespan_s"], st.forward_rank_s)
        return hit

    def timing(self, eff: Efficiency, event: bool = False) -> tuple[float, float, float]:
        """(step, evaluation, one-off) seconds at `eff` (`fixed_costs.warmup_s`: the release's one-off plus any
        warm-up step-times and communicator creation a set prices); the closed form is scaled by the row's event
        ratio."""
        core, makespan, fwd = self.core(eff, event)
        scale = 1.0 if event else self.ratio
        step = (
            core * scale
            + eff.step_overhead_s
            + eff.sync_log2_s * self._log2d
            + eff.fabric_sync_s * self._crosses
            + eff.straggler_cv * self._max_n * makespan * scale
        )
        ev = self._eval_passes * max(fwd / eff.eval_eff, self._rank_layers * eff.eval_host_layer_s)
        ev += eff.eval_fixed_s + eff.sync_log2_s * self._log2d + eff.fabric_sync_s * self._crosses
        warm = eff.one_off_s + eff.warmup_steps * step + eff.comm_init_s * self._comm_units
        return step, ev, warm

    def minutes(self, eff: Efficiency, conv, event: bool = False, st=None) -> float:
        """Minutes of one run that stops after `conv` (an mlperf.Convergence or predict.ExpectedRun)."""
        step, ev, warm = st or self.timing(eff, event)
        first = eff.eval_first_extra_s if conv.evals > 0 else 0.0
        pause = eff.pause_s * pauses(self.bench, conv.steps)
        steps, evals, post = self._split(eff, conv.steps, conv.evals, event)
        return (warm + pause + steps * step + evals * ev + post + first) / 60

    def _split(self, eff: Efficiency, steps: float, evals: float, event: bool) -> tuple[float, float, float]:
        """(FP4 steps, FP4 evaluations, seconds after the healing step including the switch) of a run; all of it
        FP4-or-other and 0 s without a switch."""
        heal = self.layout.fp4_healing_step or 0
        if self._post is None or steps <= heal:
            return steps, evals, 0.0
        b = mlperf.bench(self.bench)
        split = mlperf.healing_split(
            steps, evals, heal, mlperf.eval_interval_steps(self.bench, self.row.gbs), b.skipped_evals(self.row.gbs)
        )
        step8, ev8, _ = self._post.timing(eff, event)
        return split.steps_fp4, split.evals_fp4, split.steps_fp8 * step8 + split.evals_fp8 * ev8 + eff.switch_s

    def run_minutes(self, eff: Efficiency, event: bool = False) -> list[float]:
        """Predicted minutes of each published run (inf for a run that did not converge)."""
        t = self.timing(eff, event)
        return [self.minutes(eff, c, event, t) for c in self.runs] + [math.inf] * self.failed

    def log_error(self, eff: Efficiency) -> float:
        """log(predicted / published) of the olympic mean of the runs (closed form scaled by the event ratio)."""
        step, ev, warm = self.timing(eff)
        steps, evals = self._mid
        pause = eff.pause_s * pauses(self.bench, steps)
        steps, evals, post = self._split(eff, steps, evals, False)
        return math.log((warm + pause + steps * step + evals * ev + post + eff.eval_first_extra_s) / 60) - self._log_obs

    def one_off_s(self, eff: Efficiency) -> float:
        """Predicted one-off seconds of the row's median run: the release's one-off plus its recipe's pauses and its
        precision switch."""
        switch = (
            eff.switch_s if self._post is not None and self.median_steps > (self.layout.fp4_healing_step or 0) else 0
        )
        return self.timing(eff, True)[2] + eff.pause_s * pauses(self.bench, self.median_steps) + switch

    def step_sq_error(self, eff: Efficiency) -> float:
        """Squared log(predicted / measured) of the steady step (closed form scaled by the event ratio), plus the
        steady step after a precision switch where the logs measured one; the run minutes' for a row without
        measured terms."""
        if self.terms is None:
            return self.log_error(eff) ** 2
        err = math.log(self.timing(eff)[0] / self.terms.step_s) ** 2
        if self._post is not None and self.terms.step_post_switch_s > 0:
            err += math.log(self._post.timing(eff)[0] / self.terms.step_post_switch_s) ** 2
        return err

    def eval_forward_s(self, eff: Efficiency, event: bool = True) -> float:
        """The part of one evaluation that is forward passes and synchronisation (what `eval_fixed_s` comes on
        top of)."""
        _, ev, _ = self.timing(eff, event)
        return ev - eff.eval_fixed_s

    def refresh_ratio(self, eff: Efficiency) -> None:
        """Event-simulation / closed-form ratio of the core step at `eff` (and of the post-switch row's)."""
        self.ratio = self.core(eff, True)[0] / self.core(eff, False)[0]
        if self._post is not None:
            self._post.refresh_ratio(eff)


def prepare(
    rows: list[PublishedResult], cat: Catalog | None = None, terms: dict | None = None
) -> tuple[list[_Row], list[tuple[PublishedResult, str]]]:
    """Rows ready to fit or score, each with its measured terms where the shipped logs have them (`bundled_terms`),
    and (row, reason) for rows the simulator cannot take. `terms` replaces the shipped terms ({} = none: every row is
    fitted on its run minutes)."""
    cat = cat or load_catalog()
    terms = bundled_terms() if terms is None else terms
    ready, bad = [], []
    for row in rows:
        try:
            ready.append(_Row(row, cat, terms.get((row.benchmark, row.round, row.system, row.gpus))))
        except (ValueError, CatalogError, KeyError) as exc:
            bad.append((row, str(exc)))
    return ready, bad
