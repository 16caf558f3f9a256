"""Figures of the device a run trains on, for its prediction (prediction.json's "device" block).

GPU: the catalog entry found by the torch device name (sim/hardware/gpus.toml); its dense bf16 peak is the MFU
denominator, as in the step records. CPU: measured at start-up in a fraction of a second at this process's thread
count: 384^3 GEMMs in fp32 and in bf16 and a 16 MiB copy (bytes read + written per second), each the mean over a
window (`train.probe_window_s`, 30 ms by default), and the time of a tiny matmul (the fixed cost of one kernel). `sim/host_device.cpu_system` turns the block into the
simulator's device. Rank 0 probes while the other ranks wait, so the figures are one rank's on an idle host; the
block's `cores`, `local_ranks` and `threads` let the simulator price each rank's share of the cores.
"""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache

import torch

from scaletrain.sim.catalog import load_catalog
from scaletrain.train.cpu_bf16 import bf16_gemm_context, gemm_mode

_GEMM_N = 384
_COPY_BYTES = 16 << 20
WINDOW_S = 0.03
"""Default of `train.probe_window_s`: each rate is the mean over calls filling at least this window (several
scheduler time slices), steadier than the best of a few calls on a host other processes use too."""


def _mean_time(fn, repeats: int, window_s: float = WINDOW_S) -> float:
    """Mean seconds per call over at least `repeats` calls and at least `window_s` of calls, after one untimed call."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - t0 < window_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def gemm_flops(dtype: torch.dtype, n: int = _GEMM_N, repeats: int = 3, window_s: float = WINDOW_S) -> float:
    """FLOP/s of an n^3 matmul in `dtype` on CPU at the current thread count (mean over a window, `_mean_time`)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    # A bf16 training run on a CPU without bf16 GEMMs computes them as fp32 (train/cpu_bf16.py): time the same.
    with bf16_gemm_context(torch.device("cpu"), "bf16" if dtype == torch.bfloat16 else "fp32"):
        return 2.0 * n**3 / _mean_time(lambda: torch.mm(a, b), repeats, window_s)


def copy_bandwidth(nbytes: int = _COPY_BYTES, repeats: int = 3, window_s: float = WINDOW_S) -> float:
    """Bytes moved (read + written) per second by a large tensor copy on CPU (mean over a window)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _mean_time(lambda: dst.copy_(src), repeats, window_s)


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
def probe_cpu(dtype: str, threads: int, window_s: float = WINDOW_S) -> dict:
    """The "device" block of a CPU run in `dtype` ("fp32" or "bf16") on `threads` threads (measured once per
    process, thread count and window): peak_flops is the run dtype's GEMM rate; gemm_flops holds both.

    With several ranks on the host (LOCAL_WORLD_SIZE), the host's own rates are measured too, by this process alone
    on as many threads as all its ranks run (at most the cores): host_peak_flops and host_mem_bw_bytes_s. The
    simulator prices each rank at its share of them (`sim/host_device.rank_share`): a VM's "cores" may be
    hyperthreads of fewer physical ones, which only such a measurement shows."""
    gemm = {"fp32": gemm_flops(torch.float32, window_s=window_s), "bf16": gemm_flops(torch.bfloat16, window_s=window_s)}
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    bw = copy_bandwidth(window_s=window_s)
    host_threads = min(_cores(), ranks_here * threads)
    host_flops, host_bw = gemm[dtype], bw
    if host_threads != threads:
        torch.set_num_threads(host_threads)
        try:
            host_flops = gemm_flops(torch.float32 if dtype == "fp32" else torch.bfloat16, window_s=window_s)
            host_bw = copy_bandwidth(window_s=window_s)
        finally:
            torch.set_num_threads(threads)
    return {
        "kind": "cpu",
        "name": _cpu_name(),
        "catalog_key": None,
        "peak_flops": gemm[dtype],
        "mem_bw_bytes_s": bw,
        "measured": True,
        "threads": threads,
        "dtype": dtype,
        "gemm_flops": gemm,
        "bf16_gemm": gemm_mode(),
        "kernel_s": kernel_seconds(),
        "memory_bytes": _host_memory_bytes() / ranks_here,
        "cores": _cores(),
        "local_ranks": ranks_here,
        "host_threads": host_threads,
        "host_peak_flops": host_flops,
        "host_mem_bw_bytes_s": host_bw,
        "probe_window_s": window_s,
    }


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def device_figures(device: torch.device, dtype: str, window_s: float = WINDOW_S) -> dict:
    """prediction.json's "device" block for `device` (CPU: measured now over `window_s` per figure, see `probe_cpu`;
    CUDA: the catalog entry by device name, "catalog_key" null and no peak when the catalog does not know it)."""
    if device.type != "cuda":
        return dict(probe_cpu(dtype, torch.get_num_threads(), window_s))
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
