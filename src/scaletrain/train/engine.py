"""The training engine: model parts, optimizer, data and metrics of one run, stepped by the training loop (loop.py).

One `train_step()` is one optimizer step over one global batch; `evaluate()` covers the whole validation set.
`init()` is the untimed part of an MLPerf run: join the mesh, build and parallelize the model, warm up on
synthetic data, then put weights, optimizer and data position back exactly where a cold start would have them.

The same code runs one process or any layout of ranks: each data-parallel rank reads its slice of the global
batch, the loss of a step is normalised by the global label count, and gradients are summed (not averaged)
over data and context parallel ranks, so the loss and the update do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from scaletrain.config import Config
from scaletrain.model.flops import flops_per_token
from scaletrain.model.loss import IGNORE_INDEX, loss_sum
from scaletrain.parallel import collective_check
from scaletrain.parallel.layout import Layout
from scaletrain.sim.catalog import mfu_peak
from scaletrain.train.cpu_bf16 import bf16_gemm_context
from scaletrain.train.distributed import init_distributed, local_rank
from scaletrain.train.grad_norm import align_grad_placements, clip_grads_, total_grad_norm
from scaletrain.train.host import check_host_memory, peak_memory_gib, setup_cpu
from scaletrain.train.metrics import MetricsLogger
from scaletrain.train.moe_stats import MoEStats
from scaletrain.train.optim import build_optimizer, lr_at, set_lr
from scaletrain.train.perf import StepClock, auto_checkpoint_interval, result_block, start_run, timing_waits
from scaletrain.train.protocol import NonFiniteLoss
from scaletrain.train.signals import StopSignals
from scaletrain.train.sinks import optional_sinks


@dataclass
class Datasets:
    """Training samples and the fixed validation set of a run."""

    train: Any  # scaletrain.data.samples.TrainSamples (or the SFT set with the same sampling interface)
    valid: Any  # scaletrain.data.samples.ValidSamples


def resolve_device(name: str) -> torch.device:
    """'auto' -> this rank's CUDA device when present, else CPU; 'cuda' without a GPU is a clear error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but no CUDA device is available")
        return torch.device("cuda", local_rank())
    return torch.device(name)


def load_datasets(cfg: Config, seed: int) -> Datasets:
    """Open the train/valid datasets named by cfg.data (or the default corpus), checked against the model's vocab.

    data.format="sft": packed input/output pairs (default: the KJV proxy set), same sampling interface.
    """
    from scaletrain.data.corpus import open_data
    from scaletrain.data.samples import TrainSamples, ValidSamples

    if cfg.data.format == "sft":
        from scaletrain.data.sft import open_sft_datasets

        return Datasets(*open_sft_datasets(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, seed))
    train, valid, _ = open_data(cfg.data, cfg.model.vocab_size)
    return Datasets(TrainSamples(train, cfg.model.seq_len, seed), ValidSamples(valid, cfg.model.seq_len))


class Trainer:
    """Implements the loop's Engine protocol on one process or on every rank of a layout (cfg.parallel)."""

    def __init__(self, cfg: Config, run_dir: str | Path, seed: int | None = None, datasets: Datasets | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.seed = cfg.train.seed if seed is None else seed
        self.seq_len = cfg.model.seq_len
        self.global_batch_size = cfg.train.global_batch_size
        self.micro_batch_size = cfg.train.micro_batch_size
        self.device = resolve_device(cfg.train.device)
        self.rank, self.world_size = init_distributed(self.device)
        self.layout = Layout.from_config(cfg, self.world_size)  # raises before any work with every problem
        # A model (on CPU) or a step's batches that cannot fit fail here, not in the allocator.
        check_host_memory(cfg, self.layout, self.device.type)
        self.accum = self.global_batch_size // self.layout.dp // self.micro_batch_size
        self.data = datasets if datasets is not None else load_datasets(cfg, self.seed)
        self.eval_tokens = int(self.data.valid.num_label_tokens)
        self.flops_per_token = flops_per_token(cfg.model, lora_rank=cfg.lora.rank, lora_targets=tuple(cfg.lora.targets))
        # llama2_70b_lora logs the dataset sizes in sequences (GovReport: 3901 train, 173 eval).
        self.train_samples = int(getattr(self.data.train, "num_samples", 0))
        self.eval_samples = int(getattr(self.data.valid, "num_sequences", 0))
        self.peak = mfu_peak(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self._run_peak_gib: float | None = None  # peak memory when the run stopped (before its final save)
        self.mesh: Any = None  # DeviceMesh of the layout, built in init() (None on one process)
        self.pm: Any = None  # parallel.parallelize.ParallelModel, built in init()
        self.schedule: Any = None  # the pipeline schedule when parallel.pp > 1
        self.optimizers: list = []  # one per model part, so optimizer state is named like the parameters
        from scaletrain.checkpoint.checkpointer import Checkpointer

        self.checkpointer = Checkpointer(cfg, self.run_dir)
        self.resume_path = self.checkpointer.find(cfg.checkpoint.resume)
        self._resume_info: dict | None = None
        if self.resume_path is not None:
            from scaletrain.checkpoint.safe_load import read_trainer

            # Read now, types checked: a bad checkpoint is a one-line error before any work, not a KeyError later.
            self._resume_info = read_trainer(self.resume_path)
        self.metrics: MetricsLogger | None = None
        self.stop_signals = StopSignals()  # SIGTERM/SIGUSR1: save and stop (from init to finish inside running())
        self._in_run = False
        self.step = 0  # optimizer steps taken since run start
        self._loss_scale = 1.0
        self.clock = StepClock(self.device)  # the step breakdown (train/perf.py)
        self.prediction: dict | None = None  # prediction.json of this run (rank 0)
        self.step_times: list[float] = []

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model when it holds one part (no pipeline parallelism); see `pm.parts` otherwise."""
        if self.pm is None or len(self.pm.parts) != 1:
            raise AttributeError("the model is split into pipeline stages: use trainer.pm.parts")
        return self.pm.parts[0]

    @property
    def platform(self) -> str:
        """submission_platform: '<world size>x<device name>'."""
        name = torch.cuda.get_device_name(self.device).replace(" ", "-") if self.device.type == "cuda" else "CPU"
        return f"{self.world_size}x{name}"

    # ------------------------------------------------------------------ engine protocol
    def resume_state(self) -> dict | None:
        """trainer.json of the checkpoint init() resumes (checkpoint.resume), or None for a fresh run."""
        return self._resume_info

    @contextmanager
    def running(self) -> Iterator[None]:
        """The process-wide hooks of a run, for the block (run_loop enters it around init..finish): collective waits
        timed for comm_exposed_s (train/perf.py) and, under SCALETRAIN_CHECK_COLLECTIVES=1, every tensor handed to a
        collective checked (parallel/collective_check.py), and SIGTERM/SIGUSR1 taken over from the end of init()
        (train/signals.py). Torch's own functions and the previous signal handlers are back on every way out,
        exception included; a Trainer stepped outside it reports comm_exposed_s 0 and does not catch signals."""
        self._in_run = True
        try:
            with collective_check.checking(), timing_waits(self.device):
                yield
        finally:
            # init() took SIGTERM/SIGUSR1 over; a run that raised before finish() gives them back here.
            self.stop_signals.uninstall()
            self._in_run = False

    def init(self) -> None:
        """Untimed: threads, mesh, parallelized build, warm-up on synthetic tokens, reset to the cold-start state."""
        from scaletrain.parallel.parallelize import parallelize

        if self.device.type == "cpu":
            setup_cpu(self._threads())
        if self.world_size > 1:
            self.mesh = self.layout.build_mesh(self.device.type)
        self._coords()
        self.pm, self.schedule = parallelize(
            self.cfg, self.layout, self.mesh, self.device, self.seed, loss_fn=self._pipeline_loss
        )
        self.moe = MoEStats(
            self.pm.parts, self.cfg.model.n_layers, self.cfg.model.moe.n_experts, self.accum, self.device
        )
        self.moe.ignore_pipeline_inference(self.pm.stages)
        self.optimizers = self._build_optimizers()
        self._warm_up()
        self.moe.reset()
        # Reset: the init is a pure function of (seed, name, index), so re-running it restores the exact
        # cold-start weights; fresh optimizers drop the warm-up's moments.
        with torch.no_grad():
            for part in self.pm.parts:
                part.init_weights(self.seed)
        if self.cfg.checkpoint.init_from:
            self._load_init_weights()
        # Adapter dropout draws from the global generator: a function of the seed, not of the process.
        torch.manual_seed(self.seed * 1000 + self.rank)
        self.optimizers = self._build_optimizers()
        self.step = 0
        if self.resume_path is not None:
            info = self.checkpointer.load(self.resume_path, self.pm.parts, self.optimizers)
            self.step = int(info["step"])
        self._fp8_scales()  # after the last write to the weights before training (reset, init_from, resume)
        if self.rank == 0:
            self.metrics = MetricsLogger(
                self.run_dir,
                total_steps=self._planned_steps(),
                progress=self.cfg.train.progress,
                first_step=self.step,
                total_label=self._budget_label(),
                target=self.cfg.train.target_eval_loss,
                memory_label="max allocated" if self.device.type == "cuda" else "peak RSS",
                sinks=optional_sinks(self.cfg, self.run_dir),
            )
        self.prediction = start_run(self)  # measures the device; rank 0 writes prediction.json
        if self.checkpointer.auto:
            auto_checkpoint_interval(self)  # checkpoint.interval_steps = "auto", from the prediction
        if self._in_run:  # only a run (run_loop, inside running()) saves on a signal; a bare Trainer leaves them be
            self.stop_signals.install()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.world_size > 1:
            dist.barrier()  # run_start is stamped right after init: every rank starts the clock together

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; raises NonFiniteLoss before touching the weights."""
        t0 = self.clock.start()
        consumed = self.step * self.global_batch_size
        batches = [
            self.data.train.rank_batch(
                consumed, self.global_batch_size, self.dp_rank, self.layout.dp, self.micro_batch_size, i
            )
            for i in range(self.accum)
        ]
        self.clock.mark()
        loss = self._forward_backward(batches)
        self.clock.mark()
        step_number = self.step + 1
        if not math.isfinite(loss):
            raise NonFiniteLoss(step_number, loss)
        params = [p for p in self.pm.parameters() if p.requires_grad]  # LoRA: the adapters only
        align_grad_placements(params)
        if self.pm.tied is not None:
            self.pm.tied()
        pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        grad_norm = total_grad_norm(params, pp_group, self.pm.tied.is_duplicate if self.pm.tied else None)
        if not math.isfinite(grad_norm):
            raise NonFiniteLoss(step_number, grad_norm)
        clip_grads_(params, self.cfg.optim.grad_clip, grad_norm)
        lr = lr_at(
            self.cfg.optim.init_checkpoint_step(self.global_batch_size) + step_number,
            self.cfg.optim,
            self.global_batch_size,
        )
        for opt in self.optimizers:
            set_lr(opt, lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
        self._fp8_scales(trainable_only=True)
        self.clock.mark()
        moe_record = self.moe.finish_step(self.world_size, self.accum * self.layout.dp_cp)
        self.step = step_number
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.step_times.append(dt)
        tokens_per_s = self.global_batch_size * self.seq_len / dt
        record: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.step * self.global_batch_size * self.seq_len,
            "tokens_per_s": tokens_per_s,
            "step_time_s": dt,
            "model_tflops": tokens_per_s * self.flops_per_token / 1e12,
            "model_tflops_per_device": tokens_per_s * self.flops_per_token / 1e12 / self.world_size,
            "peak_mem_gib": peak_memory_gib(self.device),
            "world_size": self.world_size,  # what `sim calibrate RUN_DIR` prices the run at
            **self.clock.parts(dt),  # data_s, fwd_bwd_s, optimizer_s, comm_exposed_s, other_s (train/perf.py)
            **moe_record,  # MoE models only: router statistics (train/moe_stats.py)
        }
        if self.peak is not None:
            record["gpu"] = self.peak[0]  # the catalog key (sim/hardware/gpus.toml)
            record["mfu"] = record["model_tflops_per_device"] / self.peak[1]
            record["mfu_peak"] = f"{self.peak[0]} dense bf16 {self.peak[1]:g} TFLOP/s"
        if self.metrics is not None and self.step % self.cfg.train.log_interval == 0:
            self.metrics.log(record)
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean cross-entropy over the whole validation set (identical on every rank)."""
        t0 = time.perf_counter()
        for part in self.pm.parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in self._eval_batches():
            total += self._eval_loss_sum(inputs, labels)
        self._end_eval()
        value = self._sum_over_ranks(total) / self.eval_tokens
        if self.metrics is not None:
            tokens = self.step * self.global_batch_size * self.seq_len
            self.metrics.log(
                {"step": self.step, "eval_loss": value, "tokens": tokens, "eval_s": time.perf_counter() - t0}
            )
        return value

    def finish(self, result: dict) -> None:
        """Publish a pending asynchronous checkpoint and close metrics sinks; the loop writes result.json."""
        self.stop_signals.uninstall()
        try:
            self.checkpointer.finish()
        finally:
            if self.metrics is not None:
                self.metrics.close()

    # ------------------------------------------------------------------ checkpoints (asked by the loop)
    def wait_for_saves(self) -> None:
        """Publish an asynchronous save still in flight (the loop calls this before result.json); a failed one is
        removed and raised (DiskFullError for a full disk, CheckpointError otherwise)."""
        self.checkpointer.finish()

    def checkpoint_due(self) -> bool:
        """Whether the loop should save now (called after an evaluation; same answer on all ranks)."""
        if self.step == self.checkpointer.last_step:
            return False  # this step is already saved (a signal save just before its evaluation, then resumed)
        return self.checkpointer.due(self.step)

    def final_checkpoint_due(self) -> bool:
        """Whether to save the last step of a finished run (Checkpointer.save_final; not twice the same step)."""
        # The run's peak memory is read here, before the final save: that save is not part of the run.
        self._run_peak_gib = peak_memory_gib(self.device)
        return self.checkpointer.save_final and self.step != self.checkpointer.last_step

    def stop_signal(self) -> int:
        """SIGTERM/SIGUSR1 number when any rank received one since init(), else 0; same on all ranks (collective)."""
        return self.stop_signals.agreed(self.device)

    def save_checkpoint(self, loop_state: dict) -> Path:
        """Save model, optimizers and trainer state at the current step, the loop's state under "loop" in
        trainer.json (`{}`: none, a checkpoint only ever loaded as weights); returns the checkpoint's path."""
        from scaletrain.checkpoint.checkpointer import trainer_state

        # The loop state replaces the "harness" entry that checkpoints before train/loop.py carried.
        state = {k: v for k, v in trainer_state(self.step, self.cfg, self.layout, None).items() if k != "harness"}
        t0 = time.perf_counter()
        path = self.checkpointer.save(self.step, self.pm.parts, self.optimizers, {**state, "loop": loop_state})
        if self.metrics is not None and not self.metrics.closed:
            self.metrics.log({"step": self.step, "checkpoint_s": time.perf_counter() - t0})
        return path

    def result_extra(self) -> dict:
        """What result.json gains besides the loop's fields: "predicted_vs_measured" (train/perf.py)."""
        tokens = self.global_batch_size * self.seq_len
        return result_block(self.prediction, self.step_times, tokens, self.device, self._run_peak_gib)

    def _load_init_weights(self) -> None:
        from scaletrain.checkpoint.init_from import load_init_weights

        load_init_weights(self.pm.parts, self.cfg.model, self.cfg.checkpoint.init_from)

    def _build_optimizers(self) -> list:
        return [build_optimizer(part.parameters(), self.cfg.optim, self.device.type) for part in self.pm.parts]

    def _end_eval(self) -> None:
        # A forward without backward leaves FSDP units that skip resharding after forward (the last block, the
        # root) holding gathered copies; free them so the next write to the shards (optimizer, reset) is what the
        # next forward gathers.
        from torch.distributed.fsdp import FSDPModule

        for part in self.pm.parts:
            part.train()
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ------------------------------------------------------------------ layout helpers
    def _coords(self) -> None:
        m = self.mesh
        self.dp_rank = m["dp"].get_local_rank() if m is not None else 0
        self.cp_rank = m["cp"].get_local_rank() if m is not None else 0
        tp_rank = m["tp"].get_local_rank() if m is not None else 0
        pp_rank = m["pp"].get_local_rank() if m is not None else 0
        # Exactly one rank per (dp, cp) coordinate reports each loss: tensor-parallel peers hold the same value
        # and only the last pipeline rank has one.
        self._reports_loss = tp_rank == 0 and pp_rank == self.layout.pp - 1

    def _threads(self) -> int:
        import os

        per_node = self.cfg.train.threads
        if not per_node:
            return 0
        return max(1, per_node // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def _shard(self, t: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's share of a [batch, seq] tensor."""
        if self.layout.cp == 1:
            return t
        from scaletrain.parallel.context_parallel import shard_sequence

        return shard_sequence(t, self.layout.cp, self.cp_rank)

    def _context(self):
        stack = contextlib.ExitStack()
        if self.cfg.train.dtype == "bf16" and not self.pm.uses_fsdp_mixed_precision:
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        stack.enter_context(bf16_gemm_context(self.device, self.cfg.train.dtype, self.cfg.train.compile))
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())  # cross-entropy on vocabulary-sharded logits, never gathered
        return stack

    @staticmethod
    def _scalar(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def _sum_over_ranks(self, value: torch.Tensor) -> float:
        """Sum of `value` over (dp, cp) coordinates, counted once per coordinate; same result on every rank."""
        if self.world_size == 1:
            return float(value)
        t = value.detach().to(torch.float64) * (1.0 if self._reports_loss else 0.0)
        dist.all_reduce(t)
        return float(t)

    def _global_label_count(self, batches) -> int:
        n = torch.tensor(
            sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches), dtype=torch.float64, device=self.device
        )
        if self.layout.dp > 1:
            dist.all_reduce(n, group=self.mesh["dp"].get_group())
        return int(n)

    # ------------------------------------------------------------------ forward/backward
    def _forward_backward(self, batches) -> float:
        # Gradients are averaged over the dp x cp ranks by DDP/FSDP; scaling by that size turns it into the sum
        # of per-rank loss sums over the global label count, i.e. the single-process gradient.
        self._loss_scale = self.layout.dp_cp / self._global_label_count(batches)
        if self.schedule is not None:
            return self._pipeline_step(batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        model = self.pm.parts[0]
        for inputs, labels in batches:
            inputs = self._shard(inputs.to(self.device, non_blocking=True))
            labels = self._shard(labels.to(self.device, non_blocking=True))
            with self._context():
                loss = loss_sum(model(inputs), labels) * self._loss_scale
                loss.backward()
            total += self._scalar(loss.detach()).double()
        return self._sum_over_ranks(total) / self.layout.dp_cp

    def _pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum(output, labels) * self._loss_scale

    def _pipeline_step(self, batches) -> float:
        inputs = self._shard(torch.cat([b[0] for b in batches]).to(self.device))
        labels = self._shard(torch.cat([b[1] for b in batches]).to(self.device))
        losses: list[torch.Tensor] = []
        last = self.pm.has_last_stage(self.layout.num_stages)
        with self._context():
            args = (inputs,) if self.pm.has_first_stage else ()
            self.schedule.step(*args, target=labels if last else None, losses=losses)
        total = (
            cast(torch.Tensor, sum(self._scalar(x.detach()).double() for x in losses))
            if losses
            else torch.zeros((), dtype=torch.float64, device=self.device)
        )
        return self._sum_over_ranks(total) / self.layout.dp_cp

    def _eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's summed cross-entropy of one evaluation batch (zero where no loss is computed)."""
        inputs, labels = self._shard(inputs.to(self.device)), self._shard(labels.to(self.device))
        if self.schedule is None:
            with self._context():
                return self._scalar(loss_sum(self.pm.parts[0](inputs), labels)).double()
        self._loss_scale = 1.0
        losses: list[torch.Tensor] = []
        last = self.pm.has_last_stage(self.layout.num_stages)
        with self._context():
            args = (inputs,) if self.pm.has_first_stage else ()
            self.schedule.eval(*args, target=labels if last else None, losses=losses)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return cast(torch.Tensor, sum(self._scalar(x.detach()).double() for x in losses))

    def _eval_batches(self):
        """This dp rank's validation batches, padded to a fixed count and shape on every rank.

        Equal counts keep collectives (FSDP gathers, pipeline sends) matched across ranks; a fixed shape keeps
        pipeline buffers and compiled graphs valid. Padding rows carry no label.
        """
        valid, mbs, dp = self.data.valid, self.micro_batch_size, self.layout.dp
        per_call = mbs * (self.accum if self.schedule is not None else 1)
        n_calls = max(-(-(valid.rank_range(r, dp)[1] - valid.rank_range(r, dp)[0]) // per_call) for r in range(dp))
        lo, hi = valid.rank_range(self.dp_rank, dp)
        for i in range(n_calls):
            start = lo + i * per_call
            inputs = torch.zeros(per_call, self.seq_len, dtype=torch.long)
            labels = torch.full((per_call, self.seq_len), IGNORE_INDEX, dtype=torch.long)
            if start < hi:
                x, y = valid.batch(start, min(per_call, hi - start))
                inputs[: len(x)], labels[: len(y)] = x, y
            yield inputs.to(self.device), labels.to(self.device)

    # ------------------------------------------------------------------ warm-up
    def _warm_up(self, steps: int = 2) -> None:
        gen = torch.Generator().manual_seed(self.seed + self.dp_rank)
        v = self.cfg.model.vocab_size
        for _ in range(steps):
            batches = []
            for _ in range(self.accum):
                # Full-length synthetic batches so shapes (pipeline buffers, compiled graphs) match the timed run.
                x = torch.randint(0, v, (self.micro_batch_size, self.seq_len), generator=gen)
                batches.append((x, x))
            self._forward_backward(batches)
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            self._fp8_scales(trainable_only=True)
        with torch.no_grad():
            for part in self.pm.parts:
                part.eval()
            self._eval_loss_sum(*next(iter(self._eval_batches())))
            self._end_eval()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _fp8_scales(self, trainable_only: bool = False) -> None:
        # FSDP2 gathers FP8 weights with scales computed once per weight update (torchao's recipe), not per gather.
        if self.cfg.train.fp8 and self.layout.data_parallel_kind in ("fsdp", "hsdp"):
            from scaletrain.model.fp8 import precompute_fp8_scales

            precompute_fp8_scales(self.pm.parts, trainable_only)

    def _planned_steps(self) -> int:
        gbs = self.global_batch_size
        limit = self.cfg.optim.decay_steps(gbs) - self.cfg.optim.init_checkpoint_step(gbs)
        return self.cfg.train.max_steps or max(limit, 1)

    def _budget_label(self) -> str:
        """What the planned step count is: the step budget (train.max_steps) or the end of the lr decay."""
        return "step budget" if self.cfg.train.max_steps else "decay end"
