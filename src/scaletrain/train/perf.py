"""Every run as its own performance test: prediction.json at start, the measured step breakdown, and result.json's
"predicted_vs_measured" block.

Measured breakdown of a step (metrics.jsonl, seconds; `Trainer.train_step` takes the time stamps):
- data_s: building this rank's micro-batches of the global batch;
- fwd_bwd_s: forward and backward of every micro-batch, with the label-count and loss all-reduces and the gradient
  reductions that end the backward;
- optimizer_s: gradient placement, the tied-weight gradient sum of a pipeline, the gradient norm (its all-reduce
  included), clipping, the optimizer step, zero_grad and the FP8 scales;
- other_s: the rest of step_time_s (router statistics, the final device synchronisation, Python between the parts);
  data_s + fwd_bwd_s + optimizer_s + other_s = step_time_s exactly;
- comm_exposed_s: time this rank was blocked waiting for collectives, inside fwd_bwd_s and optimizer_s.

What comm_exposed_s counts: every wait on a `torch.distributed` work handle from Python (`Work.wait`, hooked while a
Trainer runs, see `timing_waits`): the trainer's own all-reduces (synchronous ones wait through it), FSDP2's all-gather
and reduce-scatter waits, and the pipeline schedule's send/receive waits; and every wait on a functional collective
(`torch.distributed._functional_collectives.wait_tensor`, hooked the same way): DTensor's collectives of tensor and
sequence parallelism, eager mode. On CPU (gloo) it is wall time in the wait; on CUDA the time the current stream
stalled on the collective, between CUDA events recorded around the wait (or the host's time in it where that is
longer: a blocking wait). `SCALETRAIN_COMM_TIMING=0` leaves both unhooked (comm_exposed_s is then 0): a way to rule
the hooks out when a collective misbehaves.
Not counted: waits inside C++ that never return to Python (composable DDP's gradient all-reduce, which its reducer
waits for at the end of backward; functional collectives inside a torch.compile graph), and on CUDA FSDP2's
stream-to-stream waits. Those stay in fwd_bwd_s, so comm_exposed_s is a lower bound there.

Evaluation records gain eval_s (the whole evaluation); a checkpoint save adds a line {"step", "checkpoint_s"} (the
time the loop waited for the save; an asynchronous save's background upload is not in it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from scaletrain.log import get_logger
from scaletrain.sim import run_prediction
from scaletrain.train.device_probe import device_figures

log = get_logger(__name__)

PREDICTION_FILE = run_prediction.PREDICTION_FILE
TIMING_ENV = "SCALETRAIN_COMM_TIMING"  # "0": Work.wait and wait_tensor stay torch's own (no comm_exposed_s)


# ---------------------------------------------------------------- exposed communication


class _WaitClock:
    """Seconds spent in `Work.wait` since the hook was installed (a process-wide, monotonic total)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.pending: list = []  # CUDA (start, end, host seconds), resolved after the step's synchronisation
        self.users = 0
        self.cuda = False  # a CUDA run: time the current stream's stall too
        self.original = None
        self.original_funcol = None
        self.lock = threading.Lock()

    def wrap(self, original):
        def wait(work, *args, **kwargs):
            if torch.compiler.is_compiling():  # traced into a graph: no host wait to time, and no graph breaks
                return original(work, *args, **kwargs)
            events = None
            if self.cuda:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            t0 = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    if events is None:
                        self.total += dt
                    else:
                        events[1].record()
                        self.pending.append((*events, dt))

        wait.__doc__ = getattr(original, "__doc__", None)
        return wait

    def seconds(self) -> float:
        """The running total; CUDA waits are resolved here (their events must have completed: synchronise first).

        A CUDA wait counts the longer of the host's time in it (a blocking wait, or gloo) and the stream's stall
        between the events around it (NCCL: the host returns at once and the stream waits)."""
        with self.lock:
            pending, self.pending = self.pending, []
        extra = sum(max(dt, s.elapsed_time(e) / 1e3) for s, e, dt in pending)
        with self.lock:
            self.total += extra
            return self.total


_CLOCK = _WaitClock()


class CommWaits:
    """Hooks `Work.wait` while in use (`install`/`uninstall`, counted, so several Trainers in one process share one
    hook); `seconds()` is the process's total blocked time so far (differences give a step's)."""

    def __init__(self) -> None:
        self.installed = False

    def install(self, device: torch.device | None = None) -> None:
        """Wrap torch's Work.wait (once per process however many users); a CUDA `device` times stream stalls."""
        if self.installed or os.environ.get(TIMING_ENV, "").strip() == "0":
            return
        if device is not None and device.type == "cuda":
            _CLOCK.cuda = True
        work = _work_class()
        if work is None:
            return
        if _CLOCK.users == 0:
            _CLOCK.original = work.wait
            work.wait = _CLOCK.wrap(_CLOCK.original)
            funcol = _funcol()
            if funcol is not None:
                _CLOCK.original_funcol = funcol.wait_tensor
                funcol.wait_tensor = _CLOCK.wrap(funcol.wait_tensor)
        _CLOCK.users += 1
        self.installed = True

    def uninstall(self) -> None:
        """Drop this user; the last one restores torch's Work.wait."""
        if not self.installed:
            return
        self.installed = False
        _CLOCK.users = max(0, _CLOCK.users - 1)  # never below 0: a hook already restored stays restored
        work = _work_class()
        if _CLOCK.users == 0 and work is not None and _CLOCK.original is not None:
            work.wait = _CLOCK.original
            funcol = _funcol()
            if funcol is not None and _CLOCK.original_funcol is not None:
                funcol.wait_tensor = _CLOCK.original_funcol
            _CLOCK.original, _CLOCK.original_funcol, _CLOCK.cuda = None, None, False

    @staticmethod
    def seconds() -> float:
        """Seconds blocked in collectives since the process first hooked them."""
        return _CLOCK.seconds()


@contextmanager
def timing_waits(device: torch.device | None = None) -> Iterator[None]:
    """Collective waits timed (`CommWaits`) for the block only: torch's Work.wait and wait_tensor are its own again on
    every way out, exception included. A CUDA `device` times stream stalls."""
    waits = CommWaits()
    waits.install(device)
    try:
        yield
    finally:
        waits.uninstall()


def _funcol():
    """torch's functional collectives module: DTensor's collectives (tensor parallelism, sequence-parallel norms)
    wait through its module-level `wait_tensor`, which never reaches a Python `Work.wait`."""
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:
        return None
    return funcol if callable(getattr(funcol, "wait_tensor", None)) else None


def _work_class():
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:  # torch without distributed support: nothing to hook
        return None
    return Work


# ---------------------------------------------------------------- one step's parts


class StepClock:
    """Time stamps of one training step: `start()`, then `mark()` after the data, the forward/backward and the
    optimizer (synchronising the device on CUDA, so each part holds its own kernels); `parts(step_time_s)`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[float] = []
        self.comm0 = 0.0

    def start(self) -> float:
        """Begin a step; returns its start time (perf_counter)."""
        self.comm0 = CommWaits.seconds()
        self.marks = [time.perf_counter()]
        return self.marks[0]

    def mark(self) -> None:
        """End of a part."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append(time.perf_counter())

    def parts(self, step_time_s: float) -> dict:
        """data_s, fwd_bwd_s, optimizer_s, comm_exposed_s and other_s (the rest of `step_time_s`)."""
        data, fwd_bwd, opt = (b - a for a, b in zip(self.marks, self.marks[1:4]))
        return {
            "data_s": data,
            "fwd_bwd_s": fwd_bwd,
            "optimizer_s": opt,
            "comm_exposed_s": CommWaits.seconds() - self.comm0,
            "other_s": step_time_s - data - fwd_bwd - opt,
        }


# ---------------------------------------------------------------- prediction.json


def start_run(trainer) -> dict | None:
    """At the end of init: rank 0 measures the device, predicts the run and writes prediction.json (returned; None
    on other ranks)."""
    import torch.distributed as dist

    device = None
    if trainer.world_size > 1:
        dist.barrier()  # nothing else runs while rank 0 probes: the other ranks wait in the barrier below
    if trainer.rank == 0:
        # Rank 0 alone measures the host's rate at its thread count; the share its ranks get of the cores is
        # applied by the simulator (sim/host_device.cpu_system), which is steadier than measuring them all at once.
        device = device_figures(trainer.device, trainer.cfg.train.dtype, trainer.cfg.train.probe_window_s)
    if trainer.world_size > 1:
        dist.barrier()
    if device is None:
        return None
    doc = predict(trainer.cfg, trainer.layout, device)
    write_prediction(trainer.run_dir, doc)
    return doc


def result_block(
    prediction: dict | None, step_times: list[float], tokens_per_step: int, device, peak: float | None = None
) -> dict:
    """result.json's {"predicted_vs_measured": ...} (`run_prediction.compare`) with this rank's peak memory (`peak`
    GiB when the caller read it earlier, else now)."""
    from scaletrain.train.host import peak_memory_gib

    peak = peak_memory_gib(device) if peak is None else peak
    return {"predicted_vs_measured": run_prediction.compare(prediction, step_times, tokens_per_step, peak)}


def predict(cfg, layout, device_block: dict) -> dict:
    """prediction.json's content for `cfg` trained in `layout` on the device `device_block` describes (the
    simulator through `parallel.sim_layout.sim_layout`); {"error": one line} where the simulator cannot price it."""
    from scaletrain.parallel.sim_layout import sim_layout
    from scaletrain.sim.predict import benchmark_of

    doc: dict = {"schema": run_prediction.SCHEMA, "device": device_block, "world_size": layout.world_size}
    try:
        doc["layout"] = layout.describe()
        w, cluster = sim_layout(cfg, layout)
        if device_block["kind"] == "cpu":
            from scaletrain.sim.host_device import cpu_efficiency, cpu_system

            gpu, node, fabric = cpu_system(device_block)
            eff_name, eff = cpu_efficiency(w, cluster)
        else:
            from scaletrain.sim.catalog import load_catalog
            from scaletrain.sim.efficiency import efficiency_for

            if not device_block.get("catalog_key"):
                raise ValueError(f"the catalog has no entry for {device_block['name']!r} (sim/hardware/gpus.toml)")
            gpu, node, fabric = load_catalog().system(device_block["catalog_key"])
            eff_name, eff = efficiency_for(None, gpu.key, benchmark_of(cfg.preset))
        priced = run_prediction.price_run(w, cluster, gpu, node, fabric, eff)
        doc.update(priced)
        doc["efficiency_set"] = eff_name
        doc["efficiency"] = eff.to_dict()
    except Exception as exc:  # the prediction never fails a run
        doc["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())
    return doc


def auto_checkpoint_interval(trainer) -> None:
    """checkpoint.interval_steps = "auto": rank 0 computes the interval (`resolve_auto_interval`) from this run's
    prediction, sets it on its checkpointer and logs it. The other ranks keep none of their own: every save decision
    is rank 0's, broadcast (`Checkpointer.due`)."""
    if trainer.rank != 0:
        return
    steps, seconds, line = resolve_auto_interval(trainer.cfg, trainer.layout, trainer.prediction)
    trainer.checkpointer.set_interval(steps, seconds)
    log.info(line)


def resolve_auto_interval(cfg, layout, prediction: dict | None) -> tuple[int, float, str]:
    """(steps, seconds, log line) of `sim.goodput.auto_interval` for `cfg` run in `layout` (`layout.world_size` ranks):
    the trainer's checkpoint bytes (fp32 parameters and AdamW moments), the node of the device prediction.json
    names (the catalog GPU's default node; on CPU the host device's one-rank node), its storage bandwidth unless
    checkpoint.storage_gbps is set, checkpoint.interruptions_per_gpu_hour unless -1, and the predicted step time
    (none when the prediction failed: the interval is then seconds, for the time trigger)."""
    from scaletrain.parallel.sim_layout import sim_layout
    from scaletrain.sim.catalog import DEFAULT_HOST_COPY_GBPS, DEFAULT_STORAGE_GBPS, Node, load_catalog
    from scaletrain.sim.goodput import auto_interval, checkpoint_bytes
    from scaletrain.sim.host_device import cpu_system

    k = cfg.checkpoint
    w, cluster = sim_layout(cfg, layout)
    device = (prediction or {}).get("device") or {}
    node: Node | None = None
    try:
        if device.get("kind") == "cpu":
            node = cpu_system(device)[1]
        elif device.get("catalog_key"):
            cat = load_catalog()
            node = cat.node(cat.gpu(device["catalog_key"]).default_node)
    except ValueError:  # a device block without its figures: the catalog defaults below
        node = None
    storage = k.storage_gbps if k.storage_gbps > 0 else (node.storage_gbps if node else DEFAULT_STORAGE_GBPS)
    world = layout.world_size
    nodes = -(-world // (node.gpus_per_node if node else 1))
    step = None if prediction is None or "error" in prediction else prediction.get("step_time_s")
    return auto_interval(
        checkpoint_bytes(w, cluster, trainer=True),
        world,
        nodes,
        storage,
        step,
        k.async_save,
        k.interruptions_per_gpu_hour if k.interruptions_per_gpu_hour > 0 else None,
        node.host_copy_gbps if node else DEFAULT_HOST_COPY_GBPS,
    )


def write_prediction(run_dir: Path, doc: dict) -> None:
    """Write prediction.json (strict JSON), warning when the prediction failed."""
    from scaletrain.train.rundir import dumps_strict

    path = Path(run_dir) / PREDICTION_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps_strict(doc, indent=2) + "\n")
    tmp.replace(path)
    if "error" in doc:
        log.warning(f"no prediction for this run ({doc['error']}); {path} records why, training goes on")
