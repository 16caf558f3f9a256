"""Hugging Face GPT-2 format export and import of scaletrain gpt3 weights.

The gpt3 architecture is GPT-2's at any size, so a trained model becomes a directory that
`transformers.GPT2LMHeadModel.from_pretrained` loads with no custom code: `config.json` plus `model.safetensors`.
Two layouts differ and are converted here:

* Fused qkv rows. Ours are ordered (head, q|k|v, head_dim), Megatron's layout, so a tensor-parallel row shard
  holds whole heads; HF's `c_attn` is (q|k|v, head, head_dim). The rows are permuted both ways.
* HF's Conv1D stores linear weights as (in, out), the transpose of `nn.Linear`.

The padded vocabulary rows are kept (HF `vocab_size` = `cfg.padded_vocab`): the logits then match ours exactly,
shape included, and an import gives back the very same tensors. The tokenizer's real size is recorded under
"scaletrain_vocab_size"; the padding rows are never produced by the tokenizer. The output layer is tied to the
token embedding in both models, so only `transformer.wte.weight` is written and HF re-ties `lm_head` on load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.checkpoint.hf.common import (
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    MAX_WIDTH,
    check_model_config,
    check_state_shapes,
    hf_float,
    hf_int,
    load_tensors,
    publish_hf_dir,
    read_config_json,
    vocab_multiple_for,
)
from scaletrain.config import ModelConfig

_BLOCK = {
    "ln1": "ln_1",
    "ln2": "ln_2",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are GPT-2's tanh approximation, as our MLP uses


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = cfg.d_model, cfg.ffn_size, cfg.padded_vocab
    shapes = {"embed.tok.weight": (v, d), "embed.pos.weight": (cfg.seq_len, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update(
            {
                p + "ln1.weight": (d,),
                p + "ln1.bias": (d,),
                p + "ln2.weight": (d,),
                p + "ln2.bias": (d,),
                p + "attn.qkv.weight": (3 * d, d),
                p + "attn.qkv.bias": (3 * d,),
                p + "attn.proj.weight": (d, d),
                p + "attn.proj.bias": (d,),
                p + "mlp.fc.weight": (f, d),
                p + "mlp.fc.bias": (f,),
                p + "mlp.proj.weight": (d, f),
                p + "mlp.proj.bias": (d,),
            }
        )
    return shapes


def _qkv_rows(t: torch.Tensor, n_heads: int, to_hf: bool) -> torch.Tensor:
    """Swap the two leading row factors: (head, 3, hd) <-> (3, head, hd); weights keep their column dim."""
    hd = t.shape[0] // (3 * n_heads)
    lead = (n_heads, 3) if to_hf else (3, n_heads)
    return t.reshape(*lead, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.padded_vocab,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff or None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.ln_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        # Set from generation_config.json when the export carries the run's tokenizer (common.with_token_ids).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": str(dtype).removeprefix("torch."),
        "scaletrain_vocab_size": cfg.vocab_size,
        "scaletrain_vocab_multiple": cfg.vocab_multiple,
    }


def export_gpt2_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir,
    dtype=torch.float32,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write a full (unsharded) scaletrain gpt3 state dict as a Hugging Face GPT-2 directory; returns its path.

    `out_dir` gets `config.json` and `model.safetensors` with tensors cast to `dtype`. It is built in a temporary
    sibling directory and renamed into place only when complete, so a failed export leaves any previous export
    at `out_dir` untouched. `out_dir` must be new or empty unless `overwrite` (common.publish_hf_dir). Raises
    ValueError on a missing, unexpected or wrongly shaped key, or an untied head; FileExistsError for a refused
    `out_dir`.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"export_hf: dtype={dtype} is not a floating-point dtype")
    expected = _expected_shapes(cfg)
    sd = dict(state_dict)
    head = sd.pop("head.weight", None)
    check_state_shapes("export_hf", sd, expected)
    # HF re-ties lm_head to wte on load, so a head that drifted from the embedding would be silently lost.
    if head is not None and head is not sd["embed.tok.weight"] and not torch.equal(head, sd["embed.tok.weight"]):
        raise ValueError("export_hf: head.weight differs from embed.tok.weight; GPT-2 format needs them tied")

    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def put(name: str, t: torch.Tensor, transpose: bool = False) -> None:
        t = t.detach().to(device="cpu", dtype=dtype)
        t = (t.T if transpose else t).contiguous()
        # safetensors refuses tensors sharing storage; a same-dtype .to() can return the caller's own tensor.
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t

    put("transformer.wte.weight", sd["embed.tok.weight"])
    put("transformer.wpe.weight", sd["embed.pos.weight"])
    for i in range(cfg.n_layers):
        for ours, hf in _BLOCK.items():
            w, b = sd[f"blocks.{i}.{ours}.weight"], sd[f"blocks.{i}.{ours}.bias"]
            if ours == "attn.qkv":
                w, b = _qkv_rows(w, cfg.n_heads, to_hf=True), _qkv_rows(b, cfg.n_heads, to_hf=True)
            put(f"transformer.h.{i}.{hf}.weight", w, transpose=not ours.startswith("ln"))
            put(f"transformer.h.{i}.{hf}.bias", b)
    put("transformer.ln_f.weight", sd["ln_f.weight"])
    put("transformer.ln_f.bias", sd["ln_f.bias"])

    return publish_hf_dir(Path(out_dir), _hf_config(cfg, dtype), out, "export_hf", overwrite, extra_files)


def gpt2_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face GPT-2 directory from its config.json (no tensors read); ValueError for
    anything that is not a plain GPT-2."""
    cfg_file, hf = read_config_json(path)
    problems = {
        "model_type": (hf.get("model_type"), ("gpt2",)),
        "activation_function": (hf.get("activation_function", "gelu_new"), _TANH_GELUS),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
    }
    for key, (value, allowed) in problems.items():
        if value not in allowed:
            raise ValueError(f"{cfg_file}: {key}={value!r} is not supported (need {' or '.join(map(repr, allowed))})")
    rows = hf_int(cfg_file, hf, "vocab_size", 1, MAX_VOCAB)
    d = hf_int(cfg_file, hf, "n_embd", 1, MAX_WIDTH)
    n_layers = hf_int(cfg_file, hf, "n_layer", 1, MAX_LAYERS)
    n_heads = hf_int(cfg_file, hf, "n_head", 1, d)
    seq_len = hf_int(cfg_file, hf, "n_positions", 1, MAX_POSITIONS)
    if d % n_heads:
        raise ValueError(f"{cfg_file}: n_head={n_heads} does not divide n_embd={d}")
    vocab = hf_int(cfg_file, hf, "scaletrain_vocab_size", 1, rows, default=rows)
    cfg = ModelConfig(
        n_layers=n_layers,
        d_model=d,
        n_heads=n_heads,
        d_ff=hf_int(cfg_file, hf, "n_inner", 0, MAX_WIDTH, default=0),
        seq_len=seq_len,
        vocab_size=vocab,
        vocab_multiple=vocab_multiple_for(vocab, rows, hf_int(cfg_file, hf, "scaletrain_vocab_multiple", 1, rows, 0)),
        ln_eps=hf_float(cfg_file, hf, "layer_norm_epsilon", 0, 1, default=1e-5, hi_open=True),
        init_std=hf_float(cfg_file, hf, "initializer_range", 0, 1, default=ModelConfig.init_std),
    )
    return check_model_config(cfg_file, cfg)


def import_gpt2_hf(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face GPT-2 directory into (ModelConfig, scaletrain state dict).

    Accepts `model.safetensors` (single or sharded) or `pytorch_model.bin` (tensors only, never arbitrary pickle).
    Tensors keep their stored dtype; `head.weight` is the same tensor object as `embed.tok.weight`. Raises
    FileNotFoundError for a missing directory or file and ValueError for anything that is not a plain GPT-2.
    """
    path = Path(path)
    cfg = gpt2_config(path)
    n_layers, n_heads = cfg.n_layers, cfg.n_heads
    source, raw = load_tensors(path)
    # Original OpenAI-converted files have no "transformer." prefix and carry the causal-mask buffers.
    tensors = {
        k.removeprefix("transformer."): v for k, v in raw.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))
    }
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, tensors.get("wte.weight", lm_head)):
        raise ValueError(f"{source}: lm_head.weight differs from wte.weight; scaletrain needs a tied output layer")

    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in tensors:
            raise ValueError(f"{source}: missing tensor {key!r}")
        t = tensors.pop(key)
        if tuple(t.shape) != shape:
            raise ValueError(f"{source}: {key} has shape {tuple(t.shape)}, config.json implies {shape}")
        return t

    sd: dict[str, torch.Tensor] = {}
    shapes = _expected_shapes(cfg)
    sd["embed.tok.weight"] = take("wte.weight", shapes["embed.tok.weight"])
    sd["embed.pos.weight"] = take("wpe.weight", shapes["embed.pos.weight"])
    for i in range(n_layers):
        for ours, hf_name in _BLOCK.items():
            key = f"blocks.{i}.{ours}."
            transpose = not ours.startswith("ln")
            w_shape = shapes[key + "weight"][::-1] if transpose else shapes[key + "weight"]
            w, b = take(f"h.{i}.{hf_name}.weight", w_shape), take(f"h.{i}.{hf_name}.bias", shapes[key + "bias"])
            w = w.T.contiguous() if transpose else w
            if ours == "attn.qkv":
                w, b = _qkv_rows(w, n_heads, to_hf=False), _qkv_rows(b, n_heads, to_hf=False)
            sd[key + "weight"], sd[key + "bias"] = w.contiguous(), b.contiguous()
    sd["ln_f.weight"] = take("ln_f.weight", shapes["ln_f.weight"])
    sd["ln_f.bias"] = take("ln_f.bias", shapes["ln_f.bias"])
    if tensors:
        raise ValueError(f"{source}: unexpected tensors {sorted(tensors)[:5]}")
    sd["head.weight"] = sd["embed.tok.weight"]
    return cfg, sd
