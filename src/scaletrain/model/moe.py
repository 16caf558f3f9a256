"""The Mixture-of-Experts feed-forward layer (model.moe): router, routed experts as grouped GEMMs, shared experts.

`MoE(cfg)` replaces a block's MLP. A forward runs in four steps, each a method, so expert parallelism can wrap the
middle two without touching the rest:

1. `route`: the `Router` scores every token (softmax or sigmoid over the experts, in fp32), picks its top_k
   experts (optionally group-limited, as DeepSeek-V3: groups ranked by the sum of their two best scores, only
   topk_groups groups eligible) from the scores plus the `expert_bias` buffer, and weights them by the unbiased
   scores (renormalised to sum 1 when norm_topk, then times route_scale).
2. `dispatch`: the (token, expert) assignments are sorted by expert (a stable sort, so inside one expert they keep
   token order: batch-major, then position) and the token rows gathered into one [assignments, d] tensor with
   per-expert counts. With model.moe.capacity_factor > 0 an expert keeps only its first
   ceil(capacity_factor x tokens x top_k / n_experts) assignments in that order; later ones are dropped
   deterministically (their routed contribution is zero; the residual and the shared experts still apply).
3. `experts`: `GroupedExperts` runs every expert's SwiGLU on its contiguous rows, with `torch._grouped_mm` on CUDA
   (one kernel for all experts) and a loop over experts elsewhere (CPU); both give the same result.
4. `combine`: each row is scaled by its routing weight and summed back into its token (index_add), and the shared
   experts' output (n_shared x d_ff_expert wide SwiGLU on every token) is added.

Load balancing. After each forward the module holds `aux_loss` (the Switch load-balancing loss times
model.moe.aux_loss_coef, with its graph: the trainer adds it to the loss) and `tokens_per_expert` (assignments per
expert before capacity drops). With model.moe.bias_update_rate > 0, `update_bias()` (called by the trainer after
each optimizer step) moves `expert_bias` by the rate toward balance from the counts accumulated since the last
call (DeepSeek-V3's auxiliary-loss-free balancing); the bias changes only which experts are picked.

Weights: `experts.w_in` [n_experts, 2 x d_ff_expert, d_model] with gate and up rows interleaved (row 2i gate, 2i+1
up: Llama's `mlp.fc` order, and GPT-OSS's gate_up_proj transposed) and `experts.w_out` [n_experts, d_model,
d_ff_expert]; biases `b_in`/`b_out` when the architecture has biases (GPT-OSS). model.swiglu_limit > 0 selects
GPT-OSS's clamped SwiGLU: out = (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=l).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain import architectures
from scaletrain.config import ModelConfig
from scaletrain.model.common import SwiGLU, swiglu
from scaletrain.model.init import normal_

__all__ = ["MoE", "Router", "GroupedExperts", "moe_layers", "moe_aux_loss", "update_biases"]


class Router(nn.Module):
    """Scores tokens over the experts and picks each token's top_k (module docstring, step 1).

    `gate` is the d_model -> n_experts linear (bias per model.moe.router_bias); `expert_bias` [n_experts] is a
    buffer (saved in checkpoints, never trained by the optimizer) added to the scores for selection only.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.score_func, self.norm_topk, self.route_scale = m.score_func, m.norm_topk, m.route_scale
        self.n_groups, self.topk_groups = m.n_groups, m.topk_groups
        self.gate = nn.Linear(cfg.d_model, m.n_experts, bias=m.router_bias)
        self.register_buffer("expert_bias", torch.zeros(m.n_experts, dtype=torch.float32))
        self.expert_bias: torch.Tensor

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Router scores [tokens, n_experts] in fp32: softmax over the experts, or a sigmoid per expert."""
        weight, bias = self.gate_params()
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
        return logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()

    def gate_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gate's weight and bias as the scores use them (tensor parallelism swaps in local views)."""
        return self.gate.weight, self.gate.bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] fp32, experts [tokens, top_k] int64, scores [tokens, n_experts] fp32)."""
        scores = self.scores(x)
        choice = scores.detach() + self.expert_bias
        if self.n_groups > 1:
            # Rank groups by the sum of their two best (biased) scores; experts outside the chosen groups can't win.
            grouped = choice.view(-1, self.n_groups, self.n_experts // self.n_groups)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            groups = group_score.topk(self.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, scores


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked on a leading [n_experts] dim (module docstring, step 3).

    `forward(x, counts)`: `x` [rows, d] holds each expert's rows contiguously in expert order, `counts`
    [n_experts] how many; returns [rows, d]. Expert parallelism shards the leading dim and calls this with the
    rows of its local experts.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, d, f = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_ff_expert or cfg.ffn_size
        self.w_in = nn.Parameter(torch.empty(n, 2 * f, d))
        self.w_out = nn.Parameter(torch.empty(n, d, f))
        bias = architectures.get(cfg.arch).biases
        self.b_in = nn.Parameter(torch.empty(n, 2 * f)) if bias else None
        self.b_out = nn.Parameter(torch.empty(n, d)) if bias else None
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.use_grouped_mm: bool | None = None
        """True/False forces the grouped-GEMM or the per-expert-loop path; None = grouped on CUDA only."""

    def init_weights(self, std: float, seed: int, prefix: str) -> None:
        """Matrices N(0, std) from the layout-independent streams of their names; biases zero."""
        normal_(self.w_in, std, seed, f"{prefix}.w_in")
        normal_(self.w_out, std, seed, f"{prefix}.w_out")
        for b in (self.b_in, self.b_out):
            if b is not None:
                nn.init.zeros_(b)

    def _grouped(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        # The CUDA kernel wants bf16 operands and 16-byte-aligned rows (torchtitan's condition too).
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        aligned = x.shape[-1] % 8 == 0 and self.w_out.shape[-1] % 8 == 0
        return x.is_cuda and hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and aligned

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self._grouped(x):
            return self._forward_grouped(x, counts)
        return self._forward_loop(x, counts)

    def _forward_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(x.split(counts.tolist())):
            if rows.shape[0] == 0:  # an empty expert: no GEMM, and its weights get no gradient this step
                continue
            b_in = self.b_in[e] if self.b_in is not None else None
            b_out = self.b_out[e] if self.b_out is not None else None
            h = swiglu(F.linear(rows, self.w_in[e], b_in), self.limit, self.alpha)
            outs.append(F.linear(h, self.w_out[e], b_out))
        return torch.cat(outs) if outs else x.new_zeros(x.shape)

    def _forward_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # torch._grouped_mm is not an autocast op: cast to the autocast dtype (bf16, its fast CUTLASS path)
        # ourselves, as torchtitan's grouped experts do.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x.to(dtype), self.w_in.to(dtype).transpose(-2, -1), offs=offs)
        if self.b_in is not None:
            h = h + self.b_in.to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])
        h = swiglu(h, self.limit, self.alpha)
        y = torch._grouped_mm(h, self.w_out.to(dtype).transpose(-2, -1), offs=offs)
        if self.b_out is not None:
            y = y + self.b_out.to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return y


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): a drop-in MLP, `forward(x [..., d]) -> [..., d]`.

    After a forward: `aux_loss` (0-dim, coefficient applied, with graph), `tokens_per_expert` ([n_experts]
    int64, assignments before capacity drops, detached) and `dropped` (0-dim int64, assignments over capacity).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.aux_loss_coef, self.bias_update_rate, self.capacity_factor = (
            m.aux_loss_coef,
            m.bias_update_rate,
            m.capacity_factor,
        )
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        width = m.n_shared * (m.d_ff_expert or cfg.ffn_size)
        self.shared: SwiGLU | None = SwiGLU(cfg.d_model, width) if m.n_shared else None
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.tokens_per_expert: torch.Tensor = torch.zeros(m.n_experts, dtype=torch.long)
        self.dropped: torch.Tensor = torch.zeros((), dtype=torch.long)
        self._pending_counts: torch.Tensor | None = None  # summed over forwards since the last update_bias()

    def init_weights(self, std: float, seed: int, prefix: str) -> None:
        """Every matrix N(0, std) (router, experts, shared experts), biases and `expert_bias` zero."""
        normal_(self.router.gate.weight, std, seed, f"{prefix}.router.gate.weight")
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        with torch.no_grad():
            self.router.expert_bias.zero_()
        self.experts.init_weights(std, seed, f"{prefix}.experts")
        if self.shared is not None:
            for name in ("fc", "proj"):
                lin = getattr(self.shared, name)
                normal_(lin.weight, std, seed, f"{prefix}.shared.{name}.weight")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and experts [tokens, top_k] of flat tokens `x` [tokens, d]; records the balance stats."""
        weights, experts, scores = self.router(x)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)
        self.tokens_per_expert = counts.detach()
        if self.training:  # evaluation must not steer the balancing; a checkpoint recompute counts twice (harmless:
            # the update reads only which side of the mean each expert is on)
            pending = self._pending_counts
            self._pending_counts = counts.detach() if pending is None else pending + counts.detach()
        if self.aux_loss_coef > 0:
            self.aux_loss = self.aux_loss_coef * self.balance_loss(scores, counts)
        else:
            self.aux_loss = scores.new_zeros(())
        return weights, experts

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch load-balancing loss n_experts x sum_e f_e x P_e (1 when perfectly balanced): f_e the fraction of
        the tokens x top_k assignments routed to e, P_e the mean over tokens of e's score normalised over the
        experts (sigmoid scores are divided by their sum per token, as Megatron-LM does)."""
        probs = scores if self.router.score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        frac = counts.float() / max(1, scores.shape[0] * self.top_k)
        return self.n_experts * (frac * probs.mean(dim=0)).sum()

    def capacity(self, n_tokens: int) -> int:
        """Assignments an expert keeps out of `n_tokens` tokens; 0 = unlimited (model.moe.capacity_factor 0)."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows grouped by expert: (x_sorted [rows, d], counts [n_experts], token [rows], weight [rows]).

        `token` is each row's source token, `weight` its routing weight; rows over capacity are left out.
        """
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # stable: inside an expert, rows stay in token order
        counts = torch.bincount(flat, minlength=self.n_experts)
        cap = self.capacity(x.shape[0])
        if cap:
            starts = counts.cumsum(0) - counts
            rank = torch.arange(order.numel(), device=x.device) - starts.repeat_interleave(counts)
            keep = rank < cap
            self.dropped = (~keep).sum().detach()
            order = order[keep]
            counts = counts.clamp(max=cap)
        else:
            self.dropped = torch.zeros((), dtype=torch.long, device=x.device)
        token = order // self.top_k
        return x[token], counts, token, weights.flatten()[order]

    def combine(self, y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Sum of each token's rows `y` times their routing weights -> [n_tokens, d]."""
        out = y.new_zeros(n_tokens, y.shape[-1])
        return out.index_add(0, token, y * weight.to(y.dtype)[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        rows, counts, token, weight = self.dispatch(flat, weights, experts)
        out = self.combine(self.experts(rows, counts), token, weight, flat.shape[0]).view(shape)
        if self.shared is not None:  # on x's own shape: tensor parallelism shards it like a dense MLP
            out = out + self.shared(x)
        return out

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor | None = None) -> None:
        """Auxiliary-loss-free balancing step: expert_bias += rate x sign(mean count - count).

        `counts` defaults to the assignments accumulated since the last call; data-parallel training passes the
        all-reduced sum so every rank moves its biases alike. No-op when model.moe.bias_update_rate is 0.
        """
        counts = self._pending_counts if counts is None else counts
        self._pending_counts = None
        if self.bias_update_rate <= 0 or counts is None:
            return
        c = counts.float().to(self.router.expert_bias.device)
        self.router.expert_bias.add_(self.bias_update_rate * torch.sign(c.mean() - c))


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the last forward's auxiliary losses over `model`'s MoE layers (None without MoE layers)."""
    losses = [m.aux_loss for m in moe_layers(model)]
    return torch.stack(losses).sum() if losses else None


def update_biases(model: nn.Module) -> None:
    """`update_bias()` on every MoE layer of `model` (after each optimizer step)."""
    for m in moe_layers(model):
        m.update_bias()
