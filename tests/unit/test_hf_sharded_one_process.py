"""The sharded Hugging Face reader in one process: the same state as the import, every byte read once, and bad
directories (missing shard, wrong shape, missing tensor, truncated file) refused in one line naming the file."""

import json

import pytest
import torch

pytest.importorskip("safetensors")
import safetensors.torch as st  # noqa: E402

from scaletrain.checkpoint.hf import export_hf, import_gpt2_hf, import_llama_hf  # noqa: E402
from scaletrain.checkpoint.hf.sharded import load_hf_sharded  # noqa: E402
from scaletrain.config import ModelConfig  # noqa: E402
from scaletrain.model.build import build_model  # noqa: E402

LLAMA = ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, seq_len=32, vocab_size=250)
GPT = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=250)
LLAMA31 = ModelConfig(
    arch="llama31",
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    d_ff=96,
    seq_len=32,
    vocab_size=250,
    rope_original_seq_len=8,
)


def _export(cfg, out):
    model = build_model(cfg, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return export_hf(model.state_dict(), cfg, out)


def _split(src, out):
    """`src`'s tensors in two files and an index, as save_pretrained shards a big model."""
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    tensors = st.load_file(src / "model.safetensors")
    names, weight_map = sorted(tensors), {}
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: tensors[n] for n in chunk}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.mark.parametrize(
    "cfg, importer",
    [(LLAMA, import_llama_hf), (LLAMA31, import_llama_hf), (GPT, import_gpt2_hf)],
    ids=["llama", "llama31", "gpt2"],
)
def test_one_rank_reads_every_byte_once_into_the_imported_state(cfg, importer, tmp_path):
    out = _export(cfg, tmp_path / "hf")
    model = build_model(cfg, seed=9)
    got_cfg, nbytes = load_hf_sharded([model], out)
    ref_cfg, ref = importer(out)
    assert got_cfg == ref_cfg
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert nbytes == sum(t.numel() * t.element_size() for t in st.load_file(out / "model.safetensors").values())


def _missing_shard(d):
    (d / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors: no such file (listed in model.safetensors.index.json)"


def _wrong_shape(d):
    f = d / "model-00001-of-00002.safetensors"
    t = st.load_file(f)
    t["lm_head.weight"] = t["lm_head.weight"][:-1].clone()
    st.save_file(t, f, metadata={"format": "pt"})
    return "model-00001-of-00002.safetensors: lm_head.weight has shape (255, 64), config.json implies (256, 64)"


def _missing_tensor(d):
    f = d / "model-00002-of-00002.safetensors"
    t = st.load_file(f)
    del t["model.norm.weight"]
    st.save_file(t, f, metadata={"format": "pt"})
    return "model-00002-of-00002.safetensors: missing tensor 'model.norm.weight' (listed in model.safetensors.index"


def _truncated(d):
    f = d / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    return "model-00002-of-00002.safetensors: Error while deserializing header"


@pytest.mark.parametrize(
    "damage",
    [_missing_shard, _wrong_shape, _missing_tensor, _truncated],
    ids=["missing_shard", "wrong_shape", "missing_tensor", "truncated"],
)
def test_bad_directory_is_one_line_naming_the_file(damage, tmp_path, monkeypatch):
    from scaletrain.checkpoint.init_from import load_init_weights
    from scaletrain.checkpoint.store import CheckpointError

    d = _split(_export(LLAMA, tmp_path / "hf"), tmp_path / "split")
    expected = damage(d)
    with pytest.raises(ValueError) as err:
        load_hf_sharded([build_model(LLAMA)], d)
    assert expected in str(err.value) and str(d) in str(err.value)
    # What a distributed run's init_from reports (the checks come before any collective).
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(CheckpointError) as err:
        load_init_weights([build_model(LLAMA)], LLAMA, str(d))
    assert str(err.value).startswith(f"checkpoint.init_from={d}: ") and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_gpt2_lm_head_must_equal_wte(tmp_path):
    out = _export(GPT, tmp_path / "hf")
    tensors = st.load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    st.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    model = build_model(GPT)
    load_hf_sharded([model], out)
    assert torch.equal(model.state_dict()["embed.tok.weight"], tensors["transformer.wte.weight"])
    tensors["lm_head.weight"][3, 5] += 1
    st.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: lm_head\.weight differs from wte\.weight"):
        load_hf_sharded([build_model(GPT)], out)
