"""Hugging Face GPT-2 export/import: transformers loads the export with equal logits, and it round-trips exactly."""

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402

from scaletrain.checkpoint.hf import export_hf, import_hf  # noqa: E402
from scaletrain.checkpoint.hf import gpt2 as hf_gpt2  # noqa: E402
from scaletrain.config import resolve  # noqa: E402
from scaletrain.model.gpt import GPT  # noqa: E402
from scaletrain.model.loss import loss_sum  # noqa: E402

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=300"]


def trained(extra=()):
    """A tiny GPT moved off its init by two AdamW steps, so biases and LayerNorms are not 0/1."""
    cfg = resolve("gpt3-proxy", overrides=TINY + list(extra)).model
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
        opt.zero_grad()
        loss_sum(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
    # The key third of qkv.bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by all keys),
    # so whether Adam moves it hangs on rounding, which follows the thread count an earlier test left. Nudge every
    # parameter so that none stays at its 0/1 init whatever the order of the tests.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand(p.shape, generator=g) * 1e-3 + 1e-4)
    model.eval()
    assert model.blocks["0"].attn.qkv.bias.abs().min() > 0 and model.ln_f.weight.ne(1).all()
    return cfg, model


@pytest.fixture(scope="module")
def tiny():
    return trained()


# d_ff != 4*d_model (HF n_inner) and a vocabulary that is already a multiple of 128 (no padding rows).
@pytest.fixture(scope="module", params=["padded-vocab", "n_inner-unpadded"])
def either(request, tiny):
    return (
        tiny
        if request.param == "padded-vocab"
        else trained(["model.d_ff=96", "model.vocab_size=256", "model.n_heads=2"])
    )


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_transformers_loads_export_with_equal_logits(tmp_path, either, tokens):
    transformers = pytest.importorskip("transformers")
    cfg, model = either
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    assert meta["vocab_size"] == cfg.padded_vocab and meta["scaletrain_vocab_size"] == cfg.vocab_size
    assert meta["n_inner"] == (cfg.d_ff or None)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert hf.lm_head.weight is hf.transformer.wte.weight
    hf.eval()
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_export_without_qkv_permutation_would_be_caught(tmp_path, tiny, tokens, monkeypatch):
    """The logits check above can fail: skipping the head-major -> qkv-major permutation changes the logits."""
    transformers = pytest.importorskip("transformers")
    cfg, model = tiny
    monkeypatch.setattr(hf_gpt2, "_qkv_rows", lambda t, n_heads, to_hf: t)
    hf = transformers.GPT2LMHeadModel.from_pretrained(export_hf(model.state_dict(), cfg, tmp_path / "hf")).eval()
    with torch.no_grad():
        assert not torch.allclose(hf(input_ids=tokens).logits, model(tokens), atol=1e-4)


def test_round_trip_is_exact(tmp_path, either, tokens):
    cfg, model = either
    sd = state(model)
    cfg2, sd2 = import_hf(export_hf(sd, cfg, tmp_path / "hf"))
    assert cfg2 == cfg and cfg2.padded_vocab == cfg.padded_vocab
    assert sd2.keys() == sd.keys()
    assert all(torch.equal(sd2[k], sd[k]) for k in sd)
    assert sd2["head.weight"] is sd2["embed.tok.weight"]
    loaded = GPT(cfg2, seed=1)
    loaded.load_state_dict(sd2)
    assert loaded.head_is_tied
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens), model(tokens))


def test_bf16_export_round_trips_in_bf16(tmp_path, tiny):
    cfg, model = tiny
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, sd = import_hf(out)
    assert all(torch.equal(sd[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())


@pytest.mark.parametrize("vocab,multiple", [(301, 1), (384, 128), (320, 64)])
def test_import_of_a_transformers_save(tmp_path, tokens, vocab, multiple):
    """A directory written by transformers itself (no scaletrain keys): vocab_multiple reproduces the rows."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=128,
            activation_function="gelu_pytorch_tanh",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # nonzero biases, LayerNorms off (1, 0)
    hf.save_pretrained(tmp_path / "hf")
    cfg, sd = import_hf(tmp_path / "hf")
    assert (cfg.vocab_size, cfg.vocab_multiple, cfg.padded_vocab, cfg.d_ff) == (vocab, multiple, vocab, 128)
    ours = GPT(cfg)
    ours.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), hf(input_ids=tokens).logits, atol=1e-4, rtol=0)


def test_pytorch_model_bin_of_tensors_is_accepted(tmp_path, tiny):
    cfg, model = tiny
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf")
    # OpenAI-converted style: no "transformer." prefix, causal-mask buffers present, lm_head written out.
    saved = safetensors.torch.load_file(out / "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in saved.items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    torch.save(tensors, out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    _, sd = import_hf(out)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


class Payload:
    """Would create a directory when unpickled: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pytorch_model_bin_with_pickled_object_is_refused(tmp_path, tiny):
    cfg, model = tiny
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf")
    (out / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"transformer.wte.weight": Payload(marker)}, out / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: refused.*weights_only") as e:
        import_hf(out)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_export_names_key_and_shapes_on_mismatch(tmp_path, tiny):
    cfg, model = tiny
    sd = state(model)
    sd["blocks.1.mlp.fc.weight"] = torch.zeros(255, 64)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.fc\.weight has shape \(255, 64\), config expects \(256, 6"):
        export_hf(sd, cfg, tmp_path / "hf")
    del sd["blocks.1.mlp.fc.weight"]
    with pytest.raises(ValueError, match=r"missing \['blocks\.1\.mlp\.fc\.weight'\]"):
        export_hf(sd, cfg, tmp_path / "hf")
    sd = state(model)
    sd["head.weight"] = sd["embed.tok.weight"] + 1
    with pytest.raises(ValueError, match="tied"):
        export_hf(sd, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_import_rejects_unsupported_or_incomplete(tmp_path, tiny):
    cfg, model = tiny
    out = export_hf(model.state_dict(), cfg, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**meta, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type='llama' is not supported"):
        import_hf(out)
    (out / "config.json").write_text(json.dumps({**meta, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function='relu'"):
        import_hf(out)
    (out / "config.json").write_text(json.dumps(meta))
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    del tensors["transformer.h.1.ln_2.bias"]
    safetensors.torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor 'h\.1\.ln_2\.bias'"):
        import_hf(out)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        import_hf(tmp_path / "nowhere")
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        import_hf(out)


def test_failed_export_leaves_previous_export_intact(tmp_path, tiny, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg, model = tiny
    sd = state(model)
    out = export_hf(sd, cfg, tmp_path / "hf")
    changed = {k: v + 1 for k, v in sd.items()}

    def half_write(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        export_hf(changed, cfg, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
    _, back = import_hf(out)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    _, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    monkeypatch.undo()
    export_hf(changed, cfg, out, overwrite=True)  # a successful export replaces the old one's files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    _, back = import_hf(out)
    assert torch.equal(back["ln_f.bias"], changed["ln_f.bias"])


def test_export_refuses_to_replace_a_foreign_directory(tmp_path, tiny):
    cfg, model = tiny
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty"):
        export_hf(model.state_dict(), cfg, tmp_path / "hf")
    assert (tmp_path / "hf" / "notes.txt").read_text() == "keep me"
