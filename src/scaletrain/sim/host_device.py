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

The host's memory bandwidth and cores are shared by the ranks on it; the probe runs on every rank at once, so the
recorded figures are each rank's share. CPU runs are priced with the simulator's uncalibrated prior `Efficiency()`
(`CPU_EFFICIENCY`) until `scaletrain sim calibrate` fits them on measured runs. Torch-free.
"""

from __future__ import annotations

from scaletrain.sim.catalog import GPU, Fabric, Node
from scaletrain.sim.efficiency import Efficiency

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


def _positive(device: dict, key: str) -> float:
    value = device.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"CPU device figures: {key}={value!r} must be a positive number")
    return float(value)


def cpu_system(device: dict) -> tuple[GPU, Node, Fabric]:
    """(GPU, Node, Fabric) of a CPU from prediction.json's "device" block (kind "cpu").

    Reads `peak_flops` (measured GEMM FLOP/s in the run's dtype), `mem_bw_bytes_s` (measured copy bandwidth, bytes
    moved per second), `kernel_s` (a tiny kernel's time) and `memory_bytes` (host memory per rank); a missing or
    non-positive figure is a ValueError naming it.
    """
    peak = _positive(device, "peak_flops") / 1e12
    bw = _positive(device, "mem_bw_bytes_s") / 1e12
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
        nvlink_gbps=GLOO_BUSBW_GBPS,
        kernel_us=kernel_us,
        source="measured at start-up (scaletrain.train.device_probe)",
        default_node="cpu-host",
    )
    node = Node(
        key="cpu-host",
        name=f"{name}, one rank per domain (no NVLink)",
        gpu=CPU_KEY,
        gpus_per_node=1,
        nvlink_domain=1,
        nvlink_busbw_gbps=GLOO_BUSBW_GBPS,
        nvls_busbw_gbps=0.0,
        nics=1,
        fabric="gloo",
        source="sim/host_device.py",
        nvlink_alpha_us=GLOO_ALPHA_US,
    )
    fabric = Fabric(
        key="gloo",
        name="gloo over loopback TCP (one host)",
        link_gbit=GLOO_BUSBW_GBPS * 8,
        busbw_gbps=GLOO_BUSBW_GBPS,
        alpha_us=GLOO_ALPHA_US,
        hop_us=0.0,
        radix=1024,
        sharp=False,
        source="sim/host_device.py (GLOO_BUSBW_GBPS, GLOO_ALPHA_US)",
    )
    return gpu, node, fabric
