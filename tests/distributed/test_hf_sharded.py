"""Sharded Hugging Face I/O on 4 gloo ranks: each rank reads (and writes) only its own slices.

`checkpoint.init_from` of an HF directory under FSDP4 and TP2 x FSDP2 with activation checkpointing (Llama
single-file and index-sharded, GPT-2):
the bytes each rank reads through safetensors are counted; every byte is read exactly once (or once per replica
of the tensors the layout replicates), no rank reads more than its shards, and the loaded model equals the
single-process import bitwise. The sharded export of that model equals the single-process export tensor by
tensor, with no gather (DTensor.full_tensor/redistribute raise while it runs), and transformers loads it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from launch import run_ranks

pytest.importorskip("safetensors")

LLAMA = [
    "model.vocab_size=250",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=96",
    "model.seq_len=32",
]
GPT = ["model.vocab_size=250", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32"]
MODELS = {"llama": ("llama-proxy", LLAMA), "llama_index": ("llama-proxy", LLAMA), "gpt2": ("gpt3-proxy", GPT)}
# Activation checkpointing wraps the blocks: the state-dict names change, the loader must see through it.
LAYOUTS = {
    "fsdp4": ["parallel.dp_shard=4"],
    "tp2_fsdp2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.activation_checkpoint=full"],
}


def _cfg(model, layout):
    from scaletrain.config import resolve

    preset, extra = MODELS[model]
    return resolve(
        preset,
        overrides=[
            *extra,
            *LAYOUTS[layout],
            "train.dtype=fp32",
            "train.threads=1",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
        ],
    )


def _build(model, layout, world_size):
    from scaletrain.parallel.layout import Layout
    from scaletrain.parallel.parallelize import parallelize

    cfg = _cfg(model, layout)
    layout_ = Layout.from_config(cfg, world_size)
    pm, _ = parallelize(cfg, layout_, layout_.build_mesh("cpu"), torch.device("cpu"), seed=11)
    return cfg, pm.parts


class _Counting:
    """safe_open whose slices count the bytes of every tensor they return."""

    def __init__(self, real, counter):
        self.real, self.counter = real, counter

    def __call__(self, *args, **kwargs):
        counting = self

        class Handle:
            def __init__(self, inner):
                self.inner = inner

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def get_slice(self, name):
                sl = self.f.get_slice(name)

                class Slice:
                    def __getitem__(self, idx):
                        t = sl[idx]
                        counting.counter[0] += t.numel() * t.element_size()
                        return t

                    def __getattr__(self, name):  # get_shape, get_dtype: header only
                        return getattr(sl, name)

                return Slice()

            def __getattr__(self, name):
                return getattr(self.f, name)

        return Handle(self.real(*args, **kwargs))


def load_and_export(rank, world_size, dirs, layout, out_root):
    """Load every HF directory in `dirs` through checkpoint.init_from under `layout`, counting the bytes read;
    compare with the single-process import; export the loaded model sharded with gathering disabled."""
    import safetensors
    from torch.distributed.tensor import DTensor

    from scaletrain.checkpoint.hf import importer
    from scaletrain.checkpoint.hf.sharded import model_tensors
    from scaletrain.checkpoint.hf.sharded_export import export_hf_sharded
    from scaletrain.checkpoint.init_from import load_init_weights

    results = {}
    real_open = safetensors.safe_open
    for model, path in dirs.items():
        cfg, parts = _build(model, layout, world_size)
        counter = [0]
        safetensors.safe_open = _Counting(real_open, counter)
        try:
            load_init_weights(parts, cfg.model, path)
        finally:
            safetensors.safe_open = real_open
        _, ref = importer(json.load(open(f"{path}/config.json"))["model_type"])(path)
        differ = [
            k
            for k, v in model_tensors(parts[0])
            if not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, ref[k])
        ]
        # Bytes (fp32 files) of the tensors the layout replicates along a mesh dimension (TP: norms, some biases).
        params = {id(v): v for v in parts[0].parameters()}.values()
        replicated = sum(
            v.numel() * 4 for v in params if isinstance(v, DTensor) and any(p.is_replicate() for p in v.placements)
        )

        def no_gather(*a, **k):
            raise AssertionError("the sharded export gathered a tensor")

        saved = DTensor.full_tensor, DTensor.redistribute
        DTensor.full_tensor, DTensor.redistribute = no_gather, no_gather
        try:
            _, written = export_hf_sharded(parts, cfg.model, f"{out_root}/{model}_{layout}")
        finally:
            DTensor.full_tensor, DTensor.redistribute = saved
        results[model] = {"read": counter[0], "differ": differ, "replicated": replicated, "written": written}
    return results


def _tensor_bytes(path):
    """(bytes, bytes of its largest 1-D slice) per tensor of an HF directory's safetensors."""
    from safetensors import safe_open

    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (t.numel() * t.element_size(), t.numel() * t.element_size() // min(t.shape))
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A single-process export of each tiny model (norms moved off 1), plus the Llama one split into 2 files."""
    import safetensors.torch as st

    from scaletrain.checkpoint.hf import export_hf
    from scaletrain.model.build import build_model

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for model in ("llama", "gpt2"):
        cfg = _cfg(model, "fsdp4")
        net = build_model(cfg.model, seed=5)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        dirs[model] = export_hf(net.state_dict(), cfg.model, root / model)
    split = root / "llama_index"
    split.mkdir()
    (split / "config.json").write_text((dirs["llama"] / "config.json").read_text())
    tensors = st.load_file(dirs["llama"] / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: tensors[n] for n in chunk}, split / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    (split / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dirs["llama_index"] = split
    return dirs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_and_writes_its_quarter(layout, hf_dirs, tmp_path):
    import safetensors.torch as st

    transformers = pytest.importorskip("transformers")

    world = 4
    per_rank = run_ranks(
        load_and_export, world, {k: str(v) for k, v in hf_dirs.items()}, layout, str(tmp_path), timeout=400
    )
    for model, path in hf_dirs.items():
        sizes = _tensor_bytes(path)
        total = sum(b for b, _ in sizes.values())
        got = [r[model] for r in per_rank]
        read, written = [g["read"] for g in got], [g["written"] for g in got]
        assert all(not g["differ"] for g in got), f"{model}/{layout}: differs from the import: {got[0]['differ']}"
        # Each byte is read once per replica: under TP the tensors it replicates are read by both TP ranks.
        tp = 2 if layout == "tp2_fsdp2" else 1
        replicated = got[0]["replicated"]
        assert sum(read) == total + (tp - 1) * replicated, (model, layout, read, total, replicated)
        # No rank reads more than its 1/4 of every tensor (1/2 of a replicated one: rep/4 more in all), plus
        # the rounding of an uneven split: at most one slice of each tensor.
        bound = (total + (tp - 1) * replicated) / world + sum(one for _, one in sizes.values())
        assert max(read) <= bound, (model, layout, read, bound)
        print(
            f"\n{model} {layout}: bytes read per rank {read} of {total} (1/4 = {total / 4:.0f}, "
            f"bound {math.floor(bound)}); written {written}"
        )
        # The export: every byte written once, by the rank holding it, and equal to the single-process export.
        assert sum(written) == total and max(written) <= bound, (model, layout, written, total)
        out = tmp_path / f"{model}_{layout}"
        assert (out / "model.safetensors.index.json").is_file()
        mine = {n: t for f in out.glob("*.safetensors") for n, t in st.load_file(f).items()}
        ref = {n: t for f in path.glob("*.safetensors") for n, t in st.load_file(f).items()}
        assert mine.keys() == ref.keys() and all(torch.equal(mine[n], ref[n]) for n in ref), model
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"llama_{layout}")
    ref = st.load_file(hf_dirs["llama"] / "model.safetensors")
    assert all(torch.equal(v, ref[k]) for k, v in hf.state_dict().items())


def test_export_under_torchrun_equals_single_process_export(excerpt_corpus, tmp_path):
    """`scaletrain export` under torchrun (2 ranks) writes the tensors the one-process export writes; a target
    that is not an HF export is one error line from the ranks, and the run fails."""
    import os
    import subprocess
    import sys

    import safetensors.torch as st

    from scaletrain.checkpoint.hf import import_llama_hf
    from scaletrain.cli.main import main
    from scaletrain.config import resolve
    from scaletrain.train.engine import Trainer

    data = [
        f"data.train_prefix={excerpt_corpus.train_prefix}",
        f"data.valid_prefix={excerpt_corpus.valid_prefix}",
        f"data.tokenizer={excerpt_corpus.tokenizer}",
        "model.vocab_size=1024",
        "train.progress=false",
    ]
    cfg = resolve(
        "llama-proxy",
        overrides=[
            *LLAMA[1:],
            *data,
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg, cfg.train.run_dir)
    trainer.init()
    trainer.train_step()
    trainer.save_checkpoint({})
    trainer.finish({})
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "one")]) == 0

    def torchrun(out):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "scaletrain",
            "export",
            str(tmp_path / "run"),
            "--hf",
            str(out),
        ]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )

    proc = torchrun(tmp_path / "two")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("-> ") == 1 and "LlamaForCausalLM.from_pretrained" in proc.stdout  # rank 0 reports
    files = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # rank 0 wrote the same
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    one = st.load_file(tmp_path / "one" / "model.safetensors")
    two = {n: t for f in (tmp_path / "two").glob("*.safetensors") for n, t in st.load_file(f).items()}
    assert one.keys() == two.keys() and all(torch.equal(one[n], two[n]) for n in one)
    assert (tmp_path / "one" / "config.json").read_text() == (tmp_path / "two" / "config.json").read_text()
    cfg_one, sd_one = import_llama_hf(tmp_path / "one")
    cfg_two, sd_two = import_llama_hf(tmp_path / "two")
    assert cfg_one == cfg_two and all(torch.equal(sd_one[k], sd_two[k]) for k in sd_one)

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    proc = torchrun(tmp_path / "taken")
    assert proc.returncode != 0
    assert "scaletrain: error: export: " in proc.stderr and "is not empty (holds 'notes.txt')" in proc.stderr
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
