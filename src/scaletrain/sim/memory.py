"""Memory per GPU: weights, gradients, optimizer state and activations on the most loaded pipeline rank.

Formulas are docs/perf-model.md "Memory" (mixed-precision Adam bytes/parameter) and Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2 (16-bit activations). Assumptions:
- Flash attention everywhere: the 5·a·s/h attention-score term (softmax, its dropout mask, dropout output) is never
  stored, and its per-row log-sum-exp (4·a·s·b bytes, ~0.1% of a layer) is ignored. Selective recomputation, which
  exists to drop exactly that term, therefore stores the same as none.
- FP8 (Transformer Engine) saves a 1-byte copy of each GEMM input for the weight gradient instead of the 16-bit one;
  the attention output is the exception: flash keeps it in 16-bit for its own backward, so the projection's FP8 copy
  is extra. Q, K, V stay 16-bit (no FP8 attention). Weights stay at the bf16 bytes of docs/perf-model.md "Memory",
  except a LoRA's frozen base, which NeMo's MLPerf LoRA keeps as FP8 parameters (1 byte).
- The optimizer is sharded over d = dp·cp (Megatron's distributed optimizer spans the data- and context-parallel
  ranks, which hold identical weights).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from scaletrain.sim import schedule
from scaletrain.sim.workload import ClusterLayout, Workload

GIB = 2**30
"""Bytes in a GiB (what allocators and nvidia-smi report)."""
GB = 1e9
"""Bytes in a vendor GB (how HBM sizes are quoted: an "80 GB" H100 holds 74.5 GiB)."""

BF16_BYTES = 2
"""Bytes of a 16-bit activation element."""

LOGIT_BYTES = 6
"""Per logit on the last stage: the fp32 softmax the vocab-parallel loss keeps for backward (4) plus the bf16 logits
it was cast from, alive beside it at the loss (2)."""


def bytes_per_param(zero: int, d: int, bf16_grads: bool = False) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per trained parameter for a ZeRO mode, as docs/perf-model.md gives them.

    `bf16_grads`: the distributed optimizer's gradient buffer in bf16 (MLPerf gpt3's bf16 gradient reduction).
    """
    if zero == 0:
        return 2.0, 2.0, 12.0  # "16 bytes/parameter unsharded (2 weights, 2 grads, 12 optimizer)"
    if zero == 1:
        return 2.0, 2.0 if bf16_grads else 4.0, 12.0 / d  # "6 + 12/d": bf16 params, fp32 grads, sharded Adam
    if zero == 2:  # "2 + (4 + 12)/d": bf16 params whole for the step, fp32 grads and Adam sharded
        return 2.0, (2.0 if bf16_grads else 4.0) / d, 12.0 / d
    return 2.0 / d, 2.0 / d, 12.0 / d  # ZeRO-3: "(4+12)/d"


def _layer_terms(w: Workload, layout: ClusterLayout, dropout: bool) -> tuple[float, float]:
    """Bytes per token of one layer as (replicated, sharded): the first group is hidden-wide tensors TP leaves whole
    (only SP splits them), the second what TP splits by t. GPT-3, 16-bit, with dropout: 10·h and 24·h, i.e. 34·h.

    Korthikanti's 34·sbh: attention 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1; the 5as²b
    of scores is gone with flash), MLP 19 (fc1 input 2, GELU input 8, GELU output 8, dropout mask 1), two LayerNorm
    inputs 4. Generalised: K and V are kv_heads·head_dim wide (GQA), and SwiGLU keeps gate and up (2·ffn, needed for
    its backward) plus its output, the fc2 input (ffn); an unfused eager SwiGLU would also keep silu(gate).
    """
    return w.inventory.saved_per_token(layout.tp, layout.fp8, dropout)


def activation_bytes_per_layer(w: Workload, layout: ClusterLayout, dropout: bool = True) -> float:
    """Activation bytes one transformer layer keeps for one micro-batch on one GPU (Korthikanti Table 2, flash).

    TP+SP: 34·s·b·h/t for GPT-3; TP without SP: s·b·h·(10 + 24/t); full recomputation: only the layer input,
    2·s·b·h (÷t with SP). Context parallelism divides s by cp. `dropout` keeps the two hidden dropout masks
    (2·s·b·h) that Korthikanti's 34 includes; it defaults on to reproduce that figure, though neither MLPerf model
    uses dropout (memory_per_gpu defaults it off).
    Under LoRA the frozen GEMMs keep no inputs (they need only input gradients); the adapters keep theirs.
    """
    s, b, t = w.seq_len / layout.cp, layout.mbs, layout.tp
    sp_div = t if layout.sp else 1  # SP splits the sequence dimension of what TP leaves whole
    if layout.recompute == "full":
        return 2.0 * s * b * w.shape.hidden / sp_div
    rep, shard = _layer_terms(w, layout, dropout)
    return s * b * (rep / sp_div + shard / t)


def in_flight_microbatches(layout: ClusterLayout, rank: int = 0) -> float:
    """Micro-batches of a pipeline rank's activations held at its peak (rank 0 is the most loaded).

    GPipe: all m. 1F1B: min(p − rank, m). Interleaved 1F1B: Megatron's warm-up of (p − rank − 1)·2 + (v − 1)·p
    chunk-micro-batches plus one in steady state, capped at m·v, each chunk 1/v of the rank's layers, hence ÷v.
    This is the peak count of the rank's op order (`schedule.op_order`); `held_activations` walks that order with
    each chunk's own bytes, and equals this count times the rank's blocks where its chunks hold equal blocks.
    """
    p, v, m = layout.pp, layout.vp, layout.microbatches
    kind = layout.pipeline_schedule
    if kind == "gpipe":
        return float(m)
    if kind == "interleaved_1f1b":
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    return float(min(p - rank, m))


def stage_io_bytes(w: Workload, layout: ClusterLayout) -> float:
    """Bytes of one stage's output (= the next stage's input) for one micro-batch on one GPU: s/c·b·h in bf16, ÷t
    with SP (Megatron and torch's pipelining send the sequence-parallel shard each TP rank holds)."""
    sp_div = layout.tp if layout.sp else 1
    return BF16_BYTES * (w.seq_len / layout.cp) * layout.mbs * w.shape.hidden / sp_div


def _chunk_holds(w: Workload, layout: ClusterLayout, rank: int, dropout: bool) -> tuple[list[float], list[float]]:
    """Per chunk of pipeline rank `rank`: (layer activations, other bytes) that one in-flight micro-batch of that
    chunk holds until its backward.

    Layer activations: the chunk's own blocks (`ClusterLayout.chunks`; a rank's blocks split evenly over its chunks
    where the layout names no split). The stage input needs no term of its own: the first block's norm saves it
    (it is in the layer activations), and a 0-block first chunk's input is the token ids. Other: the embedding's
    dropout mask on the first chunk of rank 0 (1 byte a hidden element, with `dropout`), and, where the layout does
    not free stage outputs after their send (`free_stage_outputs`), the chunk's output tensor, for every chunk but the
    model's last (its output goes to the final norm and head on the same rank, counted there).
    """
    p, v = layout.pp, layout.vp
    per_layer = activation_bytes_per_layer(w, layout, dropout)
    table = layout.chunks(w)
    blocks = list(table[rank]) if table else [layout.rank_blocks(w)[rank] / v] * v
    act = [b * per_layer for b in blocks]
    other = [0.0] * v
    if rank == 0 and dropout:  # the embedding's dropout mask: 1 byte an element
        other[0] += (w.seq_len / layout.cp) * layout.mbs * w.shape.hidden / (layout.tp if layout.sp else 1)
    if not layout.free_stage_outputs and p > 1:
        for c in range(v):
            if not (rank == p - 1 and c == v - 1):
                other[c] += stage_io_bytes(w, layout)
    return act, other


def held_activations(w: Workload, layout: ClusterLayout, rank: int = 0, dropout: bool = False) -> tuple[float, float]:
    """(layer activations, other) bytes pipeline rank `rank` holds at its peak, walking its op order.

    Each forward of a (micro-batch, chunk) adds what that chunk keeps for backward (`_chunk_holds`: its own blocks,
    so a chunk with fewer blocks holds less), each backward frees it; the peak of the sum over the rank's order
    (`schedule.op_order`, the order the event simulation runs) is the rank's. Where every chunk holds the same, the
    peak is `in_flight_microbatches` times the rank's bytes (the walk finds the same; a test asserts it).
    """
    act, other = _chunk_holds(w, layout, rank, dropout)
    if all(a == act[0] for a in act) and all(o == other[0] for o in other):
        n = in_flight_microbatches(layout, rank)
        table = layout.chunks(w)
        blocks = sum(table[rank]) if table else layout.rank_blocks(w)[rank]
        per_layer = activation_bytes_per_layer(w, layout, dropout)
        return blocks * per_layer * n, other[0] * layout.vp * n
    return walk_peak(layout, rank, act, other)


def walk_peak(layout: ClusterLayout, rank: int, act: list[float], other: list[float]) -> tuple[float, float]:
    """(layer activations, other) at the peak of their sum over rank `rank`'s op order, given what one in-flight
    micro-batch of each chunk holds (`act[c]`, `other[c]`)."""
    order = schedule.op_order(layout.pipeline_schedule, layout.pp, layout.microbatches, layout.vp, rank)
    frees = schedule.W if layout.pipeline_schedule == "zb_h1" else True  # the op after which nothing is held
    a = o = 0.0
    best = (0.0, 0.0)
    for kind, c, _ in order:
        if kind == frees:
            a, o = a - act[c], o - other[c]
        elif not kind:
            a, o = a + act[c], o + other[c]
            if a + o > best[0] + best[1]:
                best = (a, o)
    return best


@dataclass
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline rank."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    """Layer activations the rank holds at its peak (`held_activations`: each in-flight (micro-batch, chunk) with its
    chunk's own blocks), + one layer's working set under full recomputation."""
    other: float
    """Outside the layers: embedding dropout masks on the first stage, stage outputs kept for backward where they are
    not freed after send (`free_stage_outputs`), final norm, head input and logits on the last."""
    total: float
    in_flight: float
    """Micro-batches in flight at the rank's peak: the schedule's peak count of (micro-batch, chunk) forwards awaiting
    their backward, ÷ v (`in_flight_microbatches`)."""

    def gib(self) -> dict:
        """Every field in GiB (2**30 bytes) rounded to 0.01; `in_flight` (a count) only rounded."""
        return {f.name: round(getattr(self, f.name) / (1 if f.name == "in_flight" else GIB), 2) for f in fields(self)}


def rank_params(w: Workload, layout: ClusterLayout, first: bool, last: bool) -> int:
    """Base parameters one TP rank of the first and/or last pipeline stage holds before ZeRO sharding (from the
    inventory: biases, norms and embeddings included); what the dry run reads off the real sharded model."""
    return w.inventory.rank_params(layout.tp, _blocks(w, layout, first, last), first, last, layout.ep)


def _blocks(w: Workload, layout: ClusterLayout, first: bool, last: bool) -> int:
    """Transformer blocks of the first or last pipeline rank (the most any rank holds when neither)."""
    per_rank = layout.rank_blocks(w)
    if first or last:
        return max(per_rank[0] if first else 0, per_rank[-1] if last else 0)
    return max(per_rank)


def local_params(w: Workload, layout: ClusterLayout, first: bool, last: bool) -> float:
    """Parameters one GPU of the first and/or last stage keeps between steps: `rank_params` plus LoRA adapters
    (spread evenly over TP, as the memory model counts them), divided over the ZeRO-3 shards (fractional where the
    real FSDP pads uneven shards)."""
    n = rank_params(w, layout, first, last) + _adapter_params(w, layout)
    return n / layout.zero_shards if layout.zero == 3 else float(n)


def _adapter_params(w: Workload, layout: ClusterLayout) -> float:
    if not w.shape.lora:
        return 0.0
    layers = w.shape.layers
    return w.inventory.trainable_params * max(layout.rank_blocks(w)) / layers / layout.tp


def _rank_memory(w: Workload, layout: ClusterLayout, rank: int, in_flight: float | None, dropout: bool):
    first, last = rank == 0, rank == layout.pp - 1
    t, zero = layout.tp, layout.zero
    d = layout.zero_shards
    layers = _blocks(w, layout, first, last)
    wb, gb, ob = bytes_per_param(zero, d, layout.bf16_grads)
    if w.shape.lora:
        # Frozen base: weights only (FP8 parameters for the layers under FP8, bf16 embedding), sharded over d by ZeRO-3.
        layer_params = w.inventory.rank_params(t, layers, False, False)
        outer = w.inventory.rank_params(t, 0, first, last)
        weights = (layer_params * (1 if layout.fp8 else 2) + 2 * outer) / (d if zero == 3 else 1)
        adapters = _adapter_params(w, layout)  # adapters spread evenly over the layers
        weights, grads, optimizer = weights + adapters * wb, adapters * gb, adapters * ob
    else:
        n = rank_params(w, layout, first, last)
        weights, grads, optimizer = n * wb, n * gb, n * ob
        experts = w.inventory.expert_rank_params(layers, layout.ep)
        if experts and zero >= 1:
            # Routed experts shard their state over the ranks holding the same experts, not over d.
            ewb, egb, eob = bytes_per_param(zero, layout.expert_dp, layout.bf16_grads)
            weights += experts * (ewb - wb)
            grads += experts * (egb - gb)
            optimizer += experts * (eob - ob)
    # One layer's matrices on this rank (its routed experts: this rank's share).
    layer_rank = (
        w.inventory.layer_matrix_params
        - w.inventory.expert_rank_params(1, 1)
        + w.inventory.expert_rank_params(1, layout.ep)
    )
    if zero == 3:
        unit = 2.0 * layer_rank / t  # one layer's bf16 weights, all-gathered for use
        weights += 2 * unit  # the layer being computed plus the one prefetched
        grads += 0 if w.shape.lora else unit  # one layer's full gradients before their reduce-scatter
    if zero == 2 and not w.shape.lora:
        # One layer's unsharded gradients in the reduce dtype (fp32, as Llama 3 reduce-scatters, unless bf16
        # gradients), alive from the layer's backward to its reduce-scatter: one layer at a time, as ZeRO-3 above.
        grads += (BF16_BYTES if layout.bf16_grads else 4) * layer_rank / t

    count = in_flight_microbatches(layout, rank)
    act, other = held_activations(w, layout, rank, dropout)
    if in_flight is not None and in_flight != count and count > 0:  # a what-if count: scale what the schedule holds
        act, other = act * in_flight / count, other * in_flight / count
        count = in_flight
    if layout.recompute == "full":  # backward re-runs one layer's forward: its full activations live meanwhile
        act += activation_bytes_per_layer(w, replace(layout, recompute="none"), dropout)

    s, b, h = w.seq_len / layout.cp, layout.mbs, w.shape.hidden
    sp_div = t if layout.sp else 1
    if last:
        # The loss's backward follows its forward at once on the last stage, except under GPipe (all m wait).
        n_head = layout.microbatches if layout.pipeline_schedule == "gpipe" else 1
        v = w.shape.vocab
        other += n_head * s * b * (2 * h / sp_div + 2 * h / sp_div + LOGIT_BYTES * v / t)  # norm, head input
    total = weights + grads + optimizer + act + other
    return MemoryEstimate(weights, grads, optimizer, act, other, total, count)


def memory_per_gpu(
    w: Workload, layout: ClusterLayout, in_flight: float | None = None, dropout: bool = False
) -> MemoryEstimate:
    """Peak memory per GPU on the most loaded pipeline rank (one rank when pp = 1).

    With even chunks that is the first stage (embedding, most micro-batches in flight) or the last (output layer and
    logits): a middle rank holds the same blocks with fewer in flight. With uneven chunks a middle rank can hold more
    (llama31_405b's 126 blocks in pp8 x vp8: 16 blocks on ranks 1-6, 15 on the ends), so the middle ranks are
    examined too.
    `in_flight` is a what-if count for the first stage (`stage_memory`); the other ranks keep the schedule's.
    `dropout` (hidden dropout masks) defaults off, as in both MLPerf models.
    """
    ranks = {0, layout.pp - 1}
    table = layout.chunks(w)
    if table is not None and len({x for row in table for x in row}) > 1:
        # Each middle rank runs the same forward and backward sequence after a warm-up that shrinks with the rank,
        # so of the middle ranks holding the same chunks the first holds a superset at every point: one suffices.
        first_of: dict[tuple[int, ...], int] = {}
        for r in range(1, layout.pp - 1):
            first_of.setdefault(table[r], r)
        ranks |= set(first_of.values())
    return max((stage_memory(w, layout, r, in_flight, dropout) for r in sorted(ranks)), key=lambda e: e.total)


def stage_memory(
    w: Workload, layout: ClusterLayout, pp_rank: int, in_flight: float | None = None, dropout: bool = False
) -> MemoryEstimate:
    """Peak memory of one GPU of pipeline rank `pp_rank` (the first holds the embedding, the last the output layer).

    `in_flight` (first stage only; other ranks keep the schedule's) is a what-if count: the activations the schedule
    holds there (`held_activations`) scaled by it over the schedule's own count, which therefore changes nothing.
    """
    return _rank_memory(w, layout, pp_rank, in_flight if pp_rank == 0 else None, dropout)


def usable_bytes(hbm_gb: float, reserve_gib: float = 5.0, fragmentation: float = 0.03) -> float:
    """The largest estimate that fits `hbm_gb` vendor GB of HBM (see `fits`)."""
    return (hbm_gb * GB - reserve_gib * GIB) / (1 + fragmentation)


def fits(est: MemoryEstimate, hbm_gb: float, reserve_gib: float = 5.0, fragmentation: float = 0.03) -> bool:
    """Whether `est` fits in `hbm_gb` vendor GB (1e9 bytes) of HBM.

    Usable = HBM − `reserve_gib`: CUDA context and kernel images (~0.5–1 GiB), cuBLAS/cuDNN/TE workspaces, NCCL
    buffers for the TP, PP, DP and CP communicators and TP-overlap userbuffers (~2–3 GiB together), small persistent
    framework buffers. The caching allocator's fragmentation then costs `fragmentation` of what is allocated.
    """
    return est.total <= usable_bytes(hbm_gb, reserve_gib, fragmentation)


__all__ = [
    "MemoryEstimate",
    "memory_per_gpu",
    "stage_memory",
    "rank_params",
    "local_params",
    "usable_bytes",
    "fits",
    "activation_bytes_per_layer",
    "in_flight_microbatches",
    "held_activations",
    "walk_peak",
    "stage_io_bytes",
    "bytes_per_param",
    "GIB",
    "GB",
]
