"""Qwen3 dense (model.arch "qwen3"): the shared decoder with QK-norm against Hugging Face's Qwen3ForCausalLM, through
the registry's builder and the Llama converter, both ways; and the simulator's parameter count of the preset."""

import json

import pytest
import torch

from scaletrain.config import ModelConfig, resolve
from scaletrain.model.build import build_model
from scaletrain.model.flops import num_params

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from scaletrain.checkpoint.hf import export_hf, importer  # noqa: E402

# Qwen3's proportions at toy size: a head size of its own (4 x 32 = 128 attention width over d_model 64), GQA 4:2.
TINY = ModelConfig(
    arch="qwen3",
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    d_ff=96,
    seq_len=32,
    vocab_size=256,
    ln_eps=1e-6,
    init_std=0.02,
)
ATOL = 1e-5


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def _shift_norms(named_parameters) -> None:
    """Move every norm weight (QK-norms included) off 1, so a norm left out or misplaced changes the logits."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in named_parameters:
            if "norm" in name or name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised transformers Qwen3 saved to disk."""
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    hf = transformers.Qwen3ForCausalLM(hc).eval()
    _shift_norms(hf.named_parameters())
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out)
    return out, hf


def test_import_of_transformers_qwen3_gives_equal_logits(hf_dir, tokens):
    path, hf = hf_dir
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cfg, sd = importer(model_type)(path)
    assert (cfg.arch, cfg.head_size, cfg.kv_heads, cfg.rope_base) == ("qwen3", 32, 2, 1000000.0)
    model = build_model(cfg)
    model.load_state_dict(sd)
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_export_loads_in_transformers_qwen3_with_equal_logits_and_round_trips(tokens, tmp_path):
    model = build_model(TINY, seed=3).eval()
    _shift_norms(model.named_parameters())
    out = export_hf(model.state_dict(), TINY, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    assert (meta["model_type"], meta["architectures"], meta["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    hf, info = transformers.Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        ours, theirs = model(tokens), hf.eval()(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)
    cfg, sd = importer(meta["model_type"])(out)
    assert cfg == TINY
    assert sd.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(sd[key], value), key


def test_the_simulator_counts_the_presets_qk_norm_weights():
    cfg = resolve("qwen3-proxy").model
    with torch.device("meta"):
        model = build_model(cfg)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert norms == cfg.n_layers * 2 * cfg.head_size
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
