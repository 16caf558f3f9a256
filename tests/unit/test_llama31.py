"""Llama 3.1 (model.arch "llama31"): published parameter counts, rotary base and "llama3" frequency scaling, config
validation of the rotary fields, and the dry run of its presets on H100 clusters."""

import json
import math
import os

import pytest
import torch

from scaletrain.config import ConfigError, ModelConfig, resolve
from scaletrain.model.build import build_model
from scaletrain.model.flops import num_params
from scaletrain.model.llama import Llama
from scaletrain.model.rope import Rope
from scaletrain.sim.layers import Inventory
from scaletrain.sim.workload import model_shape


@pytest.mark.parametrize("preset,published", [("llama31-8b", 8_030_261_248), ("llama31-405b", 405_853_388_800)])
def test_preset_parameter_counts_are_the_published_ones(preset, published):
    cfg = resolve(preset).model
    with torch.device("meta"):
        model = build_model(cfg)
    count = sum(p.numel() for p in model.parameters())
    print(f"{preset}: {count:,} parameters ({count / 1e9:.2f}B)")
    # Meta's model cards: 8.03B and 405.9B (128,256-row vocabulary: no padding at vocab_multiple 128).
    assert count == num_params(cfg) == published
    assert Inventory(model_shape(resolve(preset))).params == published  # the simulator's per-layer inventory
    assert (cfg.rope_base, cfg.rope_kind, cfg.padded_vocab) == (500000.0, "llama3", 128256)
    assert not model.head_is_tied


def test_architecture_defaults_resolve_and_llama2_keeps_plain_rope():
    m31 = ModelConfig(arch="llama31")
    assert (m31.rope_base, m31.rope_kind) == (500000.0, "llama3")
    m2 = ModelConfig(arch="llama")
    assert (m2.rope_base, m2.rope_kind) == (10000.0, "none")
    assert Rope.of(m2) == Rope(10000.0)
    assert Rope.of(ModelConfig(arch="llama31", rope_theta=1e6, rope_scaling="none")) == Rope(1e6)


def test_llama3_scaling_keeps_high_stretches_low_and_blends_between():
    head_dim = 128
    plain = Rope(500000.0).inv_freq(head_dim)
    scaled = Rope(500000.0, "llama3").inv_freq(head_dim)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands exist at head_dim 128
    torch.testing.assert_close(scaled[high], plain[high], atol=0, rtol=0)
    torch.testing.assert_close(scaled[low], plain[low] / 8, atol=0, rtol=0)
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()
    assert torch.all(scaled[1:] <= scaled[:-1])  # still monotone: no frequency crosses another


def test_scaling_changes_the_model_output_beyond_the_original_context():
    shape = dict(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=64, vocab_size=64, init_std=0.3)
    tokens = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = Llama(ModelConfig(arch="llama31", rope_scaling="none", **shape))(tokens)
        scaled = Llama(ModelConfig(arch="llama31", rope_original_seq_len=16, **shape))(tokens)
    assert (scaled - base).abs().max() > 1e-2  # random weights with std 0.3: attention is far from uniform


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.rope_theta=nan", r"model.rope_theta=nan: must be a finite number"),
        ("model.rope_theta=0.5", r"model.rope_theta=0.5: must be > 1 \(or 0 for the architecture's 500000\)"),
        ("model.rope_scaling=ntk", r"model.rope_scaling='ntk': must be one of \['none', 'llama3', 'yarn'\]"),
        ("model.rope_factor=0.5", r"model.rope_factor=0.5: must be >= 1"),
        ("model.rope_factor=nan", r"model.rope_factor=nan: must be a finite number"),
        ("model.rope_high_freq_factor=1.0", r"model.rope_low_freq_factor=1.0, model.rope_high_freq_factor=1.0: need 0"),
        ("model.rope_low_freq_factor=nan", r"model.rope_low_freq_factor=nan: must be a finite number"),
        ("model.rope_original_seq_len=0", r"model.rope_original_seq_len=0: must be > 0"),
    ],
)
def test_bad_rope_fields_get_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve("llama31-8b", overrides=[override])
    assert "\n" not in str(err.value)


def test_rope_fields_are_refused_without_rotary_positions_and_ignored_without_scaling():
    with pytest.raises(ConfigError, match=r"model.arch='gpt3' has no rotary positions"):
        resolve("gpt3-proxy", overrides=["model.rope_theta=500000"])
    # The llama3 factors are only read when the scaling is on.
    resolve("llama-proxy", overrides=["model.rope_factor=0.5"])


def test_dry_run_fits_the_presets_on_h100(capsys):
    from scaletrain.cli.main import main

    assert main(["train", "--dry-run", "--json", "--world-size", "64", "--gpu", "h100", "--preset", "llama31-8b"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    # 126 layers split evenly into 2 stages; 8,192 GPUs = tp 8 x cp 4 x pp 2 x 128-way FSDP (GBS 1,152 = 128 x 9).
    flags = ["--set", "parallel.tp=8", "--set", "parallel.pp=2", "--set", "parallel.cp=4"]
    assert (
        main(
            [
                "train",
                "--dry-run",
                "--json",
                "--world-size",
                "8192",
                "--gpu",
                "h100",
                "--preset",
                "llama31-405b",
                *flags,
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["degrees"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 128, "cp": 4, "tp": 8}


# ------------------------------------------------------------------ Hugging Face parity (rope_type "llama3")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from scaletrain.checkpoint.hf import export_hf, import_llama_hf  # noqa: E402
from scaletrain.checkpoint.hf.sharded import load_hf_sharded  # noqa: E402
from scaletrain.checkpoint.hf.sharded_export import export_hf_sharded  # noqa: E402

# 64 tokens against an original context of 16: every band of the llama3 scaling is in play (head_dim 16).
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
TINY31 = ModelConfig(
    arch="llama31",
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    d_ff=128,
    seq_len=64,
    vocab_size=256,
    init_std=0.1,
    rope_original_seq_len=16,
)
ATOL = 1e-5


@pytest.fixture(scope="module")
def tokens64():
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf31(tmp_path_factory):
    """A random transformers Llama with Llama 3.1's rotary settings (RMSNorm weights moved off 1), saved."""
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.1,
        rope_theta=500000.0,
        rope_scaling=dict(SCALING),
    )
    hf = transformers.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf31")
    hf.save_pretrained(out)
    return out, hf


def _ours31(seed=0):
    model = Llama(TINY31, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model.eval()


def test_import_of_a_transformers_llama31_gives_equal_logits_directly_and_sharded(hf31, tokens64):
    path, hf = hf31
    cfg, sd = import_llama_hf(path)
    assert (cfg.arch, cfg.rope_base, cfg.rope_kind, cfg.rope_original_seq_len) == ("llama31", 500000.0, "llama3", 16)
    model = Llama(cfg)
    model.load_state_dict(sd)
    sharded = build_model(cfg, seed=5)
    got_cfg, _ = load_hf_sharded([sharded], path)
    assert got_cfg == cfg
    with torch.no_grad():
        theirs = hf(input_ids=tokens64).logits
        for ours in (model.eval()(tokens64), sharded.eval()(tokens64)):
            print(f"HF -> scaletrain max abs logit diff {(ours - theirs).abs().max().item():.2e}")
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        # The test can fail: the same weights without the frequency scaling give other logits.
        plain = Llama(ModelConfig(**{**cfg.__dict__, "rope_scaling": "none"}))
        plain.load_state_dict(sd)
        assert (plain.eval()(tokens64) - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("how", ["export", "sharded_export"])
def test_export_of_llama31_loads_in_transformers_with_equal_logits_and_round_trips(how, tokens64, tmp_path):
    model = _ours31()
    if how == "export":
        out = export_hf(model.state_dict(), TINY31, tmp_path / "hf")
    else:
        out, _ = export_hf_sharded([model], TINY31, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    assert meta["rope_theta"] == 500000.0 and meta["rope_scaling"] == SCALING
    assert meta["rope_parameters"] == {**SCALING, "rope_theta": 500000.0}
    hf, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        ours, theirs = model(tokens64), hf.eval()(input_ids=tokens64).logits
    print(f"scaletrain -> HF ({how}) max abs logit diff {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)
    cfg, sd = import_llama_hf(out)
    assert cfg == TINY31
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_transformers_4_style_config_and_unsupported_scalings(hf31, tmp_path):
    path, _ = hf31
    meta = json.loads((path / "config.json").read_text())
    del meta["rope_parameters"]  # what transformers 4.x writes: rope_theta and rope_scaling
    cases = [
        ({"rope_theta": 500000.0, "rope_scaling": dict(SCALING)}, None),
        (
            {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rotary scaling 'yarn' is not supported",
        ),
        (
            {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"llama3 rotary scaling is missing 'low_freq_factor'",
        ),
        ({"rope_theta": 500000.0, "rope_scaling": {**SCALING, "factor": 0.5}}, r"rope_factor=0.5: must be >= 1"),
        ({"rope_theta": float("nan")}, r"rope_theta=nan is not supported \(need a finite number in \(1, "),
    ]
    for i, (change, error) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**meta, **change}))
        # A hard link: a symlink out of the directory is refused (checkpoint/hf/common.hf_file).
        os.link(path / "model.safetensors", d / "model.safetensors")
        if error is None:
            cfg, _ = import_llama_hf(d)
            assert (cfg.arch, cfg.rope_base, cfg.rope_kind, cfg.rope_factor) == ("llama31", 500000.0, "llama3", 8.0)
        else:
            with pytest.raises(ValueError, match=error):
                import_llama_hf(d)


def test_init_from_refuses_weights_trained_with_other_rotary_frequencies():
    from scaletrain.checkpoint.init_from import check_compatible
    from scaletrain.checkpoint.store import CheckpointError

    check_compatible(TINY31, ModelConfig(**{**TINY31.__dict__, "rope_theta": 500000.0, "rope_scaling": "llama3"}), "x")
    for change, what in [
        ({"rope_theta": 1e6}, "rope_base 1000000.0 != 500000.0"),
        ({"rope_scaling": "none"}, "rope_kind none != llama3"),
        ({"rope_original_seq_len": 8192}, "rope_original_seq_len 8192 != 16"),
    ]:
        with pytest.raises(CheckpointError, match=what):
            check_compatible(TINY31, ModelConfig(**{**TINY31.__dict__, **change}), "x")
