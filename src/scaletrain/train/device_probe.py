"""Figures of the device a run trains on, for its prediction (prediction.json's "device" block).

GPU: the catalog entry found by the torch device name (sim/hardware/gpus.toml); its dense bf16 peak is the MFU
denominator, as in the step records. CPU: measured at start-up in a fraction of a second at this process's thread
count: the best of a few 384^3 GEMMs in fp32 and in bf16, a 16 MiB copy (bytes read + written per second) and
the time of a tiny matmul (the fixed cost of one kernel). `sim/host_device.cpu_system` turns the block into the
simulator's device. Every rank of a run probes at the same moment, so a rank's figures are its share of a host
the ranks share.
"""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache

import torch

from scaletrain.sim.catalog import load_catalog

_GEMM_N = 384
_COPY_BYTES = 16 << 20
_BUDGET_S = 0.05  # per measurement: stop repeating once this much time went into it


def _best(fn, repeats: int) -> float:
    """Shortest of `repeats` timed calls (fewer when they take long), after one untimed call."""
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > _BUDGET_S:
            break
    return best


def gemm_flops(dtype: torch.dtype, n: int = _GEMM_N, repeats: int = 3) -> float:
    """FLOP/s of an n^3 matmul in `dtype` on CPU at the current thread count (best of `repeats`)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2.0 * n**3 / _best(lambda: torch.mm(a, b), repeats)


def copy_bandwidth(nbytes: int = _COPY_BYTES, repeats: int = 3) -> float:
    """Bytes moved (read + written) per second by a large tensor copy on CPU (best of `repeats`)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _best(lambda: dst.copy_(src), repeats)


def kernel_seconds(repeats: int = 30) -> float:
    """Seconds of a 16x16 matmul: the fixed cost of launching one CPU kernel from Python (median of `repeats`)."""
    a = torch.ones(16, 16)
    torch.mm(a, a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, a)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0.0


@lru_cache(maxsize=4)
def probe_cpu(dtype: str, threads: int) -> dict:
    """The "device" block of a CPU run in `dtype` ("fp32" or "bf16") on `threads` threads (measured once per
    process and thread count): peak_flops is the run dtype's GEMM rate; gemm_flops holds both."""
    gemm = {"fp32": gemm_flops(torch.float32), "bf16": gemm_flops(torch.bfloat16)}
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return {
        "kind": "cpu",
        "name": _cpu_name(),
        "catalog_key": None,
        "peak_flops": gemm[dtype],
        "mem_bw_bytes_s": copy_bandwidth(),
        "measured": True,
        "threads": threads,
        "dtype": dtype,
        "gemm_flops": gemm,
        "kernel_s": kernel_seconds(),
        "memory_bytes": _host_memory_bytes() / ranks_here,
    }


def device_figures(device: torch.device, dtype: str) -> dict:
    """prediction.json's "device" block for `device` (CPU: measured now, see `probe_cpu`; CUDA: the catalog entry
    by device name, "catalog_key" null and no peak when the catalog does not know it)."""
    if device.type != "cuda":
        return dict(probe_cpu(dtype, torch.get_num_threads()))
    name = torch.cuda.get_device_name(device)
    gpu = load_catalog().gpu_for_device(name)
    return {
        "kind": "cuda",
        "name": name,
        "catalog_key": gpu.key if gpu else None,
        "peak_flops": gpu.bf16_tflops * 1e12 if gpu else None,
        "mem_bw_bytes_s": gpu.hbm_tbps * 1e12 if gpu else None,
        "measured": False,
        "threads": None,
    }
