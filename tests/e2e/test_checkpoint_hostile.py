"""Broken or hostile checkpoints: one clear line naming the file, never a silent load, nothing saved is damaged."""

from __future__ import annotations

import errno
import json
import pickle
import shutil

import pytest
import torch
from test_train_e2e import tiny_config

from scaletrain.checkpoint.checkpointer import Checkpointer
from scaletrain.checkpoint.store import CheckpointError, complete_checkpoints, sha256, verify
from scaletrain.cli.main import main
from scaletrain.diskfull import DiskFullError
from scaletrain.train.engine import Trainer

pytestmark = pytest.mark.hostile


@pytest.fixture(scope="module")
def saved(excerpt_corpus, tmp_path_factory):
    """A run directory with complete checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.keep=0")
    trainer = Trainer(cfg, run)
    trainer.init()
    for _ in range(2):
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint({})
    trainer.finish({})
    return run


@pytest.fixture
def run_copy(saved, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


def _ckpt(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def _finder(corpus, run, *extra):
    return Checkpointer(tiny_config(corpus, run, *extra), run)


def _snapshot(run):
    return {p.relative_to(run): sha256(p) for p in (run / "checkpoints").rglob("*") if p.is_file()}


def test_partial_save_is_ignored_by_auto_and_refused_by_path(excerpt_corpus, run_copy):
    tmp = _ckpt(run_copy, 6).with_name("step_00000006.tmp")
    shutil.copytree(_ckpt(run_copy, 4), tmp)
    (tmp / "manifest.json").unlink()
    assert _finder(excerpt_corpus, run_copy).find("auto") == _ckpt(run_copy, 4)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        _finder(excerpt_corpus, run_copy).find(str(tmp))


def test_bit_flip_is_detected_and_auto_falls_back(excerpt_corpus, run_copy, capsys):
    shard = sorted(_ckpt(run_copy, 4).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"distcp: sha256 differs"):
        _finder(excerpt_corpus, run_copy).find(str(_ckpt(run_copy, 4)))
    assert _finder(excerpt_corpus, run_copy).find("auto") == _ckpt(run_copy, 2)
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    # Moved aside, not deleted and not in the way of the next save of step 4.
    assert (
        not _ckpt(run_copy, 4).exists() and len(list((run_copy / "checkpoints").glob("step_00000004.damaged-*"))) == 1
    )


def test_missing_shard_names_the_file(excerpt_corpus, run_copy):
    shard = sorted(_ckpt(run_copy, 4).glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        verify(_ckpt(run_copy, 4), "size")
    assert shard.name in str(err.value) and "missing" in str(err.value)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.d_model=128", "has shape"),
        ("model.vocab_multiple=1000", "embed.tok.weight has shape"),  # padded vocabulary 2000 rows
        # One tensor count more or less is named with both counts (a 3-layer checkpoint into 2 layers: test below).
        ("model.n_layers=3", "the checkpoint's model has 29 tensors, the model being built has 41 (e.g. 'blocks.2."),
    ],
)
def test_checkpoint_of_another_model_is_refused(excerpt_corpus, run_copy, override, needle):
    before = _snapshot(run_copy)
    cfg = tiny_config(excerpt_corpus, run_copy / "other", override, f"checkpoint.resume={_ckpt(run_copy, 4)}")
    trainer = Trainer(cfg, run_copy / "other")
    with pytest.raises(CheckpointError) as err:
        trainer.init()
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert _snapshot(run_copy) == before


def test_full_disk_during_save_keeps_earlier_checkpoints(excerpt_corpus, run_copy, monkeypatch):
    before = _snapshot(run_copy)
    cfg = tiny_config(excerpt_corpus, run_copy, "checkpoint.resume=auto", "checkpoint.keep=0")
    trainer = Trainer(cfg, run_copy)
    trainer.init()
    trainer.train_step()
    from torch.distributed.checkpoint import FileSystemWriter

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
    with pytest.raises(DiskFullError) as err:
        trainer.save_checkpoint({})
    msg = str(err.value)
    tmp = run_copy / "checkpoints" / "step_00000005.tmp"
    assert msg.startswith(f"no space left on device while writing {tmp} (checkpoint at step 5;") and "\n" not in msg
    assert not list((run_copy / "checkpoints").glob("*.tmp"))
    assert _snapshot(run_copy) == before
    for path in complete_checkpoints(run_copy / "checkpoints"):
        verify(path)


class _Evil:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-scaletrain-evil",))


def test_tampered_metadata_is_never_unpickled(excerpt_corpus, run_copy, tmp_path):
    ckpt = _ckpt(run_copy, 4)
    marker = tmp_path / "pwned"

    class Touch:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Touch()))
    manifest = json.loads((ckpt / "manifest.json").read_text())  # an attacker can fix the manifest too
    manifest["files"][".metadata"] = {
        "bytes": (ckpt / ".metadata").stat().st_size,
        "sha256": sha256(ckpt / ".metadata"),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    cfg = tiny_config(excerpt_corpus, run_copy / "x", f"checkpoint.resume={ckpt}")
    trainer = Trainer(cfg, run_copy / "x")
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        trainer.init()
    assert not marker.exists()


def test_cli_resume_errors_are_one_line(excerpt_corpus, run_copy, tmp_path, capsys):
    from test_train_e2e import tiny_overrides

    over = [a for o in tiny_overrides(excerpt_corpus) for a in ("--set", o)]
    code = main(["train", "--resume", str(tmp_path / "nope"), "--set", f"train.run_dir={tmp_path}/r", *over])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no such checkpoint directory" in err


def test_export_cli_writes_a_transformers_model(excerpt_corpus, saved, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from scaletrain.checkpoint.init_from import load_full_model

    assert main(["export", str(saved), "--hf", str(tmp_path / "hf")]) == 0
    _, ours = load_full_model(_ckpt(saved, 4))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert torch.allclose(ours.eval()(x), hf(input_ids=x).logits, atol=1e-4)


def test_nan_loss_aborts_and_leaves_checkpoints_intact(excerpt_corpus, tmp_path, monkeypatch):
    import math

    from scaletrain.bench.harness import run_once

    run = tmp_path / "run"
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.interval_steps=1", "checkpoint.keep=0")
    real = Trainer._forward_backward

    def poisoned(self, batches):
        value = real(self, batches)
        return math.inf if self.step == 15 else value

    monkeypatch.setattr(Trainer, "_forward_backward", poisoned)
    result = run_once(cfg, Trainer(cfg, run), run)
    assert result["status"] == "aborted" and "step 16" in result["reason"]
    saved = complete_checkpoints(run / "checkpoints")
    assert [p.name for p in saved] == ["step_00000010"]
    verify(saved[0])


def test_unpublished_step_dir_is_moved_aside_by_auto(excerpt_corpus, run_copy, capsys):
    """An interrupted publish (step_<N> without manifest.json) must not block every later resume at step N."""
    cut = _ckpt(run_copy, 6)
    shutil.copytree(_ckpt(run_copy, 4), cut)
    (cut / "manifest.json").unlink()
    assert _finder(excerpt_corpus, run_copy).find("auto") == _ckpt(run_copy, 4)
    err = capsys.readouterr().err
    assert f"warning: skipping incomplete checkpoint {cut} (no manifest.json); moved to {cut}.damaged-" in err
    assert not cut.exists() and len(list(cut.parent.glob("step_00000006.damaged-*"))) == 1


def test_save_moves_an_unpublished_dir_of_its_step_aside(excerpt_corpus, run_copy, capsys):
    cfg = tiny_config(excerpt_corpus, run_copy, f"checkpoint.resume={_ckpt(run_copy, 4)}", "checkpoint.keep=0")
    trainer = Trainer(cfg, run_copy)
    trainer.init()
    trainer.train_step()
    cut = _ckpt(run_copy, 5)
    shutil.copytree(_ckpt(run_copy, 4), cut)
    (cut / "manifest.json").unlink()
    trainer.save_checkpoint({})
    assert verify(cut)["step"] == 5
    assert "in the way of this save; moved to" in capsys.readouterr().err
    assert len(list(cut.parent.glob("step_00000005.damaged-*"))) == 1


def test_checkpoint_with_more_tensors_is_refused(excerpt_corpus, tmp_path):
    """A 3-layer checkpoint must not load silently into a 2-layer model (every tensor of the 2-layer one exists)."""
    big = tmp_path / "big"
    trainer = Trainer(tiny_config(excerpt_corpus, big, "model.n_layers=3"), big)
    trainer.init()
    trainer.save_checkpoint({})
    cfg = tiny_config(excerpt_corpus, tmp_path / "small", f"checkpoint.resume={_ckpt(big, 0)}")
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg, tmp_path / "small").init()
    msg = str(err.value)
    assert "the checkpoint's model has 41 tensors, the model being built has 29" in msg and "\n" not in msg
    assert "'blocks.2." in msg and "only in the checkpoint" in msg


def test_changed_batch_size_seed_and_dtype_warn(excerpt_corpus, run_copy, capsys):
    cfg = tiny_config(
        excerpt_corpus,
        run_copy / "x",
        f"checkpoint.resume={_ckpt(run_copy, 4)}",
        "train.seed=7",
        "train.global_batch_size=32",
        "train.dtype=bf16",
    )
    trainer = Trainer(cfg, run_copy / "x")
    trainer.init()
    assert trainer.step == 4
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == [
        f"scaletrain: warning: resuming {_ckpt(run_copy, 4)} with changed settings: "
        "train.global_batch_size 16 -> 32, train.seed 1234 -> 7, train.dtype fp32 -> bf16"
    ]


def test_size_verification_misses_flipped_bytes_only_sha256_catches_them(excerpt_corpus, run_copy):
    """What the README says about checkpoint.verify="size": a flipped byte keeps the size."""
    shard = sorted(_ckpt(run_copy, 4).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert verify(_ckpt(run_copy, 4), "size")["step"] == 4
    with pytest.raises(CheckpointError, match="sha256 differs"):
        verify(_ckpt(run_copy, 4), "sha256")


def test_non_finite_loss_after_a_resume_names_the_checkpoint(excerpt_corpus, tmp_path, monkeypatch):
    import math

    from scaletrain.bench.harness import run_once

    run = tmp_path / "run"
    # A 10-step run (its final checkpoint at step 10) resumed with one more step of budget.
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.interval_steps=1", "train.max_steps=10")
    run_once(cfg, Trainer(cfg, run), run)
    real = Trainer._forward_backward

    def poisoned(self, batches):
        value = real(self, batches)
        return math.nan if self.step == 10 else value

    monkeypatch.setattr(Trainer, "_forward_backward", poisoned)
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.resume=auto", "checkpoint.verify=size", "train.max_steps=11")
    result = run_once(cfg, Trainer(cfg, run), run)
    assert result["status"] == "aborted"
    assert result["reason"] == f"non-finite training loss nan at step 11 (resumed from {_ckpt(run, 10)})"


_FSIZE_SCRIPT = """
import resource, signal, sys
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.config import resolve
from scaletrain.train.engine import Trainer
cfg = resolve("gpt3-proxy", overrides=sys.argv[2:])
trainer = Trainer(cfg, sys.argv[1])
trainer.init()
trainer.train_step()
trainer.save_checkpoint({})
# Files may not grow past 64 KiB from here on; with SIGXFSZ ignored, write() fails with EFBIG.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
trainer.train_step()
try:
    trainer.save_checkpoint({})
except CheckpointError as exc:
    print(exc)
    sys.exit(3)
"""


def test_file_size_limit_during_save_names_efbig_and_keeps_earlier(excerpt_corpus, tmp_path):
    import subprocess
    import sys

    from test_train_e2e import tiny_overrides

    run = tmp_path / "run"
    over = [*tiny_overrides(excerpt_corpus), f"train.run_dir={run}"]
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(run), *over], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    # Off a terminal the trainer's own log lines (step: ...) come first; the error is the script's last line.
    *log_lines, msg = proc.stdout.strip().splitlines()
    assert all(line.startswith("step: ") for line in log_lines), log_lines
    assert "checkpoint save at step 2" in msg and "EFBIG (File too large)" in msg
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000001"]
    assert not list((run / "checkpoints").glob("*.tmp"))
    trainer = Trainer(tiny_config(excerpt_corpus, run, "checkpoint.resume=auto"), run)
    trainer.init()
    assert trainer.step == 1
