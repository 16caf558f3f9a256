"""Process-group setup from the launcher's environment (torchrun, or Slurm through torchrun) and rank helpers."""

from __future__ import annotations

import datetime
import faulthandler
import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun/Slurm launchers, 1 when started as a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's index on its node (LOCAL_RANK), 0 for a plain process."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(device: torch.device, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the default process group when launched with WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU).

    Returns (rank, world_size). Idempotent; a plain single process gets (0, 1) and no process group.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if launched_world_size() <= 1:
        return 0, 1
    if device.type == "cuda":
        torch.cuda.set_device(local_rank())
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A native crash on one rank (segfault, abort in a communicator thread) otherwise leaves only the launcher's
    # "Signal 11 received"; the Python stacks of every thread say where each rank was.
    faulthandler.enable(all_threads=True)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def is_writer() -> bool:
    """True on the rank that writes logs and files (global rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0
