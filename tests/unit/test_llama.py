"""The Llama model: Hugging Face LlamaForCausalLM parity both ways, parameter count, RoPE positions, TP row order."""

import json

import pytest
import torch

from scaletrain.config import ConfigError, ModelConfig, resolve
from scaletrain.model.build import build_model
from scaletrain.model.flops import num_params
from scaletrain.model.llama import Llama
from scaletrain.model.loss import loss_sum

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from scaletrain.checkpoint.hf import export_hf, export_llama_hf, import_llama_hf  # noqa: E402

TINY = ModelConfig(
    arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32, vocab_size=256, init_std=0.02
)
ATOL = 1e-5


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A randomly initialised transformers Llama (GQA 4:2, RMSNorm weights moved off 1) saved to disk."""
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out)
    return out, hf


@pytest.fixture(scope="module")
def trained():
    """A tiny Llama moved off its init by two AdamW steps (RMSNorm weights no longer 1)."""
    model = Llama(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=g)
        opt.zero_grad()
        loss_sum(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    assert model.ln_f.weight.ne(1).all()
    return model.eval()


def test_import_of_transformers_llama_gives_equal_logits(hf_dir, tokens):
    path, hf = hf_dir
    cfg, sd = import_llama_hf(path)
    assert (cfg.arch, cfg.n_heads, cfg.kv_heads, cfg.ffn_size, cfg.padded_vocab) == ("llama", 4, 2, 128, 256)
    model = Llama(cfg)
    model.load_state_dict(sd)
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_export_loads_in_transformers_with_equal_logits_and_round_trips(trained, tokens, tmp_path):
    out = export_hf(trained.state_dict(), TINY, tmp_path / "hf")  # the CLI's entry point dispatches on arch
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    hf, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        ours, theirs = trained(tokens), hf.eval()(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)
    cfg, sd = import_llama_hf(out)
    assert cfg == TINY
    for key, value in trained.state_dict().items():
        assert torch.equal(sd[key], value), key


def test_import_refuses_what_llama_cannot_represent(hf_dir, tmp_path):
    path, _ = hf_dir
    meta = json.loads((path / "config.json").read_text())
    for change in (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}},
        {"attention_bias": True},
        {"model_type": "mistral"},
    ):
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(ValueError, match="not supported"):
            import_llama_hf(bad)
    with pytest.raises(ValueError, match="missing"):
        export_llama_hf({}, TINY, tmp_path / "x")


@pytest.mark.parametrize("preset", ["llama-proxy", "llama2-7b", "llama2-70b"])
def test_parameter_count_matches_flops_formula(preset):
    cfg = resolve(preset).model
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    if preset == "llama2-7b":
        assert num_params(cfg) == 6_738_415_616  # Meta's Llama-2-7b parameter count


def test_shapes_and_untied_head():
    model = Llama(TINY)
    hd = 64 // 4
    assert model.blocks["0"].attn.qkv.weight.shape == ((4 + 2 * 2) * hd, 64)
    assert model.blocks["0"].mlp.fc.weight.shape == (2 * 128, 64)
    assert model.head.weight is not model.embed.tok.weight and not model.head_is_tied
    assert model.embed.pos is None  # rotary positions: no learned table
    assert model.blocks["0"].ln1.weight.eq(1).all()
    w = model.blocks["1"].attn.qkv.weight
    assert abs(w.std().item() - TINY.init_std) < 0.002


def test_rotary_positions_are_relative_and_reach_every_layer(trained, tokens):
    with torch.no_grad():
        base = trained(tokens)
        shifted = trained(tokens, positions=torch.arange(32) + 7)  # RoPE scores depend on offsets only
        permuted = trained(tokens, positions=torch.arange(32).flip(0))
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=0)
    assert (permuted - base).abs().max() > 1e-2


def test_attention_takes_positions_from_a_sequence_sharded_core(trained, tokens):
    """A pipeline stage without the embedding gets positions only from the core (context parallelism's)."""
    from scaletrain.model.common import causal_attention

    attn = trained.blocks["0"].attn
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(32) * 3

    class Core:
        def __call__(self, q, k, v):
            return causal_attention(q, k, v)

        def positions(self, s, device):
            return pos[:s]

    try:
        attn.core = Core()
        with torch.no_grad():
            from_core = attn(x)
    finally:
        attn.core = causal_attention
    with torch.no_grad():
        torch.testing.assert_close(from_core, attn(x, positions=pos), atol=0, rtol=0)


@pytest.mark.parametrize("tp", [2])
def test_contiguous_row_shards_are_whole_kv_groups_and_swiglu_pairs(trained, tp):
    """Megatron TP by hand: row shards of qkv/fc and column shards of proj, summed, give the full output."""
    block = trained.blocks["1"]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full_attn, full_mlp = block.attn(x), block.mlp(x)
        parts_attn, parts_mlp = [], []
        for r in range(tp):
            a = Llama(TINY).blocks["1"]
            a.load_state_dict(block.state_dict())
            for lin in (a.attn.qkv, a.mlp.fc):
                lin.weight = torch.nn.Parameter(lin.weight.chunk(tp, 0)[r])
            for lin in (a.attn.proj, a.mlp.proj):
                lin.weight = torch.nn.Parameter(lin.weight.chunk(tp, 1)[r])
            parts_attn.append(a.attn(x))
            parts_mlp.append(a.mlp(x))
    torch.testing.assert_close(sum(parts_attn), full_attn, atol=ATOL, rtol=0)
    torch.testing.assert_close(sum(parts_mlp), full_mlp, atol=ATOL, rtol=0)


def test_layout_needs_tp_to_divide_kv_heads():
    from scaletrain.parallel.layout import Layout

    Layout.from_config(resolve("llama-proxy", overrides=["parallel.tp=2"]), 2)
    with pytest.raises(ConfigError, match="key/value heads 2"):
        Layout.from_config(
            resolve("llama-proxy", overrides=["model.n_heads=8", "model.n_kv_heads=2", "parallel.tp=4"]), 4
        )
