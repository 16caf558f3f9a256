"""The run's process-wide hooks (collective-wait timing, train/perf.py; the collective check,
parallel/collective_check.py; the SIGTERM/SIGUSR1 handlers, train/signals.py) live exactly as long as the run: a
Trainer that never finishes leaves torch's own functions and the process's signal handlers in place."""

from __future__ import annotations

import signal

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from test_train_e2e import tiny_config
from torch._C._distributed_c10d import Work

from scaletrain.train.engine import Trainer
from scaletrain.train.loop import run_loop
from scaletrain.train.protocol import Observer


def _torch_functions() -> tuple:
    """What the hooks replace: c10d's wait, the functional collectives' wait, a collective, P2POp's constructor and
    the stop signals' handlers."""
    return (
        Work.wait,
        funcol.wait_tensor,
        dist.all_reduce,
        dist.P2POp.__init__,
        signal.getsignal(signal.SIGTERM),
        signal.getsignal(signal.SIGUSR1),
    )


class _Crash(Observer):
    """Records whether torch is hooked once the run has started, then fails the run."""

    def on_run_start(self, state, engine) -> None:
        self.hooked = _torch_functions()
        raise RuntimeError("crash inside the run")


def test_a_run_that_raises_restores_torch(excerpt_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALETRAIN_CHECK_COLLECTIVES", "1")
    before = _torch_functions()
    cfg = tiny_config(excerpt_corpus, tmp_path / "run")
    crash = _Crash()
    with pytest.raises(RuntimeError, match="crash inside the run"):
        run_loop(cfg, Trainer(cfg, tmp_path / "run"), tmp_path / "run", [crash])
    assert all(h != b for h, b in zip(crash.hooked, before))  # every hook was on during the run
    assert _torch_functions() == before


def test_a_trainer_left_unfinished_leaves_torch_alone(excerpt_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALETRAIN_CHECK_COLLECTIVES", "1")
    before = _torch_functions()
    trainer = Trainer(tiny_config(excerpt_corpus, tmp_path / "run"), tmp_path / "run")
    trainer.init()
    trainer.train_step()
    del trainer  # never finished
    assert _torch_functions() == before
