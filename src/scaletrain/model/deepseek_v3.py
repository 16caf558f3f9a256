"""The DeepSeek-V3 decoder (= Hugging Face `DeepseekV3ForCausalLM`), single-device and plain; no multi-token prediction.

Token embedding, then model.n_layers pre-norm blocks: RMSNorm, multi-head latent attention (model/mla.py, shaped by
model.mla), RMSNorm, and a feed-forward layer that is a dense SwiGLU of model.d_ff in the first model.moe.first_dense
blocks and a Mixture-of-Experts layer (model/moe.py: sigmoid router with group-limited top-k, normalised and scaled
weights, selection bias, routed plus shared experts of model.moe.d_ff_expert) in the others; a final RMSNorm and an
untied output layer. Multi-token prediction (DeepSeek-V3's optional extra module, HF's `num_nextn_predict_layers`)
is left out: it is off for MLPerf deepseekv3_671b, and HF's causal LM does not run it in its forward either.

Seams as Llama's where they exist (`embed.tok`, `blocks.<i>.{ln1,attn,attn.proj,attn.core,ln2,mlp}`, `ln_f`,
`head`; dense blocks' `mlp.fc`/`mlp.proj` with gate and up rows interleaved), so a pipeline stage is this class with
modules set to None. Hugging Face names map one to one except `o_proj` -> `attn.proj`, input/post-attention norms
-> `ln1`/`ln2`, gate/up -> the interleaved `fc` rows, and the router's `e_score_correction_bias` -> `expert_bias`.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.init import normal_
from scaletrain.model.llama import MLP, Embeddings, UntiedDecoder
from scaletrain.model.mla import MLA
from scaletrain.model.moe import MoE

__all__ = ["DeepseekV3", "Block"]


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)); `mlp` is dense (SwiGLU) or an MoE layer."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = MLA(cfg)
        self.ln2 = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        dense = cfg.moe.n_experts <= 0 or layer < cfg.moe.first_dense
        self.mlp: MLP | MoE = MLP(cfg) if dense else MoE(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + (self.attn(self.ln1(x)) if positions is None else self.attn(self.ln1(x), positions=positions))
        return x + self.mlp(self.ln2(x))


class DeepseekV3(UntiedDecoder):
    """DeepSeek-V3-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary.

    A pipeline stage is a DeepseekV3 with `embed` None (input is hidden states) and/or `ln_f` and `head` None
    (output is hidden states). The output layer is never tied to the embedding. After a forward, each MoE
    layer holds its auxiliary loss and expert counts (model/moe.py `moe_aux_loss`, `moe_layers`).
    """

    tied_embeddings = False  # read by pipeline.TiedEmbeddingSync: no gradient to share between first and last stage

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        # ModuleDict keyed by index (not ModuleList) so pipeline stages can drop blocks and keep FQNs stable.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.ln_f: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        self.init_weights(seed)

    def init_weights(self, seed: int = 0) -> None:
        """Every matrix and embedding N(0, init_std), RMSNorm weights 1, the experts' selection biases 0.

        Values depend only on (seed, parameter name, element index) (scaletrain.model.init), so every parallel
        layout starts from the same weights; touches every parameter and buffer (called again after `to_empty`).
        """
        std = self.cfg.init_std
        moe_prefixes: list[str] = []
        for name, module in self.plain_modules():
            if any(name.startswith(p) for p in moe_prefixes):
                continue  # the MoE layer initialised its own submodules, under the same names
            if isinstance(module, MoE):
                module.init_weights(std, seed, name)
                moe_prefixes.append(name + ".")
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                normal_(module.weight, std, seed, f"{name}.weight")
