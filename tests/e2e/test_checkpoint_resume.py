"""Checkpoints: a crashed run resumed with --resume auto ends exactly like the uninterrupted run."""

from __future__ import annotations

import json

import pytest
from test_train_e2e import read_jsonl, tiny_config

from scaletrain.bench.checker import check_log
from scaletrain.bench.harness import run_once
from scaletrain.checkpoint.store import complete_checkpoints, verify
from scaletrain.train.engine import Trainer

CKPT = ["checkpoint.interval_steps=1", "checkpoint.keep=2", "train.target_eval_loss=0.1", "train.max_steps=40"]


class Crash(RuntimeError):
    pass


def _run(corpus, run_dir, *extra, crash_at=None, monkeypatch=None):
    cfg = tiny_config(corpus, run_dir, *CKPT, *extra)
    trainer = Trainer(cfg, run_dir)
    if crash_at is not None:
        real = Trainer.train_step

        def crashing(self):
            if self.step == crash_at:
                raise Crash(f"simulated crash at step {crash_at}")
            return real(self)

        monkeypatch.setattr(Trainer, "train_step", crashing)
    try:
        return run_once(cfg, trainer, run_dir), cfg
    finally:
        if crash_at is not None:
            monkeypatch.setattr(Trainer, "train_step", real)


def test_crash_and_resume_is_bit_exact_and_log_stays_valid(excerpt_corpus, tmp_path, monkeypatch):
    ref, _ = _run(excerpt_corpus, tmp_path / "ref")
    run = tmp_path / "run"
    with pytest.raises(Crash):
        _run(excerpt_corpus, run, crash_at=25, monkeypatch=monkeypatch)
    ckpts = complete_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000020"]  # keep=2, saved after each evaluation
    for p in ckpts:
        verify(p)
    result, cfg = _run(excerpt_corpus, run, "checkpoint.resume=auto")
    assert result["status"] == ref["status"] and result["steps"] == ref["steps"] == 40
    assert [e["eval_loss"] for e in result["evals"]] == [e["eval_loss"] for e in ref["evals"]]  # bitwise
    records = read_jsonl(run / "metrics.jsonl")
    # Steps 21-25 ran twice (before the crash and after the resume from step 20); metrics.jsonl has each once.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))
    assert [r["step"] for r in records if "eval_loss" in r] == [e["step"] for e in ref["evals"]]
    assert [r["step"] for r in records if "checkpoint_s" in r] == [10, 20, 30, 40]  # each save's time, once; 40: final
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    ref_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl") if "loss" in r}
    assert losses == ref_losses
    log = (run / "mllog.txt").read_text()
    assert log.count('"key": "run_start"') == 1 and log.count('"key": "run_stop"') == 1
    assert check_log(run / "mllog.txt", cfg.bench.benchmark).ok
    assert json.loads((run / "result.json").read_text())["time_to_train_s"] > 0


def test_resume_explicit_checkpoint_into_a_new_run_directory(excerpt_corpus, tmp_path, monkeypatch, capsys):
    """The new run directory's MLLOG continues the saved run's (copied up to the checkpoint): one run_start."""
    from scaletrain.checkpoint.store import CheckpointError

    run = tmp_path / "run"
    with pytest.raises(Crash):
        _run(excerpt_corpus, run, crash_at=15, monkeypatch=monkeypatch)
    ckpt = run / "checkpoints" / "step_00000010"
    size = json.loads((ckpt / "trainer.json").read_text())["loop"]["observers"]["mlperf"]["mllog_bytes"]
    head = (run / "mllog.txt").read_bytes()[:size]

    new = tmp_path / "new"
    result, cfg = _run(excerpt_corpus, new, f"checkpoint.resume={ckpt}", "train.max_steps=20")
    assert result["steps"] == 20 and result["error"] is None
    log = (new / "mllog.txt").read_bytes()
    assert log[:size] == head and log.count(b'"key": "run_start"') == 1 and log.count(b'"key": "run_stop"') == 1
    assert check_log(new / "mllog.txt", cfg.bench.benchmark).ok

    # A run directory holding another run's log is never overwritten.
    other = tmp_path / "other"
    other.mkdir()
    (other / "mllog.txt").write_text(":::MLLOG {}\n" * 1000)
    with pytest.raises(CheckpointError) as err:
        _run(excerpt_corpus, other, f"checkpoint.resume={ckpt}", "train.max_steps=20")
    assert "not the MLLOG of the run that saved" in str(err.value) and "\n" not in str(err.value)
    assert (other / "mllog.txt").read_text() == ":::MLLOG {}\n" * 1000

    # The saved run's log is gone: the run still resumes, its log says it is incomplete (and fails the checker).
    (run / "mllog.txt").unlink()
    capsys.readouterr()
    lost = tmp_path / "lost"
    result, cfg = _run(excerpt_corpus, lost, f"checkpoint.resume={ckpt}", "train.max_steps=20")
    assert result["steps"] == 20 and result["error"] is None
    assert "its run's MLLOG was not found" in capsys.readouterr().err
    assert (lost / "mllog.txt").read_text().startswith(f"# scaletrain: resumed from {ckpt} at step 10;")
    assert not check_log(lost / "mllog.txt", cfg.bench.benchmark).ok
