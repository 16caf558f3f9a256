"""Activation checkpointing changes memory, never numbers: full and selective recompute give the same losses."""

from __future__ import annotations

import pytest
from test_train_e2e import tiny_config

from scaletrain.train.engine import Trainer


def _losses(corpus, tmp_path, mode, steps=5):
    cfg = tiny_config(corpus, tmp_path / mode, f"parallel.activation_checkpoint={mode}")
    trainer = Trainer(cfg, tmp_path / mode)
    trainer.init()
    out = [trainer.train_step()["loss"] for _ in range(steps)]
    out.append(trainer.evaluate())
    trainer.finish({})
    return out, trainer


def test_full_and_selective_recompute_match_no_recompute(excerpt_corpus, tmp_path):
    ref, _ = _losses(excerpt_corpus, tmp_path, "none")
    for mode in ("full", "selective"):
        got, trainer = _losses(excerpt_corpus, tmp_path, mode)
        assert got == pytest.approx(ref, abs=1e-6), mode
        wrapped = type(trainer.model.blocks["0"]).__name__
        assert wrapped == "CheckpointWrapper", f"{mode}: blocks not wrapped ({wrapped})"
