"""The DeepSeek-V3 decoder (= Hugging Face `DeepseekV3ForCausalLM`), single-device and plain; no multi-token prediction.

The shared decoder of model/common.py (token embedding, pre-norm RMSNorm blocks, final RMSNorm, untied output
layer) with its own attention and MLPs: multi-head latent attention (model/mla.py, shaped by model.mla), and a
feed-forward layer that is a dense SwiGLU of model.d_ff in the first model.moe.first_dense blocks and a
Mixture-of-Experts layer (model/moe.py: sigmoid router with group-limited top-k, normalised and scaled weights,
selection bias, routed plus shared experts of model.moe.d_ff_expert) in the others. Multi-token prediction
(DeepSeek-V3's optional extra module, HF's `num_nextn_predict_layers`) is left out: it is off for MLPerf
deepseekv3_671b, and HF's causal LM does not run it in its forward either.

Seams as Llama's where they exist (`embed.tok`, `blocks.<i>.{ln1,attn,attn.proj,attn.core,ln2,mlp}`, `ln_f`,
`head`; dense blocks' `mlp.fc`/`mlp.proj` with gate and up rows interleaved), so a pipeline stage is this class with
modules set to None. Hugging Face names map one to one except `o_proj` -> `attn.proj`, input/post-attention norms
-> `ln1`/`ln2`, gate/up -> the interleaved `fc` rows, and the router's `e_score_correction_bias` -> `expert_bias`.
After a forward, each MoE layer holds its auxiliary loss and expert counts (model/moe.py `moe_aux_loss`).
"""

from __future__ import annotations

from torch import nn

from scaletrain.config import ModelConfig
from scaletrain.model.common import Decoder, SwiGLU
from scaletrain.model.mla import MLA
from scaletrain.model.moe import MoE

__all__ = ["DeepseekV3"]


class DeepseekV3(Decoder):
    """DeepSeek-V3-architecture decoder. `forward(tokens)` returns logits over the padded vocabulary (pipeline
    stages and the untied head as `model.common.Decoder`)."""

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Multi-head latent attention in every block."""
        return MLA(cfg)

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """A dense SwiGLU in the first model.moe.first_dense blocks (all of them without experts), MoE after."""
        if cfg.moe.n_experts <= 0 or layer < cfg.moe.first_dense:
            return SwiGLU(cfg.d_model, cfg.ffn_size)
        return MoE(cfg)
