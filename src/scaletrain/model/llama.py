"""The Llama decoder (= Hugging Face `LlamaForCausalLM`), and Qwen3's dense decoder (`Qwen3ForCausalLM`).

Both are the shared decoder of model/common.py as it stands: RMSNorm (eps from config) before attention and MLP
plus a final one, rotary positions (HF convention: rotate_half, base `cfg.rope_base`, optionally Llama 3.1's
"llama3" frequency scaling), grouped-query attention, SwiGLU MLP, no biases, untied output layer, N(0, init_std)
init. Llama 2 and Llama 3.1 (model.arch "llama", "llama31") differ only in the rotary frequencies; Qwen3
("qwen3") adds its facts' QK-norm (a per-head RMSNorm on queries and keys before rotary) and its own head size
(model.head_dim). Parameter names, row orders and seams are model/common.py's.
"""

from __future__ import annotations

from scaletrain.config import ModelConfig
from scaletrain.model.common import Decoder

__all__ = ["Llama"]


class Llama(Decoder):
    """Llama-architecture decoder (Llama 2, Llama 3.1, Qwen3 dense). `forward(tokens)` returns logits over the
    padded vocabulary; pipeline stages and the untied head as `model.common.Decoder`."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        if cfg.n_heads % cfg.kv_heads or (not cfg.head_dim and cfg.d_model % cfg.n_heads) or cfg.head_size % 2:
            raise ValueError(
                f"{cfg.arch} needs n_kv_heads | n_heads | d_model (or model.head_dim) and an even head_dim, got "
                f"d_model={cfg.d_model} n_heads={cfg.n_heads} n_kv_heads={cfg.kv_heads}"
            )
        super().__init__(cfg, seed)
