"""comm_exposed_s's clock counts the time a rank blocks in any collective it waits for from Python: a work handle's
wait (c10d) and a functional collective's wait_tensor (DTensor's tensor/sequence parallelism)."""

from __future__ import annotations

from launch import run_ranks

DELAY_S = 1.0  # well above the scheduling jitter of two ranks on a loaded 2-core machine


def _blocked_seconds(rank, world_size):
    """Rank 1 joins each collective DELAY_S late; rank 0's clock must count the wait, once per collective kind."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from scaletrain.train.perf import CommWaits

    mesh = init_device_mesh("cpu", (world_size,))
    waits = CommWaits()
    waits.install()
    out = {}
    try:
        for kind in ("work", "functional"):
            dist.barrier()
            t0 = CommWaits.seconds()
            if rank == 1:
                time.sleep(DELAY_S)
            if kind == "work":
                dist.all_reduce(torch.ones(4))
            else:  # what a sequence-parallel layer does: a pending sum over the TP ranks, made whole
                x = DTensor.from_local(torch.ones(4), mesh, [Partial()])
                x.redistribute(mesh, [Replicate()]).to_local().sum().item()
            out[kind] = CommWaits.seconds() - t0
    finally:
        waits.uninstall()
    return out


def test_both_kinds_of_collective_wait_are_counted():
    rank0, rank1 = run_ranks(_blocked_seconds, 2, timeout=120)
    for kind in ("work", "functional"):
        assert rank0[kind] > 0.6 * DELAY_S, (kind, rank0)  # rank 0 waited for the late rank
        assert rank1[kind] < rank0[kind], (kind, rank1)
