"""Process-level settings for fast, repeatable CPU training."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Stop glibc from returning large freed buffers to the OS after every step.

    Activations and logits of a CPU step are tens of MB each; by default glibc serves them with mmap and unmaps
    them on free, so every step page-faults the same memory back in (measured: ~30% of step time, most of it
    system time). Raising the mmap and trim thresholds keeps them in the heap for reuse. Returns False where
    the C library has no mallopt (non-glibc), which changes nothing but speed.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    one_gib = 1 << 30
    return bool(mallopt(_M_MMAP_THRESHOLD, one_gib)) and bool(mallopt(_M_TRIM_THRESHOLD, one_gib))


def setup_cpu(threads: int) -> None:
    """Threads (0 keeps torch's default), flush-to-zero for denormals, and the allocator setting above."""
    if threads:
        torch.set_num_threads(threads)
    # Denormal gradients slow CPU kernels badly and carry no information at these magnitudes.
    torch.set_flush_denormal(True)
    keep_freed_memory()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank so far: CUDA allocator peak on a GPU, the process's peak RSS on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
