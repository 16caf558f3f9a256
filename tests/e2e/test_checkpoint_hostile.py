"""Broken or hostile checkpoints: one clear line naming the file, never a silent load, nothing saved is damaged."""

from __future__ import annotations

import errno
import json
import pickle
import shutil

import pytest
import torch

from scaletrain.checkpoint.checkpointer import Checkpointer
from scaletrain.checkpoint.store import CheckpointError, complete_checkpoints, sha256, verify
from scaletrain.cli import main
from scaletrain.train.engine import Trainer

from test_train_e2e import tiny_config


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
    assert not _ckpt(run_copy, 4).exists() and len(list((run_copy / "checkpoints").glob("step_00000004.damaged-*"))) == 1


def test_missing_shard_names_the_file(excerpt_corpus, run_copy):
    shard = sorted(_ckpt(run_copy, 4).glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        verify(_ckpt(run_copy, 4), "size")
    assert shard.name in str(err.value) and "missing" in str(err.value)


@pytest.mark.parametrize("override,needle", [
    ("model.d_model=128", "has shape"),
    ("model.vocab_multiple=1000", "embed.tok.weight has shape"),  # padded vocabulary 2000 rows
    # One tensor count more or less is named with both counts (a 3-layer checkpoint into 2 layers: test below).
    ("model.n_layers=3", "the checkpoint's model has 29 tensors, the model being built has 41 (e.g. 'blocks.2."),
])
def test_checkpoint_of_another_model_is_refused(excerpt_corpus, run_copy, override, needle):
    before = _snapshot(run_copy)
    cfg = tiny_config(excerpt_corpus, run_copy / "other", override,
                      f"checkpoint.resume={_ckpt(run_copy, 4)}")
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
    with pytest.raises(CheckpointError) as err:
        trainer.save_checkpoint({})
    msg = str(err.value)
    assert "step 5" in msg and "No space left on device" in msg and "\n" not in msg
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
    manifest["files"][".metadata"] = {"bytes": (ckpt / ".metadata").stat().st_size,
                                      "sha256": sha256(ckpt / ".metadata")}
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
    from scaletrain.checkpoint.checkpointer import load_full_model
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
