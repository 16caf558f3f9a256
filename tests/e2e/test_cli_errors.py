"""Bad input ends as one clear line on stderr and exit status 2, and damages nothing already saved."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from scaletrain.cli.main import main

pytestmark = pytest.mark.hostile


def run_cli(capsys, *args):
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


def copy_corpus(corpus, dest):
    dest.mkdir()
    for path in corpus.train_prefix.parent.iterdir():
        if path.is_file():
            shutil.copy(path, dest / path.name)
    return dest


def data_args(root, vocab=1024):
    return [
        "--set",
        f"data.train_prefix={root / 'train'}",
        "--set",
        f"data.valid_prefix={root / 'valid'}",
        "--set",
        f"data.tokenizer={root / 'tokenizer.model'}",
        "--set",
        f"model.vocab_size={vocab}",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.progress=false",
    ]


def test_unknown_preset_via_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "scaletrain", "train", "--preset", "gpt9"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown preset 'gpt9'" in proc.stderr


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.global_batch_size", "expected KEY=VALUE"),
        ("model.layers=3", "unknown field 'model.layers'"),
        ("train.micro_batch_size=-1", "must be > 0"),
    ],
)
def test_bad_set(capsys, override, needle):
    code, err = run_cli(capsys, "train", "--set", override)
    assert code == 2 and needle in err and "\n" not in err


def test_missing_data_file(capsys, tmp_path):
    code, err = run_cli(
        capsys,
        "train",
        "--set",
        f"data.train_prefix={tmp_path / 'nope'}",
        "--set",
        f"data.valid_prefix={tmp_path / 'nope'}",
        "--set",
        f"train.run_dir={tmp_path}/r",
    )
    assert code == 2 and str(tmp_path / "nope") in err and "\n" not in err


def test_truncated_bin(capsys, tmp_path, excerpt_corpus):
    root = copy_corpus(excerpt_corpus, tmp_path / "c")
    data = (root / "train.bin").read_bytes()
    (root / "train.bin").write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, "train", *data_args(root), "--set", f"train.run_dir={tmp_path}/r")
    assert code == 2 and "train.bin" in err and "\n" not in err


def test_idx_with_wrong_header(capsys, tmp_path, excerpt_corpus):
    root = copy_corpus(excerpt_corpus, tmp_path / "c")
    raw = bytearray((root / "valid.idx").read_bytes())
    raw[:9] = b"NOTANIDX\x00"
    (root / "valid.idx").write_bytes(bytes(raw))
    code, err = run_cli(capsys, "train", *data_args(root), "--set", f"train.run_dir={tmp_path}/r")
    assert code == 2 and "valid.idx" in err and "\n" not in err


def test_tokenizer_vocab_mismatch(capsys, tmp_path, excerpt_corpus):
    code, err = run_cli(
        capsys,
        "train",
        *data_args(excerpt_corpus.train_prefix.parent, vocab=2048),
        "--set",
        f"train.run_dir={tmp_path}/r",
    )
    assert code == 2 and "vocab" in err.lower() and "\n" not in err


def test_bad_input_leaves_existing_run_untouched(capsys, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "result.json").write_text('{"status": "success"}')
    code, _ = run_cli(capsys, "train", "--set", "train.dtype=fp8", "--set", f"train.run_dir={run}")
    assert code == 2 and (run / "result.json").read_text() == '{"status": "success"}'


def test_every_command_has_help(capsys):
    for cmd in (["train"], ["bench"], ["data", "fetch"], ["data", "prepare"], ["report"], ["config"]):
        with pytest.raises(SystemExit) as info:
            main([*cmd, "--help"])
        assert info.value.code == 0
        assert "usage: scaletrain" in capsys.readouterr().out


def test_bench_benchmark_flag(capsys, tmp_path, monkeypatch):
    # A 70B model exceeds most machines' memory, which is checked before the data: pretend this one is big.
    monkeypatch.setattr("scaletrain.train.host.available_memory_bytes", lambda: 10**15)
    code, err = run_cli(capsys, "bench", "--benchmark", "nope")
    assert code == 2 and err.count("\n") == 0 and "llama2_70b_lora" in err
    # llama2_70b_lora picks its preset (SFT data): the missing GovReport-style data is named, nothing runs.
    code, err = run_cli(
        capsys,
        "bench",
        "--benchmark",
        "llama2_70b_lora",
        "--out",
        str(tmp_path / "b"),
        "--set",
        f"data.train_prefix={tmp_path / 'gov'}",
        "--set",
        f"data.valid_prefix={tmp_path / 'v'}",
        "--set",
        f"data.tokenizer={tmp_path / 't.model'}",
    )
    assert code == 2 and ("gov" in err or "t.model" in err), err


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=nan",
        "train.target_eval_loss=nan",
        "optim.grad_clip=nan",
        "model.init_std=nan",
        "checkpoint.interval_minutes=inf",
        "lora.alpha=-inf",
    ],
)
def test_non_finite_config_value_is_one_line(capsys, tmp_path, override):
    # NaN passes every `<= 0` check; it must be refused by name before anything runs.
    code, err = run_cli(capsys, "train", "--set", override, "--run-dir", str(tmp_path / "r"))
    field, value = override.split("=")
    assert code == 2 and err == f"scaletrain: error: {field}={float(value)}: must be a finite number"
    assert not (tmp_path / "r").exists()
