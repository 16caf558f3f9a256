"""Goodput under failures: interruptions, checkpoint cost, the optimal checkpoint interval, expected days.

A run of `train_s` seconds of steady training on `gpus` GPUs is interrupted at random; each interruption throws away
the work since the last complete checkpoint and costs a restart. Checkpoints cost time too. The model:

- **Interruptions** arrive as a Poisson process, `interruptions_per_gpu_hour` per GPU, so the job's mean time
  between failures is M = 1 / (rate x GPUs). Default: Llama 3 (Dubey et al. 2024, arXiv:2407.21783, §3.3.4, Table
  5): 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100s (466 in all; the other 47
  were planned maintenance the operator schedules), 419 / (54 x 24 x 16,384) = 1.97e-5 per GPU-hour, M = 3.1 h
  at 16,384 GPUs.
- **Checkpoint bytes** (`checkpoint_bytes`): the trained parameters times the bytes a checkpoint keeps of each.
- **Save** (blocking, delta): the bytes each node writes over its storage bandwidth, every node writing its share
  at once (`Node.storage_gbps`). With asynchronous checkpointing only the device-to-host copy blocks
  (`Node.host_copy_gbps` per GPU); the write (W) goes on in the background, and the checkpoint it writes only
  counts once written: a failure during those W seconds rolls back one interval further.
- **Restart** (R): relaunch (`RELAUNCH_S`) + restore (the bytes read back at the same bandwidth) + warm-up (the
  first steps, communicator creation and start-up of a run, `fixed_costs.warmup_s`, fitted on MLPerf logs).
- **Interval** (tau, compute seconds between checkpoints): Young (1974) tau = sqrt(2 delta M) minimises the first-order
  overhead delta/tau + (tau/2 + W + R)/M; Daly (2006, "A higher order estimate of the optimum checkpoint interval for
  restart dumps", FGCS 22:303) refines it to tau = sqrt(2 delta M) [1 + sqrt(delta/2M)/3 + (delta/2M)/9] - delta
  for delta < 2M (tau = M otherwise), the optimum of the complete model below to well under 1%. The interval used
  is Daly's, rounded to whole steps, and never shorter than the background write (a save waits for the previous one).
- **Expected wall time** (Daly 2006's complete model, exact for Poisson failures): a segment of L = tau + delta
  seconds, restarted after each failure with R (failures during a restart allowed), takes on average
  M e^{R/M} (e^{L/M} - 1); the run is its segments one after another. Goodput = train_s / that sum.
  Asynchronous saves enter it with R + W (the first-order effect of the rolled-back write, exact in the limit).

`monte_carlo` samples the same process (failure times, rollback to the last complete checkpoint, restarts that can
fail) and reports the spread: p50/p90 days. Stdlib and numpy; no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scaletrain.sim.catalog import DEFAULT_HOST_COPY_GBPS, Node
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fixed_costs import warmup_s as run_warmup_s
from scaletrain.sim.workload import ClusterLayout, Workload

LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
"""Unexpected job interruptions in Llama 3 405B pre-training's 54-day snapshot (Dubey et al. 2024, §3.3.4)."""
LLAMA3_SNAPSHOT_DAYS = 54
"""Length of that snapshot, days."""
LLAMA3_GPUS = 16_384
"""H100 GPUs of that job."""
INTERRUPTIONS_PER_GPU_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_SNAPSHOT_DAYS * 24 * LLAMA3_GPUS)
"""Default interruption rate per GPU-hour: 419 / (54 x 24 x 16,384) = 1.97e-5 (planned maintenance left out)."""

RELAUNCH_S = 600.0
"""Seconds from a failure to the job's processes running again: detection, the scheduler's requeue and node
health checks, process start and model construction. Daly (2006) works his examples with R = 10 min; no fleet paper
we cite publishes the figure for LLM jobs, so it is that assumption, overridable (`--relaunch-min`). Communicator
creation and the slow first steps are not in it: `warmup_s` adds them from the fitted set."""

MEGATRON_BYTES_PER_PARAM = 14.0
"""Bytes per trained parameter in a Megatron-LM (torch_dist) checkpoint of the mixed-precision recipe the simulator
prices: bf16 weights (2) + the distributed optimizer's fp32 main parameters (4) and Adam's two fp32 moments (8)."""
TRAINER_BYTES_PER_PARAM = 12.0
"""Bytes per trained parameter in a scaletrain checkpoint (checkpoint/checkpointer.py): fp32 parameters, which are
the master copy (bf16 is only the compute cast), + AdamW's two fp32 moments."""


def checkpoint_bytes(w: Workload, layout: ClusterLayout, trainer: bool = False) -> float:
    """Bytes of one full checkpoint of `w`: its trained parameters (LoRA: the adapters alone; the frozen base is
    rebuilt from its source, never saved) times `MEGATRON_BYTES_PER_PARAM`, or `TRAINER_BYTES_PER_PARAM` with
    `trainer` (scaletrain's own checkpoints, which also file a tied output layer's weight and moments under the
    head's name: the embedding twice).

    The bytes do not depend on `layout`: a distributed checkpoint (Megatron's fully parallel save, torch DCP) holds
    each logical tensor once, replicas deduplicated, however the tensors are sharded; the layout only decides which
    ranks write which part (`plan_goodput` spreads them over every node)."""
    del layout  # kept in the signature: the callers price a layout, and the bytes are the same for every one
    inv = w.inventory
    per_param = TRAINER_BYTES_PER_PARAM if trainer else MEGATRON_BYTES_PER_PARAM
    params = float(inv.trainable_params)
    if trainer and not w.shape.lora and w.shape.facts.tied_head:
        params += w.shape.vocab * w.shape.hidden
    return params * per_param


@dataclass(frozen=True)
class Goodput:
    """Expected cost of failures and checkpoints for one run (`plan_goodput`): the inputs it was priced with, the
    times it derived, the interval it chose and the goodput and days that follow."""

    interruptions_per_gpu_hour: float
    """Poisson interruption rate per GPU-hour (default `INTERRUPTIONS_PER_GPU_HOUR`, Llama 3's)."""
    mtbf_h: float
    """The job's mean time between failures, hours: 1 / (rate x GPUs)."""
    gpus: int
    """GPUs of the job."""
    nodes: int
    """Nodes the checkpoint is spread over (every node writes its share)."""
    ckpt_bytes: float
    """Bytes of one full checkpoint."""
    storage_gbps: float
    """Write/read bandwidth per node to the checkpoint storage, GB/s."""
    async_save: bool
    """Asynchronous checkpointing: only the device-to-host copy blocks."""
    host_copy_gbps: float
    """Device-to-host copy rate per GPU, GB/s (what an asynchronous save blocks on)."""
    save_s: float
    """Blocking seconds per checkpoint (delta): the write, or with async_save the device-to-host copy."""
    write_s: float
    """Seconds the write to storage takes (bytes per node / storage_gbps): blocking, or in the background."""
    restore_s: float
    """Seconds to read the checkpoint back after a failure (bytes per node / storage_gbps)."""
    relaunch_s: float
    """Seconds to relaunch the job's processes (`RELAUNCH_S` unless given)."""
    warmup_s: float
    """Seconds a restarted run takes beyond steady steps to get going (start-up, communicators, first steps)."""
    restart_s: float
    """R = relaunch_s + restore_s + warmup_s."""
    step_time_s: float
    """Seconds per training step (checkpoints fall on step boundaries)."""
    interval_young_s: float
    """Young's first-order optimum sqrt(2 delta M), seconds of training between checkpoints."""
    interval_daly_s: float
    """Daly's higher-order optimum, seconds."""
    interval_s: float
    """Seconds of training between checkpoints used: interval_steps x step_time_s."""
    interval_steps: int
    """Training steps between checkpoints: Daly's optimum (or the interval asked for) in whole steps, >= 1 and
    no shorter than the background write of an async save."""
    interval_chosen: str
    """"daly" (the optimum) or "given" (an interval asked for)."""
    save_fraction: float
    """First-order overhead of saving: delta / tau."""
    rework_fraction: float
    """First-order overhead of recomputing lost work: (tau/2 + W) / M (W = the background write of async saves,
    0 otherwise)."""
    restart_fraction: float
    """First-order overhead of restarts: R / M."""
    goodput_first_order: float
    """1 / (1 + save_fraction) x (1 - rework_fraction - restart_fraction): useful over wall time to first order."""
    goodput: float
    """Useful over wall time under the complete model (Daly 2006): ideal_days / expected_days."""
    ideal_days: float
    """Days of steady training with no failure and no checkpoint."""
    expected_days: float
    """Expected wall-clock days with checkpoints, failures and restarts."""
    expected_failures: float
    """Interruptions expected over the run: expected wall time / M."""
    lost_fraction: float
    """1 - goodput: the share of wall time that trains nothing."""

    def to_dict(self) -> dict:
        """JSON-ready dict of every field."""
        return asdict(self)


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young (1974): sqrt(2 delta M), the minimum of the first-order overhead delta/tau + (tau/2 + R)/M."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly (2006)'s higher-order estimate of the optimum: sqrt(2 delta M) [1 + sqrt(delta/2M)/3 + (delta/2M)/9] -
    delta for delta < 2M, else M."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def segment_wall_s(length_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall seconds to get through a segment of `length_s` seconds (work + save) when each failure, Poisson
    with mean `mtbf_s`, sends it back to its start after a restart of `restart_s` that can fail too (Daly 2006):
    M e^{R/M} (e^{L/M} - 1)."""
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(length_s / mtbf_s)


def expected_wall_s(train_s: float, interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall seconds of `train_s` of training checkpointed every `interval_s` (each save `save_s`): whole
    segments plus the last, shorter one (`segment_wall_s` each)."""
    full = math.floor(train_s / interval_s)
    rest = train_s - full * interval_s
    wall = full * segment_wall_s(interval_s + save_s, restart_s, mtbf_s)
    if rest > 1e-9 * interval_s:
        wall += segment_wall_s(rest + save_s, restart_s, mtbf_s)
    return wall


def first_order_overhead(interval_s: float, save_s: float, restart_s: float, mtbf_s: float, write_s: float = 0.0):
    """(save, rework, restart) fractions of the first-order model: delta/tau, (tau/2 + W)/M, R/M."""
    return save_s / interval_s, (interval_s / 2.0 + write_s) / mtbf_s, restart_s / mtbf_s


def checkpoint_times(
    ckpt_bytes: float,
    gpus: int,
    nodes: int,
    storage_gbps: float,
    async_save: bool = False,
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
) -> tuple[float, float]:
    """(blocking save seconds delta, write seconds W) of a checkpoint of `ckpt_bytes` spread over `nodes` nodes
    writing at `storage_gbps` GB/s each: W = bytes per node / bandwidth; delta = W, or with `async_save` each GPU's
    share copied to host memory at `host_copy_gbps`."""
    write_s = ckpt_bytes / nodes / (storage_gbps * 1e9)
    return (ckpt_bytes / gpus / (host_copy_gbps * 1e9) if async_save else write_s), write_s


def auto_interval(
    ckpt_bytes: float,
    gpus: int,
    nodes: int,
    storage_gbps: float,
    step_time_s: float | None,
    async_save: bool = False,
    interruptions_per_gpu_hour: float | None = None,
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
) -> tuple[int, float, str]:
    """The checkpoint interval a run should use (`checkpoint.interval_steps = "auto"`): (steps, seconds, one line
    saying how). With a step time, Daly's optimum in whole steps (`plan_goodput`'s interval_steps; seconds = 0);
    without one (no prediction), steps = 0 and the optimum in seconds of wall time, for the time trigger. ValueError
    on a value out of range."""
    rate = INTERRUPTIONS_PER_GPU_HOUR if interruptions_per_gpu_hour is None else interruptions_per_gpu_hour
    if step_time_s is not None and math.isfinite(step_time_s) and step_time_s > 0:
        g = plan_goodput(
            step_time_s,
            step_time_s,
            gpus,
            nodes,
            ckpt_bytes,
            storage_gbps,
            async_save,
            rate,
            host_copy_gbps=host_copy_gbps,
        )
        line = (
            f"checkpoint interval auto: every {g.interval_steps} steps ({g.interval_s:.3g} s at the predicted "
            f"{step_time_s:.3g} s/step): Daly's optimum {g.interval_daly_s:.3g} s for a save of {g.save_s:.3g} s "
            f"({ckpt_bytes / 1e9:.3g} GB over {nodes} node(s) at {storage_gbps:.3g} GB/s) and a job MTBF of "
            f"{g.mtbf_h:.3g} h ({rate:.3g} interruptions per GPU-hour x {gpus} GPUs)"
        )
        return g.interval_steps, 0.0, line
    if not (math.isfinite(rate) and rate > 0 and gpus > 0 and nodes > 0 and storage_gbps > 0):
        raise ValueError(
            f"auto checkpoint interval: rate {rate}, GPUs {gpus}, nodes {nodes} and storage "
            f"{storage_gbps} GB/s must be above 0"
        )
    mtbf_s = 3600.0 / (rate * gpus)
    save_s, write_s = checkpoint_times(ckpt_bytes, gpus, nodes, storage_gbps, async_save, host_copy_gbps)
    # At least a second: a zero interval would switch the time trigger off.
    tau = max(daly_interval(save_s, mtbf_s), write_s if async_save else 0.0, 1.0)
    line = (
        f"checkpoint interval auto: every {tau / 60:.3g} min of wall time (no predicted step time): Daly's optimum for "
        f"a save of {save_s:.3g} s and a job MTBF of {mtbf_s / 3600:.3g} h"
    )
    return 0, tau, line


def plan_goodput(
    train_s: float,
    step_time_s: float,
    gpus: int,
    nodes: int,
    ckpt_bytes: float,
    storage_gbps: float,
    async_save: bool = False,
    interruptions_per_gpu_hour: float | None = None,
    interval_s: float | None = None,
    *,
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS,
    relaunch_s: float = RELAUNCH_S,
    warmup_s: float = 0.0,
) -> Goodput:
    """Goodput, checkpoint interval and expected days of `train_s` seconds of steady training (steps of
    `step_time_s`) on `gpus` GPUs in `nodes` nodes, checkpointing `ckpt_bytes` at `storage_gbps` GB/s per node
    (module docstring). `interval_s` None = Daly's optimum; `interruptions_per_gpu_hour` None = Llama 3's rate.
    `host_copy_gbps` is the per-GPU device-to-host rate an async save blocks on. ValueError on a value out of range."""
    rate = INTERRUPTIONS_PER_GPU_HOUR if interruptions_per_gpu_hour is None else interruptions_per_gpu_hour
    checks = {
        "train seconds": train_s,
        "step time": step_time_s,
        "GPUs": gpus,
        "nodes": nodes,
        "storage bandwidth": storage_gbps,
        "host copy bandwidth": host_copy_gbps,
        "interruptions per GPU-hour": rate,
    }
    for name, value in checks.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"goodput: {name} must be a finite number above 0, got {value}")
    for name, value in {"checkpoint bytes": ckpt_bytes, "relaunch": relaunch_s, "warm-up": warmup_s}.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"goodput: {name} must be a finite number >= 0, got {value}")
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"goodput: the checkpoint interval must be above 0 seconds, got {interval_s}")
    mtbf_s = 3600.0 / (rate * gpus)
    save_s, write_s = checkpoint_times(ckpt_bytes, gpus, nodes, storage_gbps, async_save, host_copy_gbps)
    restore_s = write_s  # read back over the same links and file system
    background_s = write_s if async_save else 0.0
    restart_s = relaunch_s + restore_s + warmup_s
    young, daly = young_interval(save_s, mtbf_s), daly_interval(save_s, mtbf_s)
    wanted = daly if interval_s is None else interval_s
    # A checkpoint can only be taken between steps, and an async one not before the previous one is written.
    steps = max(1, round(wanted / step_time_s), math.ceil(background_s / step_time_s - 1e-9))
    tau = steps * step_time_s
    f_save, f_rework, f_restart = first_order_overhead(tau, save_s, restart_s, mtbf_s, background_s)
    wall = expected_wall_s(train_s, tau, save_s, restart_s + background_s, mtbf_s)
    return Goodput(
        interruptions_per_gpu_hour=rate,
        mtbf_h=mtbf_s / 3600.0,
        gpus=gpus,
        nodes=nodes,
        ckpt_bytes=ckpt_bytes,
        storage_gbps=storage_gbps,
        async_save=async_save,
        host_copy_gbps=host_copy_gbps,
        save_s=save_s,
        write_s=write_s,
        restore_s=restore_s,
        relaunch_s=relaunch_s,
        warmup_s=warmup_s,
        restart_s=restart_s,
        step_time_s=step_time_s,
        interval_young_s=young,
        interval_daly_s=daly,
        interval_s=tau,
        interval_steps=steps,
        interval_chosen="daly" if interval_s is None else "given",
        save_fraction=f_save,
        rework_fraction=f_rework,
        restart_fraction=f_restart,
        goodput_first_order=(1.0 - f_rework - f_restart) / (1.0 + f_save),
        goodput=train_s / wall,
        ideal_days=train_s / 86400.0,
        expected_days=wall / 86400.0,
        expected_failures=wall / mtbf_s,
        lost_fraction=1.0 - train_s / wall,
    )


def goodput_for(
    w: Workload,
    layout: ClusterLayout,
    node: Node,
    eff: Efficiency,
    train_s: float,
    step_time_s: float,
    *,
    storage_gbps: float | None = None,
    async_save: bool = False,
    interruptions_per_gpu_hour: float | None = None,
    interval_s: float | None = None,
    relaunch_s: float = RELAUNCH_S,
    trainer: bool = False,
) -> Goodput:
    """`plan_goodput` for `w` trained in `layout` on nodes of type `node`: the checkpoint's bytes
    (`checkpoint_bytes`), the nodes the layout fills, the node's storage (or `storage_gbps`) and host-copy rates, and
    the warm-up of a restarted run from the fitted set `eff` (`fixed_costs.warmup_s`: start-up, communicator creation,
    slower first steps)."""
    return plan_goodput(
        train_s,
        step_time_s,
        layout.gpus,
        max(1, math.ceil(layout.gpus / node.gpus_per_node)),
        checkpoint_bytes(w, layout, trainer),
        node.storage_gbps if storage_gbps is None else storage_gbps,
        async_save,
        interruptions_per_gpu_hour,
        interval_s,
        host_copy_gbps=node.host_copy_gbps,
        relaunch_s=relaunch_s,
        warmup_s=run_warmup_s(layout, step_time_s, eff),
    )


def monte_carlo(g: Goodput, runs: int = 1000, seed: int = 0) -> dict:
    """Sample `runs` runs of the process `g` prices and return the spread of their wall time: {"runs", "seed",
    "mean_days", "p50_days", "p90_days", "std_days", "mean_goodput", "mean_failures"}.

    Each run trains `g.ideal_days` of steady work in intervals of `g.interval_s`, each followed by a blocking save
    of `g.save_s`; the checkpoint it starts is complete `g.write_s` later with an async save (at the end of the save
    otherwise). Failure times are exponential with mean `g.mtbf_h` (numpy's seeded generator): a failure rolls the
    work back to the newest complete checkpoint and costs `g.restart_s`, during which another failure restarts the
    restart. All runs advance together, one failure at a time."""
    import numpy as np

    if runs < 1:
        raise ValueError(f"monte_carlo: runs must be >= 1, got {runs}")
    rng = np.random.default_rng(seed)
    mtbf = g.mtbf_h * 3600.0
    total = g.ideal_days * 86400.0
    tau, delta, restart = g.interval_s, g.save_s, g.restart_s
    # When the checkpoint ending segment k (counted from a restart) is complete, relative to the restart.
    durable = g.write_s if g.async_save else 0.0
    done = np.zeros(runs)  # training seconds saved in a complete checkpoint
    wall = np.zeros(runs)
    failures = np.zeros(runs)
    live = np.ones(runs, dtype=bool)
    while live.any():
        idx = np.flatnonzero(live)
        left = total - done[idx]
        segments = np.ceil(left / tau - 1e-9)
        finish = left + segments * delta
        fail_at = rng.exponential(mtbf, idx.size)
        ok = fail_at >= finish
        wall[idx[ok]] += finish[ok]
        live[idx[ok]] = False
        bad = idx[~ok]
        t = fail_at[~ok]
        wall[bad] += t
        failures[bad] += 1
        # Checkpoints complete by the failure: segment k's at k (tau + delta) + durable after the restart.
        complete = np.clip(np.floor((t - durable) / (tau + delta)), 0, segments[~ok])
        done[bad] = np.minimum(done[bad] + complete * tau, total)
        # The restart: R seconds, begun again after every failure inside it.
        pending = bad
        while pending.size:
            t_fail = rng.exponential(mtbf, pending.size)
            through = t_fail >= restart
            wall[pending[through]] += restart
            wall[pending[~through]] += t_fail[~through]
            failures[pending[~through]] += 1
            pending = pending[~through]
    days = wall / 86400.0
    return {
        "runs": runs,
        "seed": seed,
        "mean_days": float(days.mean()),
        "p50_days": float(np.percentile(days, 50)),
        "p90_days": float(np.percentile(days, 90)),
        "std_days": float(days.std(ddof=1)) if runs > 1 else 0.0,
        "mean_goodput": float((total / wall).mean()),
        "mean_failures": float(failures.mean()),
    }


__all__ = [
    "INTERRUPTIONS_PER_GPU_HOUR",
    "RELAUNCH_S",
    "MEGATRON_BYTES_PER_PARAM",
    "TRAINER_BYTES_PER_PARAM",
    "Goodput",
    "checkpoint_bytes",
    "plan_goodput",
    "goodput_for",
    "checkpoint_times",
    "auto_interval",
    "monte_carlo",
    "young_interval",
    "daly_interval",
    "segment_wall_s",
    "expected_wall_s",
    "first_order_overhead",
]
