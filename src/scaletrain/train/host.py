"""Process-level settings for fast, repeatable CPU training."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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


def available_memory_bytes() -> int | None:
    """Memory this process can still get: /proc/meminfo MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    found = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's limit is lower than the machine's free memory
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            found = min(found, int(limit) - used)
    except (OSError, ValueError):
        pass
    return found


def training_state_bytes(cfg, shards: int = 1) -> int:
    """A lower bound on one rank's training state: fp32 weights, gradients and two Adam moments (16 bytes per
    trained parameter; a LoRA run's frozen base needs its 4-byte weights only), divided over `shards` ranks."""
    from scaletrain.model.flops import lora_params, num_params

    base = num_params(cfg.model)
    if cfg.lora.rank > 0:
        total = 4 * base + 16 * lora_params(cfg.model, cfg.lora.rank, tuple(cfg.lora.targets))
    else:
        total = 16 * base
    return total // max(1, shards)


def batch_bytes(cfg, dp: int) -> int:
    """Host memory one rank's token batches of a step take: its GBS / dp sequences of int64 inputs and labels.

    The loader and the warm-up hold a whole step's micro-batches at once, on the host whatever the device."""
    return 16 * (cfg.train.global_batch_size // max(1, dp)) * cfg.model.seq_len


def check_host_memory(cfg, layout, device_type: str = "cpu") -> None:
    """Refuse, before anything is allocated, a run whose training state (on CPU) or one step's token batches cannot
    fit in this machine's memory.

    Without it the model build ends in an allocator traceback or the OOM killer, and a huge global batch grows the
    process for minutes before it does. Activations are not counted, so a run refused here could never have fit.
    Raises ConfigError (exit 2) with the estimate.
    """
    from scaletrain.config import ConfigError

    shards = layout.dp_shard * layout.cp * layout.tp * layout.pp  # what FSDP, TP and PP split the weights over
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = training_state_bytes(cfg, shards) * local_ranks if device_type == "cpu" else 0
    batches = batch_bytes(cfg, layout.dp) * local_ranks
    have = available_memory_bytes()
    problem = None
    per = f" ({local_ranks} ranks on this machine, 1/{shards} each)" if local_ranks > 1 or shards > 1 else ""
    if have is not None and need > have:
        what = "fp32 weights + LoRA adapters with Adam" if cfg.lora.rank > 0 else "fp32 weights, gradients and Adam"
        problem = (
            f"{cfg.preset or 'this model'} needs ~{_human(need)} for {what}{per}; this machine has "
            f"{_human(have)} available"
        )
    elif have is not None and need + batches > have:
        t = cfg.train
        problem = (
            f"train.global_batch_size={t.global_batch_size}: one step's token batches need ~{_human(batches)} "
            f"({t.global_batch_size // max(1, layout.dp)} sequences x {cfg.model.seq_len} tokens x 16 bytes per rank"
            f"{f', {local_ranks} ranks' if local_ranks > 1 else ''}){' besides the training state' if need else ''}; "
            f"this machine has {_human(have)} available"
        )
    from scaletrain.train.rundir import share

    problem = share(problem)  # rank 0's reading decides for all: a rank left behind would hang in a collective
    if problem:
        raise ConfigError(problem)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit == "TB" else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"
