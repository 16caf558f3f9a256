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

from scaletrain.sim.workload import ClusterLayout, Workload

GIB = 2**30
"""Bytes in a GiB (what allocators and nvidia-smi report)."""
GB = 1e9
"""Bytes in a vendor GB (how HBM sizes are quoted: an "80 GB" H100 holds 74.5 GiB)."""

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
    """
    p, v, m = layout.pp, layout.vp, layout.microbatches
    kind = layout.pipeline_schedule
    if kind == "gpipe":
        return float(m)
    if kind == "interleaved_1f1b":
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    return float(min(p - rank, m))


@dataclass
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline rank."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    """Layer activations for `in_flight` micro-batches (+ one layer's working set under full recomputation)."""
    other: float
    """Outside the layers: embedding dropout masks on the first stage, final norm, head input and logits on the last."""
    total: float
    in_flight: float
    """Micro-batches of layer activations held at the peak on that rank."""

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


def _rank_memory(w: Workload, layout: ClusterLayout, first: bool, last: bool, in_flight: float, dropout: bool):
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
    if zero == 3:
        unit = (
            2.0
            * (
                w.inventory.layer_matrix_params
                - w.inventory.expert_rank_params(1, 1)
                + w.inventory.expert_rank_params(1, layout.ep)
            )
            / t
        )
        # one layer's bf16 weights, all-gathered for use (its routed experts: this rank's share)
        weights += 2 * unit  # the layer being computed plus the one prefetched
        grads += 0 if w.shape.lora else unit  # one layer's full gradients before their reduce-scatter

    act = layers * activation_bytes_per_layer(w, layout, dropout) * in_flight
    if layout.recompute == "full":  # backward re-runs one layer's forward: its full activations live meanwhile
        act += activation_bytes_per_layer(w, replace(layout, recompute="none"), dropout)

    s, b, h = w.seq_len / layout.cp, layout.mbs, w.shape.hidden
    sp_div = t if layout.sp else 1
    other = 0.0
    if first and dropout:
        other += s * b * h / sp_div * in_flight  # embedding dropout mask, 1 byte
    if last:
        # The loss's backward follows its forward at once on the last stage, except under GPipe (all m wait).
        n_head = layout.microbatches if layout.pipeline_schedule == "gpipe" else 1
        v = w.shape.vocab
        other += n_head * s * b * (2 * h / sp_div + 2 * h / sp_div + LOGIT_BYTES * v / t)  # norm, head input
    total = weights + grads + optimizer + act + other
    return MemoryEstimate(weights, grads, optimizer, act, other, total, in_flight)


def memory_per_gpu(
    w: Workload, layout: ClusterLayout, in_flight: float | None = None, dropout: bool = False
) -> MemoryEstimate:
    """Peak memory per GPU on the most loaded pipeline rank (the first or the last stage; one rank when pp = 1).

    `in_flight` overrides the first stage's in-flight micro-batches (e.g. with the simulated schedule's value); the
    last stage keeps its schedule count. `dropout` (hidden dropout masks) defaults off, as in both MLPerf models.
    """
    ranks = {0, layout.pp - 1}
    return max((stage_memory(w, layout, r, in_flight, dropout) for r in ranks), key=lambda e: e.total)


def stage_memory(
    w: Workload, layout: ClusterLayout, pp_rank: int, in_flight: float | None = None, dropout: bool = False
) -> MemoryEstimate:
    """Peak memory of one GPU of pipeline rank `pp_rank` (the first holds the embedding, the last the output layer).

    `in_flight` overrides the first stage's in-flight micro-batches; other ranks keep their schedule count.
    """
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    n = in_flight if in_flight is not None and first else in_flight_microbatches(layout, pp_rank)
    return _rank_memory(w, layout, first, last, n, dropout)


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
    "bytes_per_param",
    "GIB",
    "GB",
]
