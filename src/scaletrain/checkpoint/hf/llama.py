"""Hugging Face Llama and Qwen3 format export and import of scaletrain llama weights (`transformers.LlamaForCausalLM`,
`Qwen3ForCausalLM`).

Our Llama is HF's at any size (RMSNorm, rotate_half rotary positions with any base and the "llama3" frequency
scaling of Llama 3.1, GQA, SwiGLU, no biases, untied head), so an export is `config.json` + `model.safetensors`
that `LlamaForCausalLM.from_pretrained` loads with no custom code. Llama 2 and Llama 3.1 (model.arch "llama",
"llama31") share this converter; config.json carries the rotary base and scaling, and "scaletrain_arch". Qwen3
(dense, "qwen3") is the same with the QK-norm weights (`attn.q_norm`/`attn.k_norm` <-> `self_attn.q_norm`/
`self_attn.k_norm`, both [head_dim]) and model_type "qwen3"; an architecture's QK-norm fact picks the type.
Two fused weights are converted (row orders documented in `model/common.py`):

* `attn.qkv` rows (kv_group, [q_0..q_{r-1}, k, v], head_dim) <-> `q_proj` (n_heads*hd), `k_proj`, `v_proj`
  (n_kv_heads*hd each). HF's q/k rows are already in rotate_half order (its converter permuted Meta's
  interleaved pairs), and so are ours: no rotary permutation is needed, only the grouping.
* `mlp.fc` rows (ffn_index, gate|up) <-> `gate_proj` = rows 0::2, `up_proj` = rows 1::2.

The padded vocabulary rows are kept (HF `vocab_size` = `cfg.padded_vocab`), as in the GPT-2 export, with the
tokenizer's real size under "scaletrain_vocab_size".
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from scaletrain import architectures
from scaletrain.checkpoint.hf.common import (
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_ROPE,
    MAX_VOCAB,
    MAX_WIDTH,
    check_model_config,
    check_state_shapes,
    hf_float,
    hf_int,
    hf_section,
    load_tensors,
    publish_hf_dir,
    read_config_json,
    vocab_multiple_for,
)
from scaletrain.config import ModelConfig
from scaletrain.model.rope import Rope
from scaletrain.model.spec import model_spec

MODEL_TYPES = {False: "llama", True: "qwen3"}
"""Hugging Face model_type of an architecture through this converter, by its QK-norm fact."""

# Ours -> HF, per block, for the weights that need no conversion.
_PLAIN = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn.proj": "self_attn.o_proj",
    "mlp.proj": "mlp.down_proj",
}
_QK_NORM = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


def plain_names(cfg: ModelConfig) -> dict[str, str]:
    """Ours -> HF per-block names (without ".weight") of the weights copied as they are: the QK-norms too with
    the architecture's QK-norm fact."""
    return {**_PLAIN, **(_QK_NORM if architectures.get(cfg.arch).qk_norm else {})}


def split_qkv(w: torch.Tensor, n_heads: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused qkv weight [(kv, r+2, hd), d] -> HF (q_proj [n_heads*hd, d], k_proj, v_proj [n_kv*hd, d])."""
    r = n_heads // n_kv
    g = w.reshape(n_kv, r + 2, -1, w.shape[-1])
    return (g[:, :r].reshape(-1, w.shape[-1]), g[:, r].reshape(-1, w.shape[-1]), g[:, r + 1].reshape(-1, w.shape[-1]))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Inverse of `split_qkv`: HF q/k/v projections -> our grouped fused qkv weight."""
    d = q.shape[-1]
    g = torch.cat(
        [q.reshape(n_kv, -1, k.shape[0] // n_kv, d), k.reshape(n_kv, 1, -1, d), v.reshape(n_kv, 1, -1, d)], dim=1
    )
    return g.reshape(-1, d)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key of a full scaletrain llama state dict and its shape."""
    d, f, v = cfg.d_model, cfg.ffn_size, cfg.padded_vocab
    hd = cfg.head_size
    qk_norm = architectures.get(cfg.arch).qk_norm
    shapes = {"embed.tok.weight": (v, d), "ln_f.weight": (d,), "head.weight": (v, d)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update(
            {
                p + "ln1.weight": (d,),
                p + "ln2.weight": (d,),
                p + "attn.qkv.weight": ((cfg.n_heads + 2 * cfg.kv_heads) * hd, d),
                p + "attn.proj.weight": (d, cfg.n_heads * hd),
                p + "mlp.fc.weight": (2 * f, d),
                p + "mlp.proj.weight": (d, f),
            }
        )
        if qk_norm:
            shapes.update({p + "attn.q_norm.weight": (hd,), p + "attn.k_norm.weight": (hd,)})
    return shapes


def _rope_json(rope: Rope) -> tuple[dict | None, dict]:
    """HF's rope_scaling (transformers 4.x; None without scaling) and rope_parameters (5.x) of `rope`."""
    if rope.scaling == "yarn":  # HF Llama computes YaRN with the same function as GPT-OSS (model/rope.py's Rope)
        yarn = {
            "rope_type": "yarn",
            "factor": rope.factor,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "truncate": rope.truncate,
            "original_max_position_embeddings": rope.original_seq_len,
        }
        return yarn, {**yarn, "rope_theta": rope.theta}
    if rope.scaling != "llama3":
        return None, {"rope_type": "default", "rope_theta": rope.theta}
    scaling = {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_seq_len,
    }
    return scaling, {**scaling, "rope_theta": rope.theta}


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    rope = Rope.of(cfg)
    rope_scaling, rope_parameters = _rope_json(rope)
    return {
        "architectures": [model_spec(cfg.arch).hf_class],
        "model_type": MODEL_TYPES[architectures.get(cfg.arch).qk_norm],
        "vocab_size": cfg.padded_vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.ln_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        # transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters; write both.
        "rope_theta": rope.theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        # Set from generation_config.json when the export carries the run's tokenizer (common.with_token_ids).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "scaletrain_vocab_size": cfg.vocab_size,
        "scaletrain_vocab_multiple": cfg.vocab_multiple,
        "scaletrain_arch": cfg.arch,
    }


def export_llama_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir,
    dtype=torch.float32,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write a full (unsharded) scaletrain llama state dict as a Hugging Face Llama directory; returns its path.

    Tensors are cast to `dtype`. The directory is built beside `out_dir` and renamed into place when complete;
    `out_dir` must be new or empty unless `overwrite` (common.publish_hf_dir). Raises ValueError on a missing,
    unexpected or wrongly shaped key; FileExistsError for a refused `out_dir`.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"export_llama_hf: dtype={dtype} is not a floating-point dtype")
    expected = expected_shapes(cfg)
    sd = dict(state_dict)
    check_state_shapes("export_llama_hf", sd, expected)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        # clone: safetensors refuses tensors that share storage (slices of one fused weight do).
        out[name] = t.detach().to(device="cpu", dtype=dtype).contiguous().clone()

    put("model.embed_tokens.weight", sd["embed.tok.weight"])
    for i in range(cfg.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in plain_names(cfg).items():
            put(f"{hf}{b}.weight", sd[f"{ours}{a}.weight"])
        q, k, v = split_qkv(sd[ours + "attn.qkv.weight"], cfg.n_heads, cfg.kv_heads)
        put(hf + "self_attn.q_proj.weight", q)
        put(hf + "self_attn.k_proj.weight", k)
        put(hf + "self_attn.v_proj.weight", v)
        fc = sd[ours + "mlp.fc.weight"]
        put(hf + "mlp.gate_proj.weight", fc[0::2])
        put(hf + "mlp.up_proj.weight", fc[1::2])
    put("model.norm.weight", sd["ln_f.weight"])
    put("lm_head.weight", sd["head.weight"])
    return publish_hf_dir(Path(out_dir), _hf_config(cfg, dtype), out, "export_llama_hf", overwrite, extra_files)


def _rope(hf: dict, cfg_file) -> Rope:
    """The rotary settings of HF config.json `hf` (5.x rope_parameters, else 4.x rope_theta/rope_scaling); ValueError
    naming the file for a scaling other than none and llama3, or a value of the wrong type or range."""
    params = hf_section(cfg_file, hf, "rope_parameters")
    scaling = hf_section(cfg_file, hf, "rope_scaling")
    theta = hf_float(cfg_file, hf, "rope_theta", 1, MAX_ROPE, default=10000.0)
    theta = hf_float(cfg_file, params, "rope_theta", 1, MAX_ROPE, default=theta, label="rope_parameters.")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return Rope(theta)
    if kind != "llama3":
        raise ValueError(f"{cfg_file}: rotary scaling {kind!r} is not supported (only 'llama3')")
    src, label = (params, "rope_parameters.") if params.get("rope_type") == "llama3" else (scaling, "rope_scaling.")
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in needed if src.get(key) is None]
    if missing:
        raise ValueError(f"{cfg_file}: llama3 rotary scaling is missing {missing[0]!r}")
    return Rope(
        theta,
        "llama3",
        hf_float(cfg_file, src, "factor", 0, MAX_ROPE, label=label),
        hf_float(cfg_file, src, "low_freq_factor", 0, MAX_ROPE, label=label),
        hf_float(cfg_file, src, "high_freq_factor", 0, MAX_ROPE, label=label),
        hf_int(cfg_file, src, "original_max_position_embeddings", 1, MAX_POSITIONS, label=label),
    )


def _arch_and_rope_fields(hf: dict, rope: Rope) -> dict:
    """model.arch (config.json's "scaletrain_arch" when it names a Llama-converter architecture of its model_type,
    else qwen3 for a Qwen3 directory, llama31 for llama3 scaling and llama otherwise) and the model.rope_* fields,
    left at "the architecture's" where they are."""
    arch = hf.get("scaletrain_arch")
    qk_norm = hf.get("model_type") == MODEL_TYPES[True]
    if not (
        isinstance(arch, str)
        and arch in architectures.names()
        and model_spec(arch).hf_adapter == "llama"
        and architectures.get(arch).qk_norm == qk_norm
    ):
        arch = "qwen3" if qk_norm else "llama31" if rope.scaling == "llama3" else "llama"
    facts = architectures.get(arch)
    fields: dict = {
        "arch": arch,
        "rope_theta": 0.0 if rope.theta == facts.rope_theta else rope.theta,
        "rope_scaling": "" if rope.scaling == facts.rope_scaling else rope.scaling,
    }
    if rope.scaling == "llama3":
        fields.update(
            rope_factor=rope.factor,
            rope_low_freq_factor=rope.low_freq_factor,
            rope_high_freq_factor=rope.high_freq_factor,
            rope_original_seq_len=rope.original_seq_len,
        )
    return fields


def llama_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama directory from its config.json (no tensors read); ValueError for
    anything our Llama cannot represent exactly."""
    cfg_file, hf = read_config_json(path)
    rows = hf_int(cfg_file, hf, "vocab_size", 1, MAX_VOCAB)
    d = hf_int(cfg_file, hf, "hidden_size", 1, MAX_WIDTH)
    f = hf_int(cfg_file, hf, "intermediate_size", 1, MAX_WIDTH)
    n_layers = hf_int(cfg_file, hf, "num_hidden_layers", 1, MAX_LAYERS)
    n_heads = hf_int(cfg_file, hf, "num_attention_heads", 1, d)
    n_kv = hf_int(cfg_file, hf, "num_key_value_heads", 1, n_heads, default=n_heads)
    head_dim = hf_int(cfg_file, hf, "head_dim", 0, MAX_WIDTH, default=0) or d // n_heads
    rope = _rope(hf, cfg_file)
    types = " or ".join(repr(t) for t in MODEL_TYPES.values())
    checks = [
        (hf.get("model_type") in MODEL_TYPES.values(), f"model_type={hf.get('model_type')!r} (need {types})"),
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')!r} (need 'silu')"),
        (not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention_bias/mlp_bias (need none)"),
        (not hf.get("use_sliding_window"), "use_sliding_window (need false)"),
        (head_dim % 2 == 0, f"head_dim={head_dim} (need an even size)"),
        (n_heads % n_kv == 0, f"num_key_value_heads={n_kv} does not divide num_attention_heads={n_heads}"),
    ]
    for ok, what in checks:
        if not ok:
            raise ValueError(f"{cfg_file}: {what} is not supported")
    vocab = hf_int(cfg_file, hf, "scaletrain_vocab_size", 1, rows, default=rows)
    recorded = hf_int(cfg_file, hf, "scaletrain_vocab_multiple", 1, rows, default=0)
    cfg = ModelConfig(
        **_arch_and_rope_fields(hf, rope),
        n_layers=n_layers,
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=0 if head_dim * n_heads == d else head_dim,
        d_ff=f,
        seq_len=hf_int(cfg_file, hf, "max_position_embeddings", 1, MAX_POSITIONS, default=2048),
        vocab_size=vocab,
        vocab_multiple=vocab_multiple_for(vocab, rows, recorded),
        ln_eps=hf_float(cfg_file, hf, "rms_norm_eps", 0, 1, default=1e-6, hi_open=True),
        init_std=hf_float(cfg_file, hf, "initializer_range", 0, 1, default=0.02),
    )
    factors = (rope.factor, rope.low_freq_factor, rope.high_freq_factor)
    problems = list(architectures.rope_problems(cfg))
    if not all(map(math.isfinite, factors)):
        problems.append(f"llama3 factors {factors} (need finite numbers)")
    if problems:
        raise ValueError(f"{cfg_file}: {problems[0]} is not supported")
    return check_model_config(cfg_file, cfg)


def import_llama_hf(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Llama directory into (ModelConfig, scaletrain llama state dict).

    Tensors keep their stored dtype. A tied HF head (tie_word_embeddings) becomes an untied copy. Raises
    FileNotFoundError for missing files and ValueError for anything our Llama cannot represent exactly
    (biases, a rotary scaling other than llama3, an odd head_dim, sliding windows, another activation).
    """
    path = Path(path)
    cfg = llama_config(path)
    n_layers, n_heads, n_kv = cfg.n_layers, cfg.n_heads, cfg.kv_heads
    source, tensors = load_tensors(path)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}  # old saves carry it
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    shapes = expected_shapes(cfg)

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise ValueError(f"{source}: missing tensor {key!r}")
        return tensors.pop(key)

    sd = {"embed.tok.weight": take("model.embed_tokens.weight")}
    for i in range(n_layers):
        ours, hf_p = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in plain_names(cfg).items():
            sd[f"{ours}{a}.weight"] = take(f"{hf_p}{b}.weight")
        q, k, v = (take(f"{hf_p}self_attn.{n}_proj.weight") for n in "qkv")
        if k.shape != v.shape or q.shape[0] != n_heads * (k.shape[0] // n_kv):
            raise ValueError(
                f"{source}: layer {i} q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} "
                f"do not fit {n_heads} heads, {n_kv} kv heads"
            )
        sd[ours + "attn.qkv.weight"] = fuse_qkv(q, k, v, n_kv)
        gate, up = take(f"{hf_p}mlp.gate_proj.weight"), take(f"{hf_p}mlp.up_proj.weight")
        if gate.shape != up.shape:
            raise ValueError(f"{source}: layer {i} gate/up shapes differ: {tuple(gate.shape)} vs {tuple(up.shape)}")
        sd[ours + "mlp.fc.weight"] = torch.stack([gate, up], dim=1).reshape(-1, gate.shape[-1])
    sd["ln_f.weight"] = take("model.norm.weight")
    sd["head.weight"] = take("lm_head.weight")
    if tensors:
        raise ValueError(f"{source}: unexpected tensors {sorted(tensors)[:5]}")
    for key, shape in shapes.items():
        if tuple(sd[key].shape) != shape:
            raise ValueError(f"{source}: {key} has shape {tuple(sd[key].shape)}, config.json implies {shape}")
    return cfg, {k: v.contiguous() for k, v in sd.items()}
