"""Layout search: the fastest parallel layouts of a workload on a given number of GPUs.

Enumerate (tp, pp, vp, cp, mbs, gbs, fp8), reject cheaply (divisibility via `ClusterLayout.problems`, then memory with
the closed-form in-flight count), bound each survivor's closed-form step time from per-micro-batch stage costs (cached
per shape), price them in bound order with `step_time(event=False)` (0.05-0.5 ms each) until the bound alone loses to
the K-th best price, then event-simulate the best few with `predict` and rank those. What does not depend on the
layout (catalog entry, efficiency set, cluster, convergence per GBS) is resolved once. gpt3 on 512 to 100,000 GPUs:
< 0.5 s.
"""

from __future__ import annotations

import heapq
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from scaletrain.sim import memory, mlperf
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import efficiency_for
from scaletrain.sim.predict import ExpectedRun, Prediction, benchmark_of, eval_time, expected_convergence, predict
from scaletrain.sim.step import stage_costs, step_time
from scaletrain.sim.workload import ClusterLayout, Workload, chunk_layers, with_recipe

MBS = (1, 2, 4)
# CP is searched at every sequence length: at 2048 tokens it is slower than DP, but when the GBS cap bounds DP
# (gpt3's largest RCP batch is 8192 sequences) it is the only way to occupy very large clusters (100,000 GPUs).
CP = (1, 2, 4, 8)
# Increasing memory savings at increasing cost: selective stores what "none" does under flash attention (see
# `memory`) yet recomputes attention, so the first level that fits is the only one worth pricing.
RECOMPUTE = ("none", "selective", "full")
MAX_VP = 16
DEFAULT_GBS = 1024
"""Sequences per step for workloads that are not MLPerf benchmarks when no `gbs` is given."""
RESIMULATE = 3
"""Event-simulate RESIMULATE * top of the best closed-form candidates (the closed form is within ~1% of them)."""


@dataclass
class PlanResult:
    """The best layouts found and what the search looked at."""

    best: list[Prediction]
    """Top-k feasible predictions (event-simulated), best first."""
    searched: int
    """Candidate layouts considered (tp, pp, vp, cp, mbs, gbs, fp8 combinations)."""
    feasible: int
    """Candidates that divide the model and GPUs and fit in memory with some recompute/ZeRO choice."""
    seconds: float
    """Wall time of the search."""
    objective: str = "ttt"
    """"ttt" (MLPerf time-to-train minutes, lower is better) or "throughput" (tokens/s/GPU, higher is better)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Most common rejection reasons (numbers folded to N) -> candidates rejected for it, most common first."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _depths(layers: int) -> list[int]:
    """Pipeline depths with some split of the blocks (`workload.chunk_layers`): divisors of the blocks, and of the
    blocks + 2 (the embedding and the loss counted as blocks: 126 -> pp 8)."""
    return sorted(set(_divisors(layers)) | {d for d in _divisors(layers + 2) if chunk_layers(layers, d, 1)})


def _eps(w: Workload, stage_ranks: int) -> list[int]:
    """Expert-parallel degrees to try: 1 for a dense model, else the powers of two dividing both the experts and the
    ranks of a pipeline stage."""
    experts = w.shape.experts
    if not experts:
        return [1]
    return [e for e in (2**i for i in range(0, 20)) if e <= experts and not experts % e and not stage_ranks % e]


def _pipelines(layers: int, split: tuple = (-1, -1, ())) -> list[tuple[int, list[int]]]:
    """(pp, the vp values) of the pipelines with a split of the blocks: `_depths` by the default rule; with an
    uneven `split` (first, last, per-stage list as in `chunk_layers`), only the pipelined ones (pp >= 2) it splits."""
    if split[0] < 0 and split[1] < 0 and not split[2]:
        # vp only means something with a pipeline (pp = 1 runs plain 1F1B whatever vp says).
        return [
            (pp, [1] if pp == 1 else [v for v in range(1, MAX_VP + 1) if chunk_layers(layers, pp, v)])
            for pp in _depths(layers)
        ]
    # pp*vp <= layers + 2: only the two end stages may hold no block.
    pipes = [
        (pp, [v for v in range(1, MAX_VP + 1) if chunk_layers(layers, pp, v, *split)]) for pp in range(2, layers + 3)
    ]
    return [(pp, vps) for pp, vps in pipes if vps]


def _shapes(w: Workload, gpus: int, domain: int, split: tuple = (-1, -1, ())):
    """(tp, pp, vp, cp, ep) with tp*pp*cp dividing `gpus`; TP stays inside one NVLink domain (and at most 16); ep
    (MoE models) divides the experts and the gpus/pp ranks of a stage; (pp, vp) split the blocks (`_pipelines`)."""
    pipes = _pipelines(w.shape.layers, split)
    for tp in _divisors(w.shape.heads):
        if tp > min(domain, 16) or gpus % tp:
            continue
        for cp in CP:
            for pp, vps in pipes:
                if gpus % (tp * cp * pp):
                    continue
                for vp in vps:
                    for ep in _eps(w, gpus // pp):
                        yield tp, pp, vp, cp, ep


def _batches(unit: int, pp: int, vp: int, lo: int, hi: int) -> list[int]:
    """Global batches in [lo, hi] a layout with dp*mbs = `unit` can run: near lo, near hi, and near the powers of
    two (and 1.5x them) in between, each rounded up to a valid multiple (m >= pp, and m % pp == 0 interleaved)."""
    step = unit * (pp if pp > 1 and vp > 1 else 1)
    targets = {lo, hi} | {t for i in range(1, 40) for t in (2**i, 3 * 2 ** (i - 1)) if lo <= t <= hi}
    out = set()
    for t in targets:
        b = max(-(-t // step), -(-pp * unit // step)) * step
        if b <= hi:
            out.add(b)
    return sorted(out)


def _fitting(w: Workload, lay: ClusterLayout, hbm_gb: float, as_trained: bool = False) -> tuple[list, float]:
    """The memory variants of `lay` worth pricing, and the smallest memory seen (bytes).

    With ZeRO-1 the cheapest recompute level that fits. ZeRO-3 only when ZeRO-1 needs recomputation or does not fit
    at all: with the same recomputation it saves memory only by adding parameter gathers (so not even for small
    models, which fit under ZeRO-1 anyway). And only without a pipeline: Megatron's pipeline does not run with
    ZeRO-3, and `step` prices its gathers once per step, whereas a stage re-gathers for each micro-batch.
    `as_trained`: ZeRO-3 only, at every pipeline depth, as scaletrain's FSDP2 (over dp·cp) runs it."""
    out, least = [], float("inf")
    for zero in (3,) if as_trained else (1, 3) if lay.pp == 1 else (1,):
        for rc in RECOMPUTE:
            var = replace(lay, zero=zero, recompute=rc)
            est = memory.memory_per_gpu(w, var)
            least = min(least, est.total)
            if memory.fits(est, hbm_gb):
                out.append(var)
                break
        if out and out[0].recompute == "none":
            break
    return out, least


def _bound(w: Workload, lay: ClusterLayout, cl: Cluster, eff, cache: dict) -> tuple[float, float]:
    """(lower bound of the closed-form step seconds, forward seconds of the busiest rank) of `lay`.

    The closed form is the busiest rank's work (layers with their exposed TP/CP communication, embedding, logits)
    times m, plus (p-1) mean chunks of bubble, plus non-negative terms (p2p, DP, optimizer) and the fixed overhead;
    the bound drops the non-negative terms. Everything but m is cached per shape, since it is per micro-batch.
    """
    key = (lay.tp, lay.pp, lay.vp, lay.cp, lay.ep, lay.mbs, lay.fp8, lay.recompute)
    if key not in cache:
        fwd, bwd, _ = stage_costs(w, lay, cl, eff)
        work = [sum(fw) + sum(bw) for fw, bw in zip(fwd, bwd)]
        cache[key] = (max(work), sum(work) / (lay.pp * lay.vp), max(sum(fw) for fw in fwd))
    busiest, chunk, fwd_s = cache[key]
    return lay.microbatches * busiest + (lay.pp - 1) * chunk + eff.step_overhead_s, fwd_s


def _tiebreak(lay: ClusterLayout) -> tuple:
    """Stable order among equal scores: fewer GPUs per model replica, then smaller tp, pp, vp, cp, mbs, gbs."""
    return (
        lay.tp * lay.pp * lay.cp,
        lay.tp,
        lay.pp,
        lay.vp,
        lay.cp,
        lay.mbs,
        lay.gbs,
        RECOMPUTE.index(lay.recompute),
        lay.zero,
        not lay.fp8,
    )


def _value(p: Prediction, objective: str) -> float:
    """Lower is better."""
    if objective == "ttt":
        assert p.time_to_train_min is not None, "ttt is the objective of benchmark workloads only"
        return p.time_to_train_min
    return -p.tokens_per_s_per_gpu


def plan(
    w: Workload,
    gpu: str,
    gpus: int,
    node: str | None = None,
    fabric: str | None = None,
    calibration: str | None = None,
    top: int = 5,
    gbs: int | None = None,
    fp8: bool | None = None,
    objective: str = "auto",
    catalog=None,
    fp4: bool = False,
    as_trained: bool = False,
    moe_imbalance: float = 1.0,
    fp8_attention: bool | None = None,
    fp4_healing_step: int | None = None,
    mlperf_run: bool = True,
    pp_first_layers: int = -1,
    pp_last_layers: int = -1,
    pp_stage_layers: tuple[int, ...] = (),
) -> PlanResult:
    """The `top` best layouts of `w` on `gpus` GPUs of kind `gpu` (node and fabric as in `predict`).

    `objective`: "ttt" (MLPerf time-to-train; the "auto" choice for benchmark workloads), "throughput" (tokens/s
    per GPU; "auto" otherwise). `gbs` fixes the global batch; otherwise benchmark workloads search batches inside
    the RCP table's range and others use DEFAULT_GBS. `fp8` fixes the precision; otherwise both are tried where the
    GPU has FP8. `fp4` searches only FP4 layouts (FP4 GEMMs on the FP8 recipe). `as_trained` prices what `scaletrain
    train` runs instead of Megatron's recipe: FSDP2 (ZeRO-3 over dp·cp) at every pipeline depth, gradients reduced in
    fp32 (also under FP8), stage outputs kept to the backward, no FP4. `fp8_attention` runs the FP8 layouts' attention in FP8 (False: bf16; None: the
    benchmark recipe's); `fp4_healing_step` is the FP4 layouts' precision switch (None: the benchmark recipe's), which
    the final prices of the best layouts include (`predict`) and the search's ranking does not. `mlperf_run=False`
    (a pretraining run to a token budget) prices the best layouts' steps without a benchmark run (`predict`); it
    needs the throughput objective. `pp_first_layers`, `pp_last_layers`, `pp_stage_layers` (`ClusterLayout`'s uneven
    split) restrict the search to the pipelined layouts whose pp x vp stages they split, each priced with that split.
    ValueError for an impossible request (ttt on a non-benchmark, FP8 on a GPU without it, ...).
    """
    start = time.perf_counter()
    if gpus < 1 or top < 1:
        raise ValueError(f"gpus ({gpus}) and top ({top}) must be >= 1")
    cat = catalog or load_catalog()
    g, n, f = cat.system(gpu, node, fabric)
    release, eff = efficiency_for(calibration, g.key, benchmark_of(w.name), cat)
    bench = benchmark_of(w.name)
    objective = _objective(objective, bench, w.name)
    if not mlperf_run and objective == "ttt":
        raise ValueError("a layout search without the MLPerf run ranks by throughput: objective='throughput'")
    precisions = _precisions(g, fp8, fp4, as_trained)
    if fp8_attention and True not in precisions:
        raise ValueError(f"FP8 attention needs FP8 layouts, and none is searched on {g.key}")
    lo, hi = _batch_range(bench if mlperf_run else None, gbs)  # a token budget is no MLPerf run: any batch
    split = (pp_first_layers, pp_last_layers, tuple(pp_stage_layers))
    uneven = pp_first_layers >= 0 or pp_last_layers >= 0 or bool(pp_stage_layers)
    if uneven and not _pipelines(w.shape.layers, split):
        raise ValueError(
            f"the uneven pipeline split (first {pp_first_layers}, last {pp_last_layers} blocks, stages "
            f"{list(pp_stage_layers) or '-'}) fits no pp x vp (vp <= {MAX_VP}) of {w.name}'s {w.shape.layers} blocks"
        )
    search = _Search(
        w,
        gpus,
        n.nvlink_domain,
        g.hbm_gb,
        gbs,
        bench,
        lo,
        hi,
        precisions,
        fp4,
        as_trained,
        moe_imbalance,
        fp8_attention=fp8_attention,
        fp4_healing_step=fp4_healing_step,
        split=split,
    )
    cl = Cluster(g, n, f, gpus)
    runs: dict[int, ExpectedRun] = {}  # gbs -> expected steps and evaluations

    def score(lay: ClusterLayout, step_s: float, fwd_s: float) -> float:
        """The objective (lower is better) of `lay` at `step_s` seconds per step, `fwd_s` forward per micro-batch."""
        if objective == "throughput":
            return -lay.gbs * w.seq_len / step_s / gpus
        assert bench is not None, "objective ttt was refused above for a non-benchmark"
        run = runs.get(lay.gbs) or runs.setdefault(lay.gbs, expected_convergence(bench, lay.gbs))
        return (run.steps * step_s + run.evals * eval_time(w, lay, fwd_s, run.eval_tokens, eff, n.nvlink_domain)) / 60

    cost_cache: dict[tuple, tuple] = {}
    found = search.candidates(lambda var: score(var, *_bound(w, var, cl, eff, cost_cache)))

    def closed_form(var: ClusterLayout) -> float:
        st = step_time(w, var, cl, eff, event=False)
        return score(var, st.step_time_s, st.forward_rank_s)

    scored = _branch_and_bound(found.bounds, RESIMULATE * top, closed_form)
    best = _event_best(
        scored,
        top,
        lambda lay: predict(
            w, lay, g.key, n.key, f.key, calibration=release, eff=eff, catalog=cat, event=True, mlperf_run=mlperf_run
        ),
        objective,
    )
    rejected = found.rejected
    if uneven and not found.searched:
        pps = sorted({pp for pp, _ in _pipelines(w.shape.layers, split)})
        rejected[f"the pipeline depths the uneven split fits (pp {pps}) divide no layout of the {gpus} GPUs"] = 1
    if "memory" in rejected:
        rejected[
            f"does not fit in memory even with full recomputation (the leanest rejected needs "
            f"{found.least_mem / memory.GIB:.0f} GiB per GPU; {g.key} has {g.hbm_gb:.0f} GB)"
        ] = rejected.pop("memory")
    return PlanResult(
        best=best,
        searched=found.searched,
        feasible=found.feasible,
        seconds=time.perf_counter() - start,
        objective=objective,
        rejected=dict(rejected.most_common(5)),
    )


def _objective(objective: str, bench: str | None, model: str) -> str:
    """The objective "auto" resolves to (ttt for a benchmark, else throughput); ValueError for an impossible one."""
    if objective == "auto":
        objective = "ttt" if bench else "throughput"
    if objective not in ("ttt", "throughput"):
        raise ValueError(f"objective {objective!r} must be auto, ttt or throughput")
    if objective == "ttt" and not bench:
        raise ValueError(f"{model} is not an MLPerf benchmark: no time-to-train; use objective='throughput'")
    return objective


def _precisions(g, fp8: bool | None, fp4: bool, as_trained: bool) -> tuple[bool, ...]:
    """The fp8 flags to search on GPU `g`: the one asked for, else both where it has FP8 tensor cores; ValueError
    for a precision the GPU or the trainer lacks."""
    if fp8 and g.fp8_tflops <= 0:
        raise ValueError(f"{g.key} has no FP8 tensor cores")
    precisions = (fp8,) if fp8 is not None else ((True, False) if g.fp8_tflops > 0 else (False,))
    if fp4:
        if as_trained:
            raise ValueError("the trainer has no FP4 recipe: --fp4 and --as-trained exclude each other")
        if g.fp4_tflops <= 0:
            raise ValueError(f"{g.key} has no FP4 tensor cores")
        precisions = (True,)
    return precisions


def _batch_range(bench: str | None, gbs: int | None) -> tuple[int, int]:
    """The RCP table's global-batch range of benchmark `bench` ((0, 0) for another model); ValueError for a `gbs`
    above it."""
    if not bench:
        return 0, 0
    sizes = sorted(mlperf.rcp_records(bench))
    if gbs and gbs > sizes[-1]:
        raise ValueError(f"gbs {gbs} is above the largest {bench} RCP batch size {sizes[-1]}")
    return sizes[0], sizes[-1]


@dataclass
class _Found:
    """What the enumeration found: (bound, tiebreak, layout) per memory-feasible variant, and the counts."""

    bounds: list = field(default_factory=list)
    searched: int = 0
    feasible: int = 0
    least_mem: float = float("inf")
    """Bytes per GPU of the leanest layout rejected for memory."""
    rejected: Counter[str] = field(default_factory=Counter)


@dataclass
class _Search:
    """The layouts to enumerate: shapes by the workload and the NVLink domain, batches by the RCP table."""

    w: Workload
    gpus: int
    domain: int
    hbm_gb: float
    gbs: int | None
    bench: str | None
    lo: int
    """The smallest and largest global batch of the RCP table (benchmarks only)."""
    hi: int
    precisions: tuple
    fp4: bool
    as_trained: bool
    moe_imbalance: float
    fp8_attention: bool | None = None
    """FP8 attention on the FP8 layouts (None: the benchmark recipe's, `with_recipe`)."""
    fp4_healing_step: int | None = None
    """The FP4 layouts' healing step (None: the benchmark recipe's)."""
    split: tuple = (-1, -1, ())
    """(pp_first_layers, pp_last_layers, pp_stage_layers) of every pipelined layout; the default split when unset."""

    def candidates(self, bound) -> _Found:
        """Every (tp, pp, vp, cp, ep, mbs, gbs, precision) layout that divides and fits in memory, each variant with
        `bound(layout)`, the objective's lower bound; with counts of what was searched and why layouts failed."""
        w, gpus, lo, hi = self.w, self.gpus, self.lo, self.hi
        found = _Found()
        fit_cache: dict[tuple, tuple] = {}
        for tp, pp, vp, cp, ep in _shapes(w, gpus, self.domain, self.split):
            for mbs in MBS:
                unit = gpus // (tp * pp * cp) * mbs
                batches = [self.gbs] if self.gbs else _batches(unit, pp, vp, lo, hi) if self.bench else [DEFAULT_GBS]
                if not batches:
                    found.searched += 1
                    found.rejected[f"no global batch in {lo}..{hi} is a multiple of dp*mbs (x pp micro-batches)"] += 1
                for b in batches:
                    for prec in self.precisions:
                        found.searched += 1
                        # FP8 runs follow NVIDIA's MLPerf recipes, which reduce gradients in bf16 (as `calibrate`
                        # does); the trainer reduces them in fp32.
                        lay = ClusterLayout(
                            gpus=gpus,
                            tp=tp,
                            pp=pp,
                            vp=vp,
                            cp=cp,
                            mbs=mbs,
                            gbs=b,
                            fp8=prec,
                            bf16_grads=prec and not self.as_trained,
                            fp4=self.fp4,
                            fp8_attention=None if self.fp8_attention is None else self.fp8_attention and prec,
                            fp4_healing_step=self.fp4_healing_step,
                            ep=ep,
                            moe_imbalance=self.moe_imbalance,
                            pp_first_layers=self.split[0],
                            pp_last_layers=self.split[1],
                            pp_stage_layers=self.split[2],
                            # torch's pipeline stages keep their outputs to the backward (parallel/sim_layout.py)
                            free_stage_outputs=not self.as_trained,
                        )
                        lay = with_recipe(lay, self.bench)
                        problems = lay.problems(w)
                        if problems:
                            found.rejected[re.sub(r"\d+", "N", problems[0])] += 1
                            continue
                        # Memory sees the GBS only through the in-flight count, which stops growing at m = 2*pp.
                        key = (tp, pp, vp, cp, ep, mbs, prec, min(lay.microbatches, 2 * pp))
                        if key not in fit_cache:
                            fit_cache[key] = _fitting(w, lay, self.hbm_gb, self.as_trained)
                        variants, least = fit_cache[key]
                        if not variants:
                            found.least_mem = min(found.least_mem, least)
                            found.rejected["memory"] += 1
                            continue
                        found.feasible += 1
                        for var in variants:
                            var = replace(var, gbs=b)
                            found.bounds.append((bound(var), _tiebreak(var), var))
        return found


def _branch_and_bound(bounds: list, keep: int, price) -> list[tuple]:
    """(price, tiebreak, layout) of the candidates priced in order of their bound, until the bound alone loses to
    the `keep`-th best price; sorted best first."""
    bounds.sort(key=lambda c: c[:2])
    worst: list[float] = []  # max-heap (negated) of the `keep` best prices so far
    scored = []
    for lb, tie, var in bounds:
        if len(worst) >= keep and lb > -worst[0]:
            break
        p = price(var)
        scored.append((p, tie, var))
        heapq.heappush(worst, -p)
        if len(worst) > keep:
            heapq.heappop(worst)
    scored.sort(key=lambda s: s[:2])
    return scored


def _event_best(scored: list[tuple], top: int, predict_one, objective: str) -> list[Prediction]:
    """The `top` best feasible predictions of the closed-form best, re-priced by event simulation; it goes past
    RESIMULATE*top if the exact in-flight count makes some of them overflow memory, so `top` feasible plans come
    back whenever the closed form found them."""
    best: list[tuple] = []
    for i, (_, tie, lay) in enumerate(scored):
        if i >= RESIMULATE * top and len(best) >= top or i >= 10 * top:
            break
        p = predict_one(lay)
        if p.feasible:
            best.append((_value(p, objective), tie, p))
    best.sort(key=lambda b: b[:2])
    return [p for _, _, p in best[:top]]


__all__ = ["plan", "PlanResult", "DEFAULT_GBS"]
