"""The resume warnings go through the project logger (scaletrain.log), like every other warning: the rank filter and
the `scaletrain: warning:` format apply to them, and a host application can capture them."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaletrain.log import ROOT


@pytest.fixture
def records():
    """Every record the `scaletrain` logger handles while the test runs."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    logging.getLogger(ROOT).addHandler(handler)
    yield seen
    logging.getLogger(ROOT).removeHandler(handler)


def test_changed_settings_warning_reaches_the_logger(records):
    from scaletrain.checkpoint.resume import warn_changed_settings

    cfg = SimpleNamespace(train=SimpleNamespace(global_batch_size=16, seed=1, dtype="fp32"))
    saved = {"config": {"train": {"global_batch_size": 8, "seed": 1, "dtype": "fp32"}}}
    assert warn_changed_settings(Path("ckpt"), saved, cfg) == ["train.global_batch_size 8 -> 16"]
    [rec] = records
    assert rec.name == "scaletrain.checkpoint.resume" and rec.levelno == logging.WARNING
    assert rec.getMessage() == "resuming ckpt with changed settings: train.global_batch_size 8 -> 16"


def test_lost_mllog_warning_reaches_the_logger(records, tmp_path):
    from scaletrain.bench.mllog import restore_mllog

    log_path = tmp_path / "mllog.txt"
    restore_mllog(log_path, tmp_path / "ckpt", info={}, size=None, t_start=0, step=3)
    assert log_path.read_text().endswith("so this log is incomplete\n")
    [rec] = records
    assert rec.name == "scaletrain.bench.mllog" and rec.levelno == logging.WARNING
    assert rec.getMessage() == f"resuming {tmp_path / 'ckpt'}: its run kept no MLLOG; {log_path} starts incomplete"
