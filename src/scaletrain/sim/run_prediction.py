"""What the simulator expects of one training run (prediction.json) and how the run compared (result.json).

The trainer hands in its run's Workload and ClusterLayout (through `parallel/sim_layout.sim_layout`, the one
adapter) and the device (a catalog GPU, or a CPU from `host_device.cpu_system`); `price_run` returns the step time,
tokens/s, MFU, memory per rank and the step's breakdown in the simulator's own terms and mapped onto the keys the
trainer measures (`MEASURED_KEYS`). `compare` builds result.json's "predicted_vs_measured" block. Torch-free.
"""

from __future__ import annotations

import math
import statistics

from scaletrain.sim import memory
from scaletrain.sim.catalog import GPU, Fabric, Node
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.step import step_time
from scaletrain.sim.workload import ClusterLayout, Workload

SCHEMA = 1
"""prediction.json's schema version."""
PREDICTION_FILE = "prediction.json"

MEASURED_KEYS = ("data_s", "fwd_bwd_s", "optimizer_s", "comm_exposed_s", "other_s")
"""The step breakdown metrics.jsonl records (train/perf.py). data_s + fwd_bwd_s + optimizer_s + other_s is the
step time; comm_exposed_s is the part of fwd_bwd_s and optimizer_s spent blocked in collectives."""

SIM_TO_MEASURED = {
    "compute": "fwd_bwd_s",
    "pp_bubble": "comm_exposed_s",
    "overlap_slowdown": "fwd_bwd_s",
    "tp_exposed": "comm_exposed_s",
    "cp_exposed": "comm_exposed_s",
    "ep_exposed": "comm_exposed_s",
    "dp_exposed": "comm_exposed_s",
    "sync": "comm_exposed_s",
    "straggler": "comm_exposed_s",
    "optimizer": "optimizer_s",
    "overhead": "other_s",
}
"""Where each of the step model's terms (`step.StepResult.breakdown`) falls among the measured keys. Exposed
communication, synchronisation and straggler waits happen inside forward/backward (gradient reductions end with the
backward; the loss and label-count all-reduces sit in it), so they count in fwd_bwd_s as well as comm_exposed_s; so
does a pipeline stage's idle time (the bubble), which the stage spends blocked in its receives.
The constant host overhead per step is "other"; the simulator prices no data loading (data_s 0)."""


def map_breakdown(sim: dict) -> dict:
    """The step model's breakdown {term: seconds} on the measured keys (every key present, comm_exposed_s inside
    fwd_bwd_s); a term the table does not know counts as other_s."""
    out = dict.fromkeys(MEASURED_KEYS, 0.0)
    for term, seconds in sim.items():
        key = SIM_TO_MEASURED.get(term, "other_s")
        out[key] += seconds
        if key == "comm_exposed_s":
            out["fwd_bwd_s"] += seconds
    return out


def price_run(w: Workload, layout: ClusterLayout, gpu: GPU, node: Node, fabric: Fabric, eff: Efficiency) -> dict:
    """Step time, tokens/s, MFU (model FLOP/s over gpu.bf16_tflops), memory per rank and breakdowns of `w` in
    `layout` on `gpu`; raises ValueError with every reason the simulator cannot price it."""
    reasons = layout.problems(w)
    if layout.fp8 and gpu.fp8_tflops <= 0:
        reasons.append(f"{gpu.key} has no FP8 tensor cores")
    if reasons:
        raise ValueError("; ".join(reasons))
    st = step_time(w, layout, Cluster(gpu, node, fabric, layout.gpus), eff)
    if not (math.isfinite(st.step_time_s) and st.step_time_s > 0):
        raise ValueError(f"the step model gave a step time of {st.step_time_s}")
    mem = memory.memory_per_gpu(w, layout, in_flight=st.in_flight)
    tokens_per_s = layout.gbs * w.seq_len / st.step_time_s
    return {
        "step_time_s": st.step_time_s,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s / layout.gpus * w.flops_per_token / (gpu.bf16_tflops * 1e12),
        "memory_per_rank_gib": mem.total / 2**30,
        "breakdown": map_breakdown(st.breakdown),
        "sim_breakdown": dict(st.breakdown),
        "memory_gib": mem.gib(),
    }


def steady_median(step_times: list[float]) -> float:
    """Median step time past the first third of the timed steps (warm-up), as `sim calibrate` reads a run."""
    return statistics.median(step_times[len(step_times) // 3 :])


def _pair(predicted, measured) -> dict:
    has = isinstance(predicted, (int, float)) and predicted > 0
    return {
        "predicted": predicted if has else None,
        "measured": measured,
        "ratio": measured / predicted if has and isinstance(measured, (int, float)) else None,
    }


def compare(prediction: dict | None, step_times: list[float], tokens_per_step: int, memory_peak_gib: float | None):
    """result.json's "predicted_vs_measured": step time (measured = `steady_median`), tokens/s and peak memory per
    rank, each {"predicted", "measured", "ratio" = measured/predicted}; predicted and ratio are null when the
    prediction failed (or there is none), measured null without timed steps."""
    ok = prediction is not None and "error" not in prediction
    pred = prediction if ok and prediction is not None else {}
    step = steady_median(step_times) if step_times else None
    return {
        "step_time_s": _pair(pred.get("step_time_s"), step),
        "tokens_per_s": _pair(pred.get("tokens_per_s"), tokens_per_step / step if step else None),
        "memory_peak_gib": _pair(pred.get("memory_per_rank_gib"), memory_peak_gib),
    }
