"""Under torchrun only rank 0 takes the run-directory lock, and when it cannot every rank stops with the same line."""

from __future__ import annotations

import os
import socket

from launch import run_ranks

from scaletrain.train.rundir import LOCK_NAME, RunDirLock


def claim(rank, world_size, run_dir):
    from scaletrain.train.distributed import is_writer
    from scaletrain.train.rundir import RunDirClaim, RunDirError

    try:
        with RunDirClaim(run_dir, writer=is_writer(), resume="none", overwrite=False):
            return "claimed"
    except RunDirError as exc:
        return str(exc)


def test_busy_run_dir_stops_every_rank(tmp_path):
    run = tmp_path / "run"
    lock = RunDirLock(run)
    assert lock.acquire() is None  # held by this (pytest) process, like a live run
    try:
        answers = run_ranks(claim, 2, str(run), timeout=120)
    finally:
        lock.release()
    want = (
        f"run directory {run} is in use by pid {os.getpid()} on host {socket.gethostname()} (lock file "
        f"{run / LOCK_NAME}); wait for it to end or choose another directory"
    )
    assert answers == [want, want]  # every rank stops with rank 0's answer
    # Once free, rank 0 alone takes it for the group (rank 1 locking too would be refused) and releases it.
    assert run_ranks(claim, 2, str(run), timeout=120) == ["claimed", "claimed"]
    assert not (run / LOCK_NAME).exists()
