"""The training engine: model, optimizer, data and metrics of one run, stepped by the benchmark harness.

One `train_step()` is one optimizer step over one global batch (micro-batches accumulated); `evaluate()` covers
the whole validation set. `init()` is the untimed part of an MLPerf run: build, warm up on synthetic data, then
put model, optimizer and data position back exactly where a cold start with this seed would have them.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.bench.harness import NonFiniteLoss
from scaletrain.config import Config
from scaletrain.model.flops import flops_per_token
from scaletrain.model.gpt import GPT, IGNORE_INDEX, loss_sum
from scaletrain.train.host import setup_cpu
from scaletrain.train.metrics import MetricsLogger
from scaletrain.train.optim import build_optimizer, lr_at, set_lr


@dataclass
class Datasets:
    """Training samples and the fixed validation set of a run."""

    train: object  # scaletrain.data.samples.TrainSamples
    valid: object  # scaletrain.data.samples.ValidSamples


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU; 'cuda' without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA device is available")
    return torch.device(name)


def load_datasets(cfg: Config, seed: int) -> Datasets:
    """Open the train/valid datasets named by cfg.data (or the default corpus), checked against the model's vocab."""
    from scaletrain.data.corpus import open_data
    from scaletrain.data.samples import TrainSamples, ValidSamples

    train, valid, _ = open_data(cfg.data, cfg.model.vocab_size)
    return Datasets(TrainSamples(train, cfg.model.seq_len, seed), ValidSamples(valid, cfg.model.seq_len))


class Trainer:
    """Implements the harness's Engine protocol for one process (data-parallel size 1)."""

    def __init__(self, cfg: Config, run_dir: str | Path, seed: int | None = None, datasets: Datasets | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.seed = cfg.train.seed if seed is None else seed
        self.seq_len = cfg.model.seq_len
        self.global_batch_size = cfg.train.global_batch_size
        self.micro_batch_size = cfg.train.micro_batch_size
        self.accum = self.global_batch_size // self.micro_batch_size
        self.device = resolve_device(cfg.train.device)
        self.data = datasets if datasets is not None else load_datasets(cfg, self.seed)
        self.eval_tokens = int(self.data.valid.num_label_tokens)
        self.flops_per_token = flops_per_token(cfg.model)
        self.model: GPT | None = None
        self.optimizer = None
        self.metrics: MetricsLogger | None = None
        self.step = 0  # optimizer steps taken since run start

    # ------------------------------------------------------------------ engine protocol
    def init(self) -> None:
        """Untimed: threads, seeded build, warm-up on synthetic tokens, then reset to the cold-start state."""
        if self.device.type == "cpu":
            setup_cpu(self.cfg.train.threads)
        torch.manual_seed(self.seed)
        self.model = GPT(self.cfg.model).to(self.device)
        if self.cfg.train.compile:
            for name, block in list(self.model.blocks.items()):
                self.model.blocks[name] = torch.compile(block)
        initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim, self.device.type)
        self._warm_up()
        # Reset: warm-up touched weights and optimizer moments; a fresh optimizer and the saved weights make the
        # timed run identical to one that never warmed up.
        self.model.load_state_dict(initial)
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim, self.device.type)
        self.step = 0
        self.metrics = MetricsLogger(self.run_dir, total_steps=self._planned_steps(),
                                     progress=self.cfg.train.progress)
        self._t_last = time.perf_counter()

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; raises NonFiniteLoss before touching the weights."""
        t0 = time.perf_counter()
        consumed = self.step * self.global_batch_size
        batches = [self.data.train.rank_batch(consumed, self.global_batch_size, 0, 1, self.micro_batch_size, i)
                   for i in range(self.accum)]
        loss = self._forward_backward(batches)
        step_number = self.step + 1
        if not math.isfinite(loss):
            raise NonFiniteLoss(step_number, loss)
        grad_norm = self._clip()
        if not math.isfinite(grad_norm):
            raise NonFiniteLoss(step_number, grad_norm)
        lr = lr_at(self.cfg.optim.init_checkpoint_step(self.global_batch_size) + step_number,
                   self.cfg.optim, self.global_batch_size)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step_number
        dt = time.perf_counter() - t0
        tokens_per_s = self.global_batch_size * self.seq_len / dt
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": self.step * self.global_batch_size * self.seq_len,
                  "tokens_per_s": tokens_per_s, "step_time_s": dt,
                  "model_tflops": tokens_per_s * self.flops_per_token / 1e12}
        if self.step % self.cfg.train.log_interval == 0:
            self.metrics.log(record)
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean cross-entropy over the whole validation set."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in self.data.valid.batches(self.micro_batch_size):
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            with self._autocast():
                total += loss_sum(self.model(inputs), labels).double()
        self.model.train()
        value = total.item() / self.eval_tokens
        self.metrics.log({"step": self.step, "eval_loss": value,
                          "tokens": self.step * self.global_batch_size * self.seq_len})
        return value

    def finish(self, result: dict) -> None:
        """Close metrics sinks; the harness writes result.json."""
        if self.metrics is not None:
            self.metrics.close()

    # ------------------------------------------------------------------ internals
    def _forward_backward(self, batches) -> float:
        n_labels = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        total = 0.0
        for inputs, labels in batches:
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            with self._autocast():
                logits = self.model(inputs)
            # Normalise by the global label count so accumulation gives the same gradient as one big batch.
            loss = loss_sum(logits, labels) / n_labels
            loss.backward()
            total += loss.item()
        return total

    def _clip(self) -> float:
        clip = self.cfg.optim.grad_clip
        max_norm = clip if clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _autocast(self):
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _warm_up(self, steps: int = 2) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        v = self.cfg.model.vocab_size
        for _ in range(steps):
            x = torch.randint(0, v, (self.micro_batch_size, self.seq_len), generator=gen).to(self.device)
            with self._autocast():
                # Full-length synthetic batches so shapes (and any compiled graphs) match the timed run.
                loss = loss_sum(self.model(x), x) / x.numel()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad(), self._autocast():
            self.model(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _planned_steps(self) -> int:
        gbs = self.global_batch_size
        limit = self.cfg.optim.decay_steps(gbs) - self.cfg.optim.init_checkpoint_step(gbs)
        return self.cfg.train.max_steps or max(limit, 1)

