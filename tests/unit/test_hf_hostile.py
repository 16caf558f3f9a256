"""Crafted or careless Hugging Face directories given to `train --set checkpoint.init_from=DIR` (issue 25, finding 5).

Each case damages a private copy of a valid tiny export, then runs the CLI: exit 2, ONE line on stderr that names
the file and the field, and the directory unchanged. Before the fix these hung (10**7 layers, a FIFO shard), were
tracebacks (n_head=0, 10**5-deep JSON, a rope_scaling string, a weight_map list), read files outside the directory
(`..`, absolute and symlinked shard names), or were silently accepted (n_embd=64.7 truncated, layer_norm_epsilon
0.5 or NaN replaced by the run's). Cases that could hang run in a subprocess with a timeout, so an old-code hang is
a failure, not a stuck CI job.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
import safetensors.torch as st  # noqa: E402

from scaletrain.checkpoint.hf import export_hf  # noqa: E402
from scaletrain.cli.main import main  # noqa: E402
from scaletrain.config import resolve  # noqa: E402
from scaletrain.model.build import build_model  # noqa: E402

SHAPES = {
    "gpt2": ("gpt3-proxy", ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64"]),
    "llama": (
        "llama-proxy",
        [
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.d_ff=96",
            "model.seq_len=64",
        ],
    ),
}
DELETE = object()


def _train(corpus, kind: str, hf: Path, run: Path) -> list[str]:
    """`scaletrain train` arguments: one step of the tiny `kind` model starting from Hugging Face directory `hf`."""
    over = [
        f"data.train_prefix={corpus.train_prefix}",
        f"data.valid_prefix={corpus.valid_prefix}",
        f"data.tokenizer={corpus.tokenizer}",
        "model.vocab_size=1024",
        *SHAPES[kind][1],
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.dtype=fp32",
        "train.threads=1",
        "train.max_steps=1",
        "train.progress=false",
        "train.probe_window_s=0.05",
    ]
    return [
        "train",
        "--preset",
        SHAPES[kind][0],
        "--run-dir",
        str(run),
        "--set",
        f"checkpoint.init_from={hf}",
        *(a for o in over for a in ("--set", o)),
    ]


@pytest.fixture(scope="module")
def bases(excerpt_corpus, tmp_path_factory):
    """Valid exports: gpt2 and llama (one model.safetensors) and gpt2 split in two shards with an index."""
    root = tmp_path_factory.mktemp("hf_bases")
    out = {}
    for kind, (preset, shape) in SHAPES.items():
        cfg = resolve(preset, overrides=[*shape, "model.vocab_size=1024"]).model
        out[kind] = export_hf(build_model(cfg, seed=1).state_dict(), cfg, root / kind)
    split = root / "gpt2_split"
    split.mkdir()
    shutil.copy(out["gpt2"] / "config.json", split / "config.json")
    tensors = st.load_file(out["gpt2"] / "model.safetensors")
    names, weight_map = sorted(tensors), {}
    for i, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        st.save_file({n: tensors[n] for n in chunk}, split / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    (split / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out["gpt2_split"] = split
    return out


@contextlib.contextmanager
def _alarm(seconds: int):
    """Raise TimeoutError in this (main) thread after `seconds`: a Python loop that would hang fails instead."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s (hangs)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict:
    """Every entry under `root` (not following links): kind, size, mtime and, for a file, its bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        s = path.lstat()
        kind = "link" if path.is_symlink() else "fifo" if path.is_fifo() else "dir" if path.is_dir() else "file"
        body = path.read_bytes() if kind == "file" else os.readlink(path) if kind == "link" else None
        found[str(path.relative_to(root))] = (kind, s.st_size, s.st_mtime_ns, body)
    return found


def _config(d: Path, **fields) -> None:
    hf = json.loads((d / "config.json").read_text())
    for key, value in fields.items():
        if value is DELETE:
            hf.pop(key, None)
        else:
            hf[key] = value
    (d / "config.json").write_text(json.dumps(hf))  # NaN/Infinity as Python's json writes them


def _index(d: Path, change) -> None:
    path = d / "model.safetensors.index.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _second_shard(doc: dict) -> str:
    return sorted(set(doc["weight_map"].values()))[1]


def _rename_shard(d: Path, new_name_of) -> None:
    """List the second shard under another name (`new_name_of(dir, shard path)` puts the file there)."""

    def change(doc):
        old = _second_shard(doc)
        new = new_name_of(d, d / old)
        doc["weight_map"] = {k: (new if v == old else v) for k, v in doc["weight_map"].items()}

    _index(d, change)


def _outside_parent(d: Path, shard: Path) -> str:
    shard.rename(d.parent / "stolen.safetensors")  # a file that is not the directory's, read through `..`
    return "../stolen.safetensors"


def _outside_absolute(d: Path, shard: Path) -> str:
    shard.rename(d.parent / "stolen.safetensors")
    return str(d.parent / "stolen.safetensors")


def _outside_symlink(d: Path, shard: Path) -> str:
    shard.rename(d.parent / "stolen.safetensors")
    (d / "link.safetensors").symlink_to(d.parent / "stolen.safetensors")
    return "link.safetensors"


def _subdir(d: Path, shard: Path) -> str:
    (d / "sub").mkdir()
    shard.rename(d / "sub" / shard.name)
    return f"sub/{shard.name}"


def _a_directory(d: Path, shard: Path) -> str:
    (d / "adir.safetensors").mkdir()
    return "adir.safetensors"


def _single_symlink_out(d: Path) -> None:
    (d / "model.safetensors").rename(d.parent / "elsewhere.safetensors")
    (d / "model.safetensors").symlink_to(d.parent / "elsewhere.safetensors")


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# (case id, base directory, damage(dir), substrings the one error line must hold besides "scaletrain: error: ")
CASES = [
    # ---- gpt2 config.json: shapes bounded and typed before anything is built from them
    ("n_head_zero", "gpt2", lambda d: _config(d, n_head=0), ["config.json", "n_head=0"]),
    ("n_head_negative", "gpt2", lambda d: _config(d, n_head=-2), ["config.json", "n_head=-2"]),
    ("n_head_float", "gpt2", lambda d: _config(d, n_head=2.9), ["config.json", "n_head=2.9"]),
    ("n_head_string", "gpt2", lambda d: _config(d, n_head="2"), ["config.json", "n_head='2'"]),
    ("n_embd_fraction", "gpt2", lambda d: _config(d, n_embd=64.7), ["config.json", "n_embd=64.7"]),
    ("n_embd_float_integral", "gpt2", lambda d: _config(d, n_embd=64.0), ["config.json", "n_embd=64.0"]),
    ("n_embd_string", "gpt2", lambda d: _config(d, n_embd="64"), ["config.json", "n_embd='64'"]),
    ("n_embd_list", "gpt2", lambda d: _config(d, n_embd=[64]), ["config.json", "n_embd=[64]"]),
    ("n_embd_huge", "gpt2", lambda d: _config(d, n_embd=10**30), ["config.json", "n_embd="]),
    ("n_layer_1e7", "gpt2", lambda d: _config(d, n_layer=10**7), ["config.json", "n_layer=10000000"]),
    (
        "llama_layers_1e7",
        "llama",
        lambda d: _config(d, num_hidden_layers=10**7),
        ["config.json", "num_hidden_layers=10000000"],
    ),
    ("n_layer_float", "gpt2", lambda d: _config(d, n_layer=2.0), ["config.json", "n_layer=2.0"]),
    ("n_layer_string", "gpt2", lambda d: _config(d, n_layer="2"), ["config.json", "n_layer='2'"]),
    ("n_layer_null", "gpt2", lambda d: _config(d, n_layer=None), ["config.json", "missing 'n_layer'"]),
    ("vocab_size_fraction", "gpt2", lambda d: _config(d, vocab_size=1024.5), ["config.json", "vocab_size=1024.5"]),
    ("vocab_size_string", "gpt2", lambda d: _config(d, vocab_size="1024"), ["config.json", "vocab_size='1024'"]),
    ("n_positions_fraction", "gpt2", lambda d: _config(d, n_positions=64.9), ["config.json", "n_positions=64.9"]),
    ("n_positions_huge", "gpt2", lambda d: _config(d, n_positions=10**30), ["config.json", "n_positions="]),
    ("n_inner_negative", "gpt2", lambda d: _config(d, n_inner=-1), ["config.json", "n_inner=-1"]),
    ("n_inner_fraction", "gpt2", lambda d: _config(d, n_inner=256.5), ["config.json", "n_inner=256.5"]),
    ("eps_half", "gpt2", lambda d: _config(d, layer_norm_epsilon=0.5), ["config.json", "ln_eps 0.5 != 1e-05"]),
    (
        "eps_nan",
        "gpt2",
        lambda d: _config(d, layer_norm_epsilon=float("nan")),
        ["config.json", "layer_norm_epsilon=nan"],
    ),
    (
        "eps_inf",
        "gpt2",
        lambda d: _config(d, layer_norm_epsilon=float("inf")),
        ["config.json", "layer_norm_epsilon=inf"],
    ),
    (
        "eps_negative",
        "gpt2",
        lambda d: _config(d, layer_norm_epsilon=-1e-5),
        ["config.json", "layer_norm_epsilon=-1e-05"],
    ),
    ("eps_zero", "gpt2", lambda d: _config(d, layer_norm_epsilon=0), ["config.json", "layer_norm_epsilon=0"]),
    ("eps_one", "gpt2", lambda d: _config(d, layer_norm_epsilon=1.0), ["config.json", "layer_norm_epsilon=1.0"]),
    (
        "eps_string",
        "gpt2",
        lambda d: _config(d, layer_norm_epsilon="1e-5"),
        ["config.json", "layer_norm_epsilon='1e-5'"],
    ),
    ("eps_other", "gpt2", lambda d: _config(d, layer_norm_epsilon=1e-6), ["config.json", "ln_eps 1e-06 != 1e-05"]),
    (
        "init_range_nan",
        "gpt2",
        lambda d: _config(d, initializer_range=float("nan")),
        ["config.json", "initializer_range=nan"],
    ),
    (
        "init_range_negative",
        "gpt2",
        lambda d: _config(d, initializer_range=-0.02),
        ["config.json", "initializer_range=-0.02"],
    ),
    (
        "init_range_string",
        "gpt2",
        lambda d: _config(d, initializer_range="x"),
        ["config.json", "initializer_range='x'"],
    ),
    (
        "vocab_real_fraction",
        "gpt2",
        lambda d: _config(d, scaletrain_vocab_size=1000.5),
        ["config.json", "scaletrain_vocab_size=1000.5"],
    ),
    (
        "vocab_real_bool",
        "gpt2",
        lambda d: _config(d, scaletrain_vocab_size=True),
        ["config.json", "scaletrain_vocab_size=True"],
    ),
    (
        "vocab_multiple_string",
        "gpt2",
        lambda d: _config(d, scaletrain_vocab_multiple="x"),
        ["config.json", "scaletrain_vocab_multiple='x'"],
    ),
    (
        "vocab_multiple_negative",
        "gpt2",
        lambda d: _config(d, scaletrain_vocab_multiple=-128),
        ["config.json", "scaletrain_vocab_multiple=-128"],
    ),
    # ---- config.json as a whole
    (
        "config_garbage",
        "gpt2",
        lambda d: (d / "config.json").write_text("{not json"),
        ["config.json", "not valid JSON"],
    ),
    ("config_deep", "gpt2", lambda d: (d / "config.json").write_text(_deep(10**5)), ["config.json", "nested"]),
    (
        "config_deep_field",
        "gpt2",
        lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().rstrip()[:-1] + ', "x": ' + _deep(10**5) + "}"
        ),
        ["config.json", "nested"],
    ),
    (
        "config_binary",
        "gpt2",
        lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00garbage"),
        ["config.json", "not UTF-8"],
    ),
    ("config_huge", "gpt2", lambda d: _config(d, padding="x" * (2 << 20)), ["config.json", "bytes"]),
    # ---- Llama config.json
    (
        "llama_heads_zero",
        "llama",
        lambda d: _config(d, num_attention_heads=0),
        ["config.json", "num_attention_heads=0"],
    ),
    ("llama_hidden_fraction", "llama", lambda d: _config(d, hidden_size=64.5), ["config.json", "hidden_size=64.5"]),
    ("llama_kv_zero", "llama", lambda d: _config(d, num_key_value_heads=0), ["config.json", "num_key_value_heads=0"]),
    ("llama_eps_nan", "llama", lambda d: _config(d, rms_norm_eps=float("nan")), ["config.json", "rms_norm_eps=nan"]),
    ("llama_eps_half", "llama", lambda d: _config(d, rms_norm_eps=0.5), ["config.json", "ln_eps 0.5 != 1e-05"]),
    (
        "llama_positions_string",
        "llama",
        lambda d: _config(d, max_position_embeddings="x"),
        ["config.json", "max_position_embeddings='x'"],
    ),
    (
        "llama_theta_string",
        "llama",
        lambda d: _config(d, rope_theta="1e4", rope_parameters=DELETE),
        ["config.json", "rope_theta='1e4'"],
    ),
    (
        "llama_rope_scaling_string",
        "llama",
        lambda d: _config(d, rope_scaling="llama3", rope_parameters=DELETE),
        ["config.json", "rope_scaling='llama3'"],
    ),
    (
        "llama_rope_parameters_list",
        "llama",
        lambda d: _config(d, rope_parameters=[1]),
        ["config.json", "rope_parameters=[1]"],
    ),
    (
        "llama_rope_parameters_empty_list",
        "llama",
        lambda d: _config(d, rope_parameters=[]),
        ["config.json", "rope_parameters=[]"],
    ),
    (
        "llama3_factor_string",
        "llama",
        lambda d: _config(
            d,
            rope_parameters=DELETE,
            rope_scaling={
                "rope_type": "llama3",
                "factor": "8",
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        ["config.json", "rope_scaling.factor='8'"],
    ),
    (
        "llama3_original_fraction",
        "llama",
        lambda d: _config(
            d,
            rope_parameters=DELETE,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32.5,
            },
        ),
        ["config.json", "rope_scaling.original_max_position_embeddings=32.5"],
    ),
    # ---- the sharded index: names confined to the directory, regular files only, a well-formed weight_map
    (
        "shard_dotdot",
        "gpt2_split",
        lambda d: _rename_shard(d, _outside_parent),
        ["model.safetensors.index.json", "'../stolen.safetensors' is not a file name"],
    ),
    (
        "shard_absolute",
        "gpt2_split",
        lambda d: _rename_shard(d, _outside_absolute),
        ["model.safetensors.index.json", "stolen.safetensors' is not a file name"],
    ),
    (
        "shard_symlink_out",
        "gpt2_split",
        lambda d: _rename_shard(d, _outside_symlink),
        ["link.safetensors: links to", "outside", "(listed in model.safetensors.index.json)"],
    ),
    (
        "shard_subdir",
        "gpt2_split",
        lambda d: _rename_shard(d, _subdir),
        ["model.safetensors.index.json", "'sub/model-00002-of-00002.safetensors' is not a file name"],
    ),
    (
        "shard_directory",
        "gpt2_split",
        lambda d: _rename_shard(d, _a_directory),
        ["adir.safetensors: not a regular file", "(listed in model.safetensors.index.json)"],
    ),
    (
        "shard_empty_name",
        "gpt2_split",
        lambda d: _rename_shard(d, lambda d, s: ""),
        ["model.safetensors.index.json", "'' is not a file name"],
    ),
    (
        "index_list",
        "gpt2_split",
        lambda d: (d / "model.safetensors.index.json").write_text("[]"),
        ["model.safetensors.index.json", "not a safetensors index"],
    ),
    (
        "index_no_weight_map",
        "gpt2_split",
        lambda d: _index(d, lambda doc: doc.pop("weight_map")),
        ["model.safetensors.index.json", "not a safetensors index"],
    ),
    (
        "index_weight_map_list",
        "gpt2_split",
        lambda d: _index(d, lambda doc: doc.update(weight_map=[])),
        ["model.safetensors.index.json", "not a safetensors index"],
    ),
    (
        "index_weight_map_ints",
        "gpt2_split",
        lambda d: _index(d, lambda doc: doc.update(weight_map=dict.fromkeys(doc["weight_map"], 5))),
        ["model.safetensors.index.json", "not a safetensors index"],
    ),
    (
        "index_deep",
        "gpt2_split",
        lambda d: (d / "model.safetensors.index.json").write_text(_deep(10**5)),
        ["model.safetensors.index.json", "nested"],
    ),
    ("single_symlink_out", "gpt2", _single_symlink_out, ["model.safetensors: links to", "outside"]),
]


def _check(code: int, err: str, expected: list[str], before: dict, d: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, f"exit {code}:\n{err[-3000:]}"
    assert lines[0].startswith("scaletrain: error: checkpoint.init_from="), lines[0]
    for part in expected:
        assert part in lines[0], (part, lines[0])
    assert snapshot(d) == before, "the Hugging Face directory was changed"


@pytest.mark.hostile
@pytest.mark.parametrize("base, damage, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_crafted_hf_directory_is_one_line(base, damage, expected, bases, excerpt_corpus, tmp_path, capsys):
    d = tmp_path / "hf"
    shutil.copytree(bases[base], d, symlinks=True)
    damage(d)
    before = snapshot(tmp_path)
    kind = "llama" if base == "llama" else "gpt2"
    with _alarm(60):  # 10**7 layers hung here: fail the case rather than the job
        code = main(_train(excerpt_corpus, kind, d, tmp_path / "run"))
    err = capsys.readouterr().err
    shutil.rmtree(tmp_path / "run", ignore_errors=True)  # the run's own directory is not the input
    _check(code, err, expected, before, tmp_path)


def _fifo_shard(d: Path) -> None:
    def change(doc):
        old = _second_shard(doc)
        os.mkfifo(d / "pipe.safetensors")
        doc["weight_map"] = {k: ("pipe.safetensors" if v == old else v) for k, v in doc["weight_map"].items()}

    _index(d, change)


# A FIFO blocks in open(2) inside safetensors' Rust code, where no signal interrupts it: a child process, so a hang
# fails the test at its timeout.
HANGS = [
    ("shard_fifo", "gpt2_split", _fifo_shard, ["pipe.safetensors: not a regular file", "(listed in model.safetensors"]),
]


@pytest.mark.hostile
@pytest.mark.parametrize("base, damage, expected", [c[1:] for c in HANGS], ids=[c[0] for c in HANGS])
def test_hf_directory_that_hung_is_one_line_in_a_child(base, damage, expected, bases, excerpt_corpus, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(bases[base], d, symlinks=True)
    damage(d)
    before = snapshot(d)
    kind = "llama" if base == "llama" else "gpt2"
    cmd = [sys.executable, "-m", "scaletrain", *_train(excerpt_corpus, kind, d, tmp_path / "run")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd[2:5])}: still running after 120 s (hangs)")
    _check(proc.returncode, proc.stderr, expected, before, d)


def test_the_valid_bases_load(bases, excerpt_corpus, tmp_path, capsys):
    """The cases above damage these: undamaged, each trains its step (so every refusal is the damage's)."""
    for base in ("gpt2", "llama", "gpt2_split"):
        kind = "llama" if base == "llama" else "gpt2"
        code = main(_train(excerpt_corpus, kind, bases[base], tmp_path / base))
        assert code == 0, capsys.readouterr().err[-2000:]


def test_a_hub_cache_snapshot_links_into_its_blobs(bases, tmp_path):
    """The Hugging Face hub cache keeps files in blobs/ and links snapshots/<rev>/ to them: that is not outside."""
    from scaletrain.checkpoint.hf import import_gpt2_hf

    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(bases["gpt2"] / name, repo / "blobs" / f"sha-{name}")
        (snap / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    cfg, sd = import_gpt2_hf(snap)
    assert cfg.n_layers == 2 and "embed.tok.weight" in sd


# The distributed reader (hf/sharded.py: each rank reads its own slices) takes the same directory through
# `load_init_weights`: its checks come before any collective, so one process with a faked two-rank group runs them.
SHARDED = [
    (
        "shard_symlink_out",
        "gpt2_split",
        lambda d: _rename_shard(d, _outside_symlink),
        ["link.safetensors: links to", "outside"],
    ),
    ("shard_fifo", "gpt2_split", _fifo_shard, ["pipe.safetensors: not a regular file"]),
    (
        "index_deep",
        "gpt2_split",
        lambda d: (d / "model.safetensors.index.json").write_text(_deep(10**5)),
        ["model.safetensors.index.json", "nested"],
    ),
    ("n_head_zero", "gpt2_split", lambda d: _config(d, n_head=0), ["config.json", "n_head=0"]),
    (
        "eps_nan",
        "gpt2_split",
        lambda d: _config(d, layer_norm_epsilon=float("nan")),
        ["config.json", "layer_norm_epsilon=nan"],
    ),
    ("single_symlink_out", "gpt2", _single_symlink_out, ["model.safetensors: links to", "outside"]),
]


@pytest.mark.hostile
@pytest.mark.parametrize("base, damage, expected", [c[1:] for c in SHARDED], ids=[c[0] for c in SHARDED])
def test_sharded_reader_refuses_in_one_line(base, damage, expected, bases, tmp_path, monkeypatch):
    import torch

    from scaletrain.checkpoint.init_from import load_init_weights
    from scaletrain.checkpoint.store import CheckpointError

    d = tmp_path / "hf"
    shutil.copytree(bases[base], d, symlinks=True)
    damage(d)
    before = snapshot(tmp_path)
    want = resolve(SHAPES["gpt2"][0], overrides=[*SHAPES["gpt2"][1], "model.vocab_size=1024"]).model
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(CheckpointError) as err:
        load_init_weights([build_model(want)], want, str(d))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"checkpoint.init_from={d}: "), message
    for part in expected:
        assert part in message, (part, message)
    assert snapshot(tmp_path) == before
