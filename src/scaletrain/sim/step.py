"""One training step on a cluster: compute per stage, exposed TP/CP communication, the pipeline schedule,
DP gradient/parameter traffic with its overlap windows, the optimizer, a constant host overhead and the
synchronisation over all ranks (`fixed_costs`).

The step is priced bottom-up: `compute` gives layer times on one GPU, `comm` the collectives for the group
placements Megatron's rank order produces (tp fastest, then cp, dp, pp), `schedule` runs the pipeline as an
event simulation with uneven first/last stages, and the DP reduce-scatter of each model chunk is queued from
the moment that chunk's last backward ends (the parameter all-gather of the next step must land before the
chunk's first forward). Only the `Efficiency` scalars are fitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scaletrain.sim import compute, schedule
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fixed_costs import domains, step_sync_s
from scaletrain.sim.workload import ClusterLayout, Workload

BF16 = 2
# Optimizer step bytes per locally-owned parameter: read fp32 master, two moments and the gradient, write the
# three back and a bf16 copy (memory-bound).
_OPT_BYTES = 4 * 4 + 3 * 4 + BF16


@dataclass
class StepResult:
    """Seconds per training step and where they go (the breakdown sums to step_time_s)."""

    step_time_s: float
    breakdown: dict = field(default_factory=dict)
    """compute, tp_exposed, cp_exposed, ep_exposed (MoE all-to-all), pp_bubble, dp_exposed, overlap_slowdown, optimizer, overhead (constant host
    work), sync (tree synchronisation over all ranks), straggler (waiting for the slowest rank)."""
    forward_rank_s: float = 0.0
    """Forward time of one micro-batch through the busiest rank's layers (evaluation uses it)."""
    in_flight: float = 0.0
    """Peak in-flight micro-batches on the most loaded rank (for the memory model)."""
    details: dict = field(default_factory=dict)


def _layer_params_rank(w: Workload, t: int, ep: int = 1) -> float:
    """Base weights of one (mean) layer on one rank: the dense part split by TP, the routed experts by EP. (Expert
    gradients reduce over the tp·cp·dp/ep ranks holding the same experts; the DP model prices them over dp·cp, the
    same bytes per rank over a group of the same or larger span.)"""
    experts = w.inventory.expert_rank_params(1, 1)
    return (w.inventory.layer_matrix_params - experts) / t + experts / max(ep, 1)


def _trainable_per_layer(w: Workload, t: int, ep: int = 1) -> float:
    """Trainable parameters of one layer held by one TP (and EP) rank."""
    if w.shape.lora:
        return (w.inventory.trainable_params / w.shape.layers) / t
    return _layer_params_rank(w, t, ep)


def _tp_comm(w: Workload, layout: ClusterLayout, cl: Cluster) -> float:
    """TP seconds per layer per micro-batch, one direction (forward; backward moves the same)."""
    t = layout.tp
    if t == 1:
        return 0.0
    size = layout.mbs * (w.seq_len // layout.cp) * w.shape.hidden * BF16
    if layout.sp:
        return 2 * (cl.collective("all_gather", t, size) + cl.collective("reduce_scatter", t, size))
    return 2 * cl.collective("all_reduce", t, size)


def _cp_hop(w: Workload, layout: ClusterLayout, cl: Cluster) -> float:
    """Seconds of one ring step of context parallelism: this rank's K and V chunk (seq/cp tokens, its TP share of the
    K/V heads) sent to the next CP rank (Transformer Engine's p2p ring), over NVLink when the CP group (stride tp)
    stays in one NVLink domain."""
    c = layout.cp
    if c == 1:
        return 0.0
    kv_heads = max(1, w.shape.kv_heads // layout.tp)
    kv = 2 * layout.mbs * (w.seq_len // c) * kv_heads * w.shape.head_dim * BF16
    return cl.p2p(kv, same_domain=layout.tp * c <= cl.node.nvlink_domain)


EP_STRIDE = 1
"""Rank distance between consecutive members of an expert-parallel group. Megatron-Core builds expert groups with
their own rank generator (`expert_decoder_rank_generator`: tp = expert tensor parallel size, cp = 1, order
tp-cp-ep-dp-pp, "MoE parallel folding"), so an EP group's stride is the expert tensor-parallel degree, 1 here
(whole experts), and the group folds over the tp and cp ranks of the attention layers; this trainer's expert mesh
does the same (parallel/layout.py: ep innermost over dp_shard x cp x tp). An EP group of ep ranks therefore stays in
one NVLink domain when ep <= the domain's GPUs, whatever tp and cp are."""


def _a2a_comm(w: Workload, layout: ClusterLayout, cl: Cluster) -> float:
    """All-to-all seconds per layer per micro-batch forward (dispatch plus combine; backward moves the same), averaged
    over the layers (the leading dense ones have none). Each rank sends its sequence shard's tokens, top-k copies of
    each: FP8 to dispatch under an FP8 recipe, bf16 back. The busiest expert rank receives moe_imbalance times the
    mean, which sets the time. The group's placement (`EP_STRIDE`) decides which share crosses the fabric
    (`Cluster.all_to_all`)."""
    if not w.shape.experts or layout.ep <= 1:
        return 0.0
    tokens = layout.mbs * w.seq_len // layout.cp // layout.tp
    routed = tokens * w.shape.top_k * w.shape.hidden * layout.moe_imbalance
    dispatch = cl.collective("all_to_all", layout.ep, routed * (1 if layout.fp8 else BF16), stride=EP_STRIDE)
    combine = cl.collective("all_to_all", layout.ep, routed * BF16, stride=EP_STRIDE)
    return (dispatch + combine) * compute.moe_share(w)


def stage_costs(w: Workload, layout: ClusterLayout, cl: Cluster, eff: Efficiency):
    """Per (rank, chunk) forward/backward seconds of one micro-batch, plus the pieces for the breakdown."""
    p, v = layout.pp, layout.vp
    # Uneven splits (126 blocks in 64 chunks): each chunk is priced with its own blocks, so the event simulation's
    # slowest stage sets the step.
    blocks = layout.chunks(w) or [[w.shape.layers // (p * v)] * v for _ in range(p)]
    lt = compute.layer_times(w, layout, cl.gpu, eff.gemm_eff, eff.fp4_eff)
    # TP collectives overlap with the GEMMs around them (Transformer Engine's comm-GEMM overlap): at most the fraction
    # 1 - tp_exposed of them hides, and never more than the GEMM time they run under, so small GEMMs (short
    # sequences, deep TP, LoRA's backward without weight gradients) expose more.
    comm = _tp_comm(w, layout, cl)
    tp_f = comm - min((1 - eff.tp_exposed) * comm, lt.gemm_fwd)
    tp_b = comm - min((1 - eff.tp_exposed) * comm, lt.gemm_bwd)
    tp = (tp_f + tp_b) / 2
    # The ring's cp - 1 exchanges each run under one block of attention (attn_fwd / cp); what a hop takes beyond its
    # block is exposed. Backward sends K/V again and their gradients back: twice the bytes under 2.5x the block.
    hop, block = _cp_hop(w, layout, cl), lt.attn_fwd / layout.cp
    cp_f = (layout.cp - 1) * max(0.0, hop - block)
    cp_b = (layout.cp - 1) * max(0.0, 2 * hop - 2.5 * block)
    recompute_tp = tp_f if layout.recompute == "full" else 0.0
    a2a = _a2a_comm(w, layout, cl) * eff.a2a_exposed
    recompute_a2a = a2a if layout.recompute == "full" else 0.0
    f_layer = lt.fwd + tp_f + cp_f + a2a
    b_layer = lt.bwd + tp_b + recompute_tp + cp_b + a2a + recompute_a2a
    fwd = [[blocks[r][c] * f_layer for c in range(v)] for r in range(p)]
    bwd = [[blocks[r][c] * b_layer for c in range(v)] for r in range(p)]
    emb_f, emb_b = compute.embedding_times(w, layout, cl.gpu)
    log_f, log_b = compute.logits_times(w, layout, cl.gpu, eff.gemm_eff)
    fwd[0][0] += emb_f
    bwd[0][0] += emb_b
    fwd[p - 1][v - 1] += log_f
    bwd[p - 1][v - 1] += log_b
    # Per micro-batch on the rank with the most blocks (all its v chunks).
    most = max(sum(row) for row in blocks)
    exposed = {"tp": most * (2 * tp + recompute_tp), "cp": most * (cp_f + cp_b), "ep": most * (2 * a2a + recompute_a2a)}
    return fwd, bwd, exposed


def wgrad_costs(w: Workload, layout: ClusterLayout, cl: Cluster, eff: Efficiency) -> list[list[float]]:
    """Per (rank, chunk) seconds of one micro-batch's weight-gradient GEMMs: the part of `stage_costs`' backward a
    zero-bubble schedule (zb_h1) runs as its own deferred op (a trained linear layer's backward is two GEMMs of its
    forward's size, the input and the weight gradient; attention and elementwise work are input-gradient only)."""
    blocks = layout.chunks(w) or [[w.shape.layers // (layout.pp * layout.vp)] * layout.vp for _ in range(layout.pp)]
    per_layer = compute.layer_times(w, layout, cl.gpu, eff.gemm_eff, eff.fp4_eff).gemm_wgrad
    return [[n * per_layer for n in row] for row in blocks]


# Megatron's DP buckets: at least 40M parameters (1M x dp on large groups), never finer than a layer.
_BUCKET_PARAMS = 40e6


def _dp_buckets(
    w: Workload, layout: ClusterLayout, cl: Cluster, rank: int, chunk: int
) -> tuple[list[float], list[float]]:
    """(reduce-scatter, all-gather) seconds of the DP buckets of one chunk on one rank, in backward order.

    Gradients are reduced in `layout.bf16_grads` precision (all-reduced when zero = 0); parameters are gathered in
    bf16 (twice under ZeRO-3: for forward and again for backward). These are one micro-batch's buckets under ZeRO-2,
    which reduce-scatters every micro-batch's gradients (`_dp_timing` queues them m times) and gathers once. The input embedding belongs to rank 0 chunk 0
    (its grads come last in backward), the output head to the last rank's last chunk (its grads come first).
    """
    n = layout.dp * layout.cp
    t, p, v = layout.tp, layout.pp, layout.vp
    table = layout.chunks(w)
    layers = table[rank][chunk] if table else w.shape.layers // (p * v)
    params = _trainable_per_layer(w, t, layout.ep) * layers
    # ZeRO-3 shards and gathers every weight, frozen ones included (a LoRA base gathers its FP8/bf16 weights).
    gathered = (_layer_params_rank(w, t, layout.ep) * layers) if layout.zero == 3 else params
    weight_bytes = 1 if (layout.zero == 3 and w.shape.lora and layout.fp8) else BF16
    nb = max(1, min(layers, math.ceil(max(params, gathered) / max(_BUCKET_PARAMS, 1e6 * n))))
    sizes, gsizes = [params / nb] * nb, [gathered / nb] * nb
    if not w.shape.lora:
        vocab = w.shape.vocab * w.shape.hidden / t
        if rank == p - 1 and chunk == v - 1:
            sizes[0] += vocab
            gsizes[0] += vocab
        if rank == 0 and chunk == 0:
            sizes[-1] += vocab
            gsizes[-1] += vocab
    grad_bytes = BF16 if layout.bf16_grads else 4
    if layout.zero == 0:
        return [cl.collective("all_reduce", n, x * grad_bytes, stride=t) for x in sizes], [0.0] * nb
    gathers = 2 if layout.zero == 3 else 1
    return (
        [cl.collective("reduce_scatter", n, x * grad_bytes, stride=t) for x in sizes],
        [gathers * cl.collective("all_gather", n, x * weight_bytes, stride=t) for x in gsizes],
    )


def _dp_timing(w, layout, cl, eff, ranks, fwd, bwd, lbe, ffs, makespan, bend=None) -> tuple[float, float]:
    """(exposed seconds, hidden seconds) of DP traffic, worst rank.

    Each bucket's reduce-scatter is released when the last micro-batch's backward has produced its gradients and
    runs on one communication queue; what ends after the pipeline drains is exposed. ZeRO-2 keeps only a shard of
    the gradients, so every micro-batch's backward releases its buckets (`bend[r][c][j]`: when micro-batch j's
    backward of chunk c ends on rank r), and those of the early micro-batches run under the later ones' compute. Parameter all-gathers queue
    from the step start and a bucket's layers cannot start their first forward before it lands. Overlapped
    communication runs at `dp_overlap` of its bandwidth (it shares SMs and HBM with the compute under it).
    """
    if layout.dp * layout.cp == 1:
        return 0.0, 0.0
    scale = 1.0 / max(eff.dp_overlap, 1e-3)
    if layout.zero == 3:
        # Fully sharded: every micro-batch gathers the parameters for forward and again for backward and
        # reduce-scatters its gradients, so the traffic spreads over the whole step; only what exceeds the
        # step, plus the first bucket's gather, is exposed.
        m = layout.microbatches
        worst = 0.0
        first = 0.0
        for r in ranks:
            traffic = 0.0
            for c in range(layout.vp):
                rs, ag = _dp_buckets(w, layout, cl, r, c)
                traffic += m * (sum(rs) + sum(ag)) * scale
                if c == 0:
                    first = max(first, ag[-1] / 2 * scale)
            worst = max(worst, traffic)
        exposed = max(0.0, worst - makespan) + first
        return exposed, worst - max(0.0, worst - makespan)
    exposed = hidden = 0.0
    for r in ranks:
        jobs, end, delay, ag_busy, busy = [], 0.0, 0.0, 0.0, 0.0
        done = 0.0
        for c in range(layout.vp):
            rs, ag = _dp_buckets(w, layout, cl, r, c)
            nb = len(rs)
            for end_b in bend[r][c] if layout.zero == 2 else (lbe[r][c],):
                start = end_b - bwd[r][c]
                jobs += [(start + (k + 1) / nb * bwd[r][c], rs[k] * scale) for k in range(nb)]
            for k in range(nb):  # forward needs the buckets in the reverse of backward order
                done += ag[nb - 1 - k] * scale
                delay = max(delay, done - (ffs[r][c] + k / nb * fwd[r][c]))
            ag_busy += sum(ag) * scale
        for release, dur in sorted(jobs):
            end = max(end, release) + dur
            busy += dur
        tail = max(0.0, end - makespan)
        rank_exposed = tail + max(0.0, delay)
        rank_hidden = busy - tail + ag_busy - max(0.0, delay)
        # The step waits for its slowest rank: the one whose exposed plus slowed-down hidden time is largest.
        if rank_exposed + eff.overlap_slowdown * rank_hidden > exposed + eff.overlap_slowdown * hidden:
            exposed, hidden = rank_exposed, rank_hidden
    return exposed, hidden


def step_time(w: Workload, layout: ClusterLayout, cl: Cluster, eff: Efficiency, event: bool = True) -> StepResult:
    """Seconds per step of `w` under `layout` on cluster `cl` with software efficiencies `eff`.

    event=False replaces the pipeline event simulation by its closed form on the busiest rank (what the
    planner uses to rank thousands of layouts before simulating the best).
    """
    if eff.comm_eff != cl.bw_eff:
        cl = replace(cl, bw_eff=eff.comm_eff)
    p, v, m = layout.pp, layout.vp, layout.microbatches
    fwd, bwd, exposed = stage_costs(w, layout, cl, eff)
    t = layout.tp
    # Megatron's scatter/gather p2p: each TP rank sends 1/t of the boundary activation (already sharded under SP).
    act = layout.mbs * (w.seq_len // layout.cp) * w.shape.hidden * BF16 / t
    pp_stride = t * layout.cp * layout.dp
    p2p = cl.p2p(act, same_domain=pp_stride < cl.node.nvlink_domain) if p > 1 else 0.0
    rank_work = [sum(fwd[r]) + sum(bwd[r]) for r in range(p)]
    busiest = max(range(p), key=lambda r: rank_work[r])
    sched = layout.pipeline_schedule
    wgrad = wgrad_costs(w, layout, cl, eff) if sched == "zb_h1" else None
    if event:
        res = schedule.simulate(sched, p, m, v, fwd, bwd, p2p, wgrad=wgrad)
        makespan, lbe, ffs, in_flight, bend = (
            res.makespan,
            res.last_backward_end,
            res.first_forward_start,
            max(res.max_in_flight),
            res.backward_end,
        )
    else:
        mean_chunk = sum(rank_work) / (p * v)
        if wgrad is not None:
            # ZB-H1 fills the bubble with deferred weight gradients: (p-1)(T_F + T_B - T_W) where 1F1B idles
            # (p-1)(T_F + T_B + T_W) (Qi et al. 2023), T_B + T_W being this model's backward.
            mean_chunk -= 2 * sum(sum(row) for row in wgrad) / (p * v)
        makespan = m * rank_work[busiest] + (p - 1) * mean_chunk + (2 * (p * v - 1) * p2p if p > 1 else 0.0)
        # Chunk c's last backward ends roughly (v-1-c)/v of the cooldown before the end; its first forward
        # starts c chunk-forwards into the step.
        lbe = [
            [makespan - (c / v) * (p - 1) * mean_chunk - sum(bwd[r][c2] for c2 in range(c)) for c in range(v)]
            for r in range(p)
        ]
        ffs = [[r * fwd[0][0] + c * p * fwd[r][0] for c in range(v)] for r in range(p)]
        in_flight = min(m, ((p - 1) * 2 + (v - 1) * p + 1) / v if v > 1 else p)
        # In steady state a rank runs one forward and one backward of each chunk per cycle of all its chunks' work,
        # so micro-batch j's backward of chunk c ends m-1-j cycles before the last one.
        # (Built only for ZeRO-2, the one mode that reads it: the planner prices thousands of layouts this way.)
        bend = (
            [[[lbe[r][c] - (m - 1 - j) * rank_work[r] for j in range(m)] for c in range(v)] for r in range(p)]
            if layout.zero == 2
            else []
        )
    dp_exposed, hidden = _dp_timing(w, layout, cl, eff, sorted({0, busiest, p - 1}), fwd, bwd, lbe, ffs, makespan, bend)
    compute_s = sum(fwd[busiest]) * m + sum(bwd[busiest]) * m - (exposed["tp"] + exposed["cp"] + exposed["ep"]) * m
    # The busiest optimizer shard: the first stage's layers plus its embedding (and the head too when pp = 1), or a
    # stage with more layers where the split is uneven.
    # The token table, and the untied output layer when one stage holds both.
    head = w.inventory.head_params if p == 1 else 0
    embed = 0 if w.shape.lora else (w.shape.vocab * w.shape.hidden + head) / t
    per_rank = layout.rank_blocks(w)
    per_layer = _trainable_per_layer(w, t, layout.ep)
    params_local = max(per_layer * per_rank[0] + embed, per_layer * max(per_rank))
    shards = layout.dp * layout.cp if layout.zero >= 1 else 1
    optimizer = params_local / shards * _OPT_BYTES / (cl.gpu.hbm_copy_tbps * 1e12)
    breakdown = {
        "compute": compute_s,
        "tp_exposed": exposed["tp"] * m,
        "cp_exposed": exposed["cp"] * m,
        "pp_bubble": max(0.0, makespan - rank_work[busiest] * m),
        "dp_exposed": dp_exposed,
        "overlap_slowdown": eff.overlap_slowdown * hidden,
        "optimizer": optimizer,
        "overhead": eff.step_overhead_s,
    }
    if w.shape.experts:  # only MoE models carry the key, so dense predictions print what they always did
        breakdown["ep_exposed"] = exposed["ep"] * m
    # Every rank must finish its work before the step's last collectives complete: the slowest of all ranks sets
    # the pace, and the synchronisation itself is a tree over all of them (fixed_costs).
    sync, straggler = step_sync_s(layout.gpus, domains(layout.gpus, cl.node.nvlink_domain), makespan, eff)
    breakdown["sync"] = sync
    breakdown["straggler"] = straggler
    total = sum(breakdown.values())
    return StepResult(
        step_time_s=total,
        breakdown=breakdown,
        forward_rank_s=max(sum(f) for f in fwd),
        in_flight=in_flight,
        details={"p2p_s": p2p, "microbatches": m, "makespan_s": makespan},
    )
