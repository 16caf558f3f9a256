"""A CPU host as the simulator's device: the catalog's GPU, Node and Fabric built from figures a run measured.

A training run on CPU (`train/device_probe.py`) times a short GEMM in its dtype at its thread count, a large memory
copy and a tiny kernel at start-up, and records them in prediction.json's "device" block. `cpu_system` turns that
block into catalog objects the step model prices exactly like a GPU:

- GEMMs and attention at the measured GEMM rate (CPU attention is matmuls too), with the tiny kernel's time as the
  per-kernel fixed cost (`kernel_us`, the GEMM size roll-off);
- memory-bound work and the optimizer at the measured copy bandwidth;
- no NVLink: every rank is its own one-rank "node", so every collective crosses the "gloo" fabric, a loopback TCP
  ring of GLOO_BUSBW_GBPS bus bandwidth and GLOO_ALPHA_US latency per ring step (the figures' NVLink fields carry
  the same numbers only so that no formula divides by zero; with one rank per domain none of them is used).

The host's memory bandwidth and cores are shared by the ranks on it: rank 0 probes alone while the others wait, so
the recorded rates are one rank's on an otherwise idle host. It also measures the host's rates on as many threads as
all local ranks run (at most the cores), and each rank is priced at its even share of those (`rank_share`: two
one-thread ranks on two vCPUs that are one physical core's hyperthreads get half the GEMM rate each, which the core
count alone would not say); the gloo ring runs at `core_share`, the cores over the threads all local ranks run. CPU runs are priced with the simulator's uncalibrated prior `Efficiency()`
(`CPU_EFFICIENCY`) until `scaletrain sim calibrate RUN_DIR... --out F` fits the set "measured/cpu" on measured runs
and $SCALETRAIN_EFFICIENCY=F hands it to later runs (`cpu_efficiency`). Torch-free.
"""

from __future__ import annotations

from scaletrain.sim import gemm_classes
from scaletrain.sim.catalog import GPU, Fabric, Node
from scaletrain.sim.efficiency import Efficiency, load_efficiencies
from scaletrain.sim.workload import ClusterLayout, Workload

CPU_KEY = "cpu"
"""Catalog key of the CPU device (prediction.json's device.catalog_key stays null: it is not a catalog entry)."""

GLOO_BUSBW_GBPS = 0.7
"""gloo all-reduce bus bandwidth between ranks on one host, GB/s: measured 0.66-0.73 GB/s for 1-16 MiB all-reduces
with 2 ranks on the 2-core CI host (loopback TCP); a conservative figure for larger hosts, which reach more."""

GLOO_ALPHA_US = 200.0
"""Latency of one gloo ring step on one host, microseconds (a 1 KiB all-reduce over 2 ranks took 0.9 ms, two ring
steps plus Python, on the loaded CI host; an idle one reaches ~50 us)."""

CPU_EFFICIENCY = Efficiency()
"""The efficiency set CPU runs are priced with: the simulator's priors, uncalibrated until `sim calibrate` fits them."""
CPU_SET = f"measured/{CPU_KEY}"
"""Name of the set `sim calibrate` fits on CPU runs (in the file $SCALETRAIN_EFFICIENCY names)."""


def cpu_efficiency(w: Workload, layout: ClusterLayout) -> tuple[str, Efficiency]:
    """(name, Efficiency) a CPU run of `w` in `layout` is priced with: the set `sim calibrate` fitted on CPU runs
    where $SCALETRAIN_EFFICIENCY holds one (with the gemm_eff of the run's GEMM shape class), else the priors."""
    doc = load_efficiencies()
    if CPU_SET not in doc["sets"]:
        return "prior (CPU, uncalibrated)", CPU_EFFICIENCY
    classes = doc.get("gemm_classes", {}).get(CPU_SET)
    eff, extrapolated = gemm_classes.apply(
        Efficiency.from_dict(doc["sets"][CPU_SET]), classes, gemm_classes.run_gemm_gflop(w, layout)
    )
    return f"{CPU_SET} ($SCALETRAIN_EFFICIENCY{', shape class extrapolated' if extrapolated else ''})", eff


def _positive(device: dict, key: str) -> float:
    value = device.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"CPU device figures: {key}={value!r} must be a positive number")
    return float(value)


def core_share(device: dict) -> float:
    """The fraction of the cores one rank's threads get while all the host's ranks run: min(1, cores / (local_ranks
    x threads)) from the device block (1 where it does not say: a block from before these fields)."""
    try:
        cores, ranks, threads = (int(device[k]) for k in ("cores", "local_ranks", "threads"))
    except (KeyError, TypeError, ValueError):
        return 1.0
    if min(cores, ranks, threads) < 1:
        return 1.0
    return min(1.0, cores / (ranks * threads))


def rank_share(device: dict, rate: str) -> float:
    """The fraction of its own measured `rate` ("peak_flops" or "mem_bw_bytes_s") one rank keeps while all the
    host's ranks run: the host's rate measured on all their threads (`host_<rate>`), split evenly over the local
    ranks, over the rank's own, at most 1; `core_share` where the block has no host figure."""
    numbers = [device.get(f"host_{rate}"), device.get(rate), device.get("local_ranks")]
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in numbers):
        return core_share(device)
    host, own, ranks = (float(x) for x in numbers)  # type: ignore[arg-type]
    return min(1.0, host / (ranks * own))


def cpu_system(device: dict) -> tuple[GPU, Node, Fabric]:
    """(GPU, Node, Fabric) of a CPU from prediction.json's "device" block (kind "cpu").

    Reads `peak_flops` (measured GEMM FLOP/s in the run's dtype), `mem_bw_bytes_s` (measured copy bandwidth, bytes
    moved per second), `kernel_s` (a tiny kernel's time) and `memory_bytes` (host memory per rank); a missing or
    non-positive figure is a ValueError naming it. Rank 0 measures the rates alone on the host at its thread count;
    each rank is priced at its `rank_share` of them, and the gloo ring at the ranks' `core_share`.
    """
    peak = _positive(device, "peak_flops") / 1e12 * rank_share(device, "peak_flops")
    bw = _positive(device, "mem_bw_bytes_s") / 1e12 * rank_share(device, "mem_bw_bytes_s")
    # gloo moves data with the host's cores (copies through loopback TCP): its ring runs at the ranks' share of them.
    busbw = GLOO_BUSBW_GBPS * core_share(device)
    kernel_us = _positive(device, "kernel_s") * 1e6
    mem_gb = _positive(device, "memory_bytes") / 1e9
    name = str(device.get("name") or "CPU")
    gpu = GPU(
        key=CPU_KEY,
        name=name,
        bf16_tflops=peak,
        fp8_tflops=0.0,
        matmul_bf16_tflops=peak,
        matmul_fp8_tflops=0.0,
        attn_tflops=peak,
        hbm_gb=mem_gb,
        hbm_tbps=bw,
        hbm_copy_tbps=bw,
        nvlink_gbps=busbw,
        kernel_us=kernel_us,
        source="measured at start-up (scaletrain.train.device_probe)",
        generation=CPU_KEY,
        default_node="cpu-host",
    )
    node = Node(
        key="cpu-host",
        name=f"{name}, one rank per domain (no NVLink)",
        gpu=CPU_KEY,
        gpus_per_node=1,
        nvlink_domain=1,
        nvlink_busbw_gbps=busbw,
        nvls_busbw_gbps=0.0,
        nics=1,
        fabric="gloo",
        source="sim/host_device.py",
        nvlink_alpha_us=GLOO_ALPHA_US,
    )
    fabric = Fabric(
        key="gloo",
        name="gloo over loopback TCP (one host)",
        link_gbit=busbw * 8,
        busbw_gbps=busbw,
        alpha_us=GLOO_ALPHA_US,
        hop_us=0.0,
        radix=1024,
        sharp=False,
        source="sim/host_device.py (GLOO_BUSBW_GBPS, GLOO_ALPHA_US)",
    )
    return gpu, node, fabric
