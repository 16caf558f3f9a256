"""Context parallelism (CP): the sequence is split across the ranks of a CP group, K/V are all-gathered.

Each CP rank holds 2 of the 2*cp equal chunks of every sequence in "zigzag" order (rank r: chunks r and
2*cp-1-r), so every rank does the same amount of causal-attention work. Attention is Llama 3's all-gather
variant: K/V of the whole sequence are gathered (their gradients reduce-scattered in backward) and each local
query chunk attends to the key prefix that ends at its own chunk. Everything outside attention is per-token,
so it runs on the local tokens unchanged; only positions need the global values: GPT's position embedding gets
them through a forward pre-hook, Llama's rotary embedding asks the attention core (`positions`).

PyTorch's own `torch.distributed.tensor.experimental.context_parallel` (ring attention) does not run on CPU/gloo
(checked on torch 2.11 and 2.13): it reroutes only the CUDA SDPA kernels (flash, efficient, cudnn); on CPU the call
reaches `aten._scaled_dot_product_flash_attention_for_cpu`, which DTensor has no sharding strategy for
(NotImplementedError), and forcing the math backend fails with "aten.add.Tensor got mixed torch.Tensor and
DTensor". So the all-gather implementation below is the one used on CUDA too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias

    from scaletrain.model.build import Decoder

# The autograd all-gather was renamed after torch 2.11; the old name still works in 2.13 but warns. (Not
# torch.distributed.nn.functional.all_gather: on gloo its backward scatters from *group* rank i as if it were a
# global rank, which fails on any CP group that is not ranks 0..cp-1.)
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks cp_rank and 2*cp-1-cp_rank of 2*cp equal chunks, in that order.

    cp == 1 gives arange(seq_len). Raises ValueError when seq_len is not a multiple of 2*cp or the rank is
    out of range.
    """
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"context parallel rank {cp_rank} out of range for cp={cp}")
    if cp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2*cp={2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def shard_sequence(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's zigzag shard of `t` along `dim` (e.g. tokens or labels [batch, seq] -> [batch, seq/cp])."""
    if cp == 1:
        return t
    return t.index_select(dim, cp_positions(t.shape[dim], cp, cp_rank).to(t.device))


class AllGatherCausalAttention(nn.Module):
    """Causal attention for zigzag-sharded q/k/v [batch, heads, seq/cp, head_dim] (a drop-in `Attention.core`).

    K and V are all-gathered over `group` (one collective for both), put back in global order, and each of the
    two local query chunks attends to keys up to the end of its own chunk: keys before the chunk unmasked, the
    diagonal block causal. Each rank computes 2*cp+1 chunk x chunk score blocks (the same on every rank)
    instead of the 4*cp of a full local-query x global-key score matrix.
    """

    def __init__(self, group, seq_len: int, cp: int, cp_rank: int):
        super().__init__()
        if seq_len % (2 * cp):
            raise ValueError(f"sequence length {seq_len} does not split into 2*cp={2 * cp} equal chunks")
        self.group, self.seq_len, self.cp, self.cp_rank = group, seq_len, cp, cp_rank
        self.chunks = (cp_rank, 2 * cp - 1 - cp_rank)  # global chunk indices of the local halves
        # Built here for the model's own length: constructing a CausalBias inside torch.compile breaks the graph.
        c = seq_len // (2 * cp)
        self._masks: dict[tuple[int, int], CausalBias] = {}
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}
        for chunk in self.chunks:
            self._mask(c, (chunk + 1) * c)

    def _mask(self, c: int, end: int):
        # The chunk's c queries are the last c of keys [0, end): causal aligned bottom-right, which torch serves
        # with its flash/efficient kernels on CUDA (a boolean mask tensor would rule flash out).
        if (c, end) not in self._masks:
            from torch.nn.attention.bias import causal_lower_right  # lazy: it imports torch._dynamo (~1.4 s)

            self._masks[(c, end)] = causal_lower_right(c, end)
        return self._masks[(c, end)]

    def positions(self, s_local: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `s_local` tokens, for models that rotate q/k by position (Llama's RoPE).

        Asked by the attention itself, so a pipeline stage fed only hidden states still gets the zigzag positions.
        """
        key = (s_local, device)
        if key not in self._positions:
            self._positions[key] = cp_positions(s_local * self.cp, self.cp, self.cp_rank).to(device)
        return self._positions[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Local attention output [batch, heads, seq/cp, head_dim], rows in this rank's zigzag order."""
        b, h, s_local, hd = q.shape
        if s_local % 2 or s_local * self.cp > self.seq_len:
            raise ValueError(f"local sequence {s_local} x cp={self.cp} must be even and at most seq_len={self.seq_len}")
        c, cp = s_local // 2, self.cp
        kv = _all_gather_autograd(torch.stack([k, v]).contiguous(), 0, self.group)  # [cp*2, b, h, s_local, hd]
        kv = kv.view(cp, 2, b, h, 2, c, hd)  # [rank, k|v, b, h, half, c, hd]
        # Rank r's halves are global chunks r and 2cp-1-r: global order is every rank's first half in rank
        # order, then the second halves in reverse rank order. One cat, no index tensor (compiles cleanly).
        pieces = [kv[r, :, :, :, 0] for r in range(cp)] + [kv[r, :, :, :, 1] for r in reversed(range(cp))]
        k_all, v_all = torch.cat(pieces, dim=3).unbind(0)  # [b, h, seq, hd] each
        outs = []
        for i, chunk in enumerate(self.chunks):
            end = (chunk + 1) * c  # keys after this chunk are masked anyway: leave them out of the GEMMs
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, i * c : (i + 1) * c], k_all[:, :, :end], v_all[:, :, :end], attn_mask=self._mask(c, end)
                )
            )
        return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Make `model` (a GPT or a pipeline stage of one) run on this rank's zigzag shard of each sequence.

    Every block's attention core becomes an `AllGatherCausalAttention` over the 1-D `cp_mesh`; if the model
    holds the embedding, a forward pre-hook passes this rank's global `positions` unless the caller gives them.
    Inputs and labels must be cut with `shard_sequence`, and losses and gradients summed over the CP group
    (CP ranks hold the same weights). A no-op when cp_mesh.size() == 1.
    """
    cp = cp_mesh.size()
    if cp == 1:
        return
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_context_parallel needs a 1-D mesh, got {cp_mesh.ndim} dimensions")
    model = cast("Decoder", model)  # the attributes below are the decoder's, not nn.Module's
    group, rank, seq_len = cp_mesh.get_group(), cp_mesh.get_local_rank(), model.cfg.seq_len
    for block in model.blocks.values():
        block.get_submodule("attn").core = AllGatherCausalAttention(group, seq_len, cp, rank)
    if model.embed is None:
        return
    cache: dict[tuple[torch.device, int], torch.Tensor] = {}

    def inject_positions(module, args, kwargs):
        if len(args) > 1 or kwargs.get("positions") is not None:
            return None
        tokens = args[0] if args else kwargs["tokens"]
        total = tokens.shape[1] * cp
        if total > seq_len:  # explicit positions bypass Embeddings' own length check
            raise ValueError(f"{tokens.shape[1]} local tokens x cp={cp} exceed model.seq_len={seq_len}")
        key = (tokens.device, total)
        if key not in cache:
            cache[key] = cp_positions(total, cp, rank).to(tokens.device)
        return args, {**kwargs, "positions": cache[key]}

    model.register_forward_pre_hook(inject_positions, with_kwargs=True)
