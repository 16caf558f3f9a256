"""What a training run says before its first step: preset, data, target, budget, run directory, layout, device."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from scaletrain.config import resolve
from scaletrain.parallel.layout import Layout
from scaletrain.train.run import start_lines


def _engine(cfg, resume=None):
    return SimpleNamespace(
        layout=Layout.from_config(cfg, 1),
        device=torch.device("cpu"),
        resume_path=resume,
        _planned_steps=lambda: cfg.train.max_steps,
    )


def test_the_start_block_names_preset_data_target_budget_and_run_directory(tmp_path):
    cfg = resolve(
        "gpt3-proxy",
        overrides=[
            f"data.train_prefix={tmp_path / 'mine/train'}",
            f"data.valid_prefix={tmp_path / 'mine/valid'}",
            f"data.tokenizer={tmp_path / 'mine/tokenizer.model'}",
            "train.dtype=fp32",
        ],
    )
    lines = start_lines(cfg, _engine(cfg), tmp_path / "run")
    assert lines == [
        f"train gpt3-proxy: run directory {tmp_path / 'run'}",
        f"  data: train {tmp_path / 'mine/train'}, valid {tmp_path / 'mine/valid'}, tokenizer "
        f"{tmp_path / 'mine/tokenizer.model'}",
        "  target: eval loss <= 5.9, evaluated every 32 steps; at most 320 steps (train.max_steps) of 32 sequences "
        "x 256 tokens",
        "  layout: single = 1 rank (none), device cpu",
    ]
    resumed = start_lines(cfg, _engine(cfg, tmp_path / "run/checkpoints/step_64"), tmp_path / "run")
    assert resumed[-1] == f"  resuming from {tmp_path / 'run/checkpoints/step_64'}"
