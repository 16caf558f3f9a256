"""The multi-rank test launcher: a Python error fails at once; a rank killed by a signal gets one more attempt."""

from __future__ import annotations

import os

import pytest

from launch import NativeCrash, run_ranks


def _abort_first_time(rank, world_size, marker):
    """Rank 1 aborts (SIGABRT, as glibc does on a corrupted heap) the first time the marker file is absent."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return rank


def _always_abort(rank, world_size):
    if rank == 1:
        os.abort()
    return rank


def _python_error(rank, world_size, marker):
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError(f"rank {rank} fails in Python")


def test_a_native_crash_is_retried_once(tmp_path):
    with pytest.warns(UserWarning, match="died from a signal; running all 2 ranks once more"):
        assert run_ranks(_abort_first_time, 2, str(tmp_path / "marker"), timeout=120) == [0, 1]


def test_a_second_native_crash_fails():
    with pytest.warns(UserWarning, match="died from a signal"), pytest.raises(NativeCrash, match="-6"):
        run_ranks(_always_abort, 2, timeout=120)


def test_a_python_error_is_not_retried(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(AssertionError, match="rank 0 fails in Python") as info:
        run_ranks(_python_error, 2, str(marker), timeout=120)
    assert not isinstance(info.value, NativeCrash)
    assert sorted(marker.read_text().split()) == ["0", "1"]  # one attempt: each rank ran once
