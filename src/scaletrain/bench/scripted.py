"""A scripted Engine: no model, deterministic fake losses. Drives the harness in tests and dry runs of the protocol."""

from __future__ import annotations

import math
from typing import Sequence

from scaletrain.config import Config

from .harness import NonFiniteLoss

__all__ = ["ScriptedEngine"]


class ScriptedEngine:
    """Engine whose evaluate() returns `eval_losses` in turn (the last one repeats) and whose train_step is instant.

    `nan_at_step` (1-based, counted from init) makes that train_step raise NonFiniteLoss like a real engine would.
    `calls` records the protocol calls in order, so tests can assert the harness drove the engine correctly.
    """

    def __init__(self, cfg: Config, eval_losses: Sequence[float] = (3.0, 2.8, 2.68),
                 eval_tokens: int = 11_590_004, nan_at_step: int | None = None) -> None:
        self.seq_len = cfg.model.seq_len
        self.global_batch_size = cfg.train.global_batch_size
        self.eval_tokens = eval_tokens
        self.lr = cfg.optim.lr
        self.eval_losses = list(eval_losses)
        self.nan_at_step = nan_at_step
        self.step = 0
        self.n_evals = 0
        self.calls: list[str] = []
        self.finished: dict | None = None

    def init(self) -> None:
        """Nothing to build; resets the counters, as a real engine resets to the seed's initial state."""
        self.calls.append("init")
        self.step = 0
        self.n_evals = 0

    def train_step(self) -> dict:
        """Count a step; NaN at `nan_at_step`."""
        self.calls.append("train_step")
        self.step += 1
        if self.nan_at_step is not None and self.step == self.nan_at_step:
            raise NonFiniteLoss(self.step, math.nan)
        return {"loss": 3.5 - 0.001 * self.step, "lr": self.lr}

    def evaluate(self) -> float:
        """The next scripted eval loss."""
        self.calls.append("evaluate")
        loss = self.eval_losses[min(self.n_evals, len(self.eval_losses) - 1)]
        self.n_evals += 1
        return float(loss)

    def finish(self, result: dict) -> None:
        """Keep the result for inspection."""
        self.calls.append("finish")
        self.finished = result
