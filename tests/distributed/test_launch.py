"""The multi-rank test launcher: a Python error fails at once; a rank killed by a signal gets one more attempt,
counted in the retry log that the end of the pytest run reports; every rank runs with the collective check and
faulthandler on."""

from __future__ import annotations

import json
import os
import resource

import pytest
from launch import RETRY_LOG_ENV, NativeCrash, core_location, record_retry, retry_summary, run_ranks


@pytest.fixture
def retry_log(tmp_path, monkeypatch):
    """A private retry log: the deliberate crashes below must not count as CI's retries."""
    log = tmp_path / "retries.jsonl"
    monkeypatch.setenv(RETRY_LOG_ENV, str(log))
    return log


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


def test_a_native_crash_is_retried_once_and_counted(tmp_path, retry_log):
    with pytest.warns(UserWarning, match="died from a signal; running all 2 ranks once more"):
        assert run_ranks(_abort_first_time, 2, str(tmp_path / "marker"), timeout=120) == [0, 1]
    (record,) = [json.loads(line) for line in retry_log.read_text().splitlines()]
    assert record["test"].endswith("test_a_native_crash_is_retried_once_and_counted") and record["world_size"] == 2
    assert "died from signal 6" in record["error"]
    assert retry_summary(retry_log).startswith("distributed groups retried after a native crash: 1 (tests/")


def test_a_second_native_crash_fails_with_the_ranks_stacks(retry_log):
    with pytest.warns(UserWarning, match="died from a signal"), pytest.raises(NativeCrash, match="-6") as info:
        run_ranks(_always_abort, 2, timeout=120)
    msg = str(info.value)
    # faulthandler in every rank: the aborted rank's Python stack names the function it died in.
    assert "rank 1 (pid " in msg and "Fatal Python error: Aborted" in msg and "_always_abort" in msg
    assert "core file: " in msg
    assert len(retry_log.read_text().splitlines()) == 1  # the first crash was retried; the second fails


def test_a_python_error_is_not_retried(tmp_path, retry_log):
    marker = tmp_path / "ran"
    with pytest.raises(AssertionError, match="rank 0 fails in Python") as info:
        run_ranks(_python_error, 2, str(marker), timeout=120)
    assert not isinstance(info.value, NativeCrash)
    assert sorted(marker.read_text().split()) == ["0", "1"]  # one attempt: each rank ran once
    assert not retry_log.exists()


def _checked_rank(rank, world_size):
    """What a launched rank sees: the check's environment, the check installed, a bad tensor refused in Python."""
    import torch
    import torch.distributed as dist

    from scaletrain.parallel import collective_check

    try:
        dist.all_reduce(torch.ones(4, 4)[:, :2])
        refused = ""
    except collective_check.CollectiveTensorError as e:
        refused = str(e)
    return os.environ.get("SCALETRAIN_CHECK_COLLECTIVES"), collective_check.installed(), refused


def test_every_launched_rank_checks_its_collectives():
    for env, installed, refused in run_ranks(_checked_rank, 2, timeout=120):
        assert env == "1" and installed
        assert refused.startswith("collective all_reduce: argument tensor (shape [4, 2], stride (4, 1)")


@pytest.mark.hostile
@pytest.mark.parametrize(
    "content, count",
    [
        ("", 0),
        ('{"test": "a::b", "world_size": 2, "error": "x"}\n', 1),
        ('{"test": "a::b"}\n{"test": "c::d"}\n', 2),
        ('{"test": "a::b"}\nnot json\n[1, 2]\n{"no_test": 1}\n', 4),  # a damaged record still counts
    ],
)
def test_retry_summary_counts_every_record(tmp_path, content, count):
    log = tmp_path / "retries.jsonl"
    log.write_text(content)
    line = retry_summary(log)
    assert line.startswith(f"distributed groups retried after a native crash: {count}") and "\n" not in line
    if count:
        assert str(log) in line and "a::b" in line


def test_retry_summary_without_a_log(tmp_path):
    assert retry_summary(tmp_path / "absent.jsonl") == "distributed groups retried after a native crash: 0"
    assert retry_summary(None) == "distributed groups retried after a native crash: 0"


def test_record_retry_appends(tmp_path):
    log = tmp_path / "r.jsonl"
    record_retry("t::one", 2, "boom", log=str(log))
    record_retry("t::two", 4, "x" * 5000, log=str(log))
    assert retry_summary(log).startswith("distributed groups retried after a native crash: 2 (t::one, t::two;")
    assert len(json.loads(log.read_text().splitlines()[1])["error"]) == 2000


@pytest.mark.parametrize(
    "pattern, made, expect",
    [
        ("|/usr/share/apport/apport -p%p", None, "core file: piped to /usr/share/apport/apport"),
        ("core", "core", "core file: {d}/core"),
        ("core", "core.4242", "core file: {d}/core.4242"),  # kernel.core_uses_pid
        ("{d}/core.%e.%p", "core.python3.4242", "core file: {d}/core.python3.4242"),
        ("{d}/core.%e.%p", None, "core file: not found at {d}/core.*.4242"),
    ],
)
def test_core_location(tmp_path, monkeypatch, pattern, made, expect):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    (tmp_path / "pattern").write_text(pattern.format(d=tmp_path) + "\n")
    if made:
        (tmp_path / made).write_bytes(b"")
    assert core_location(4242, str(tmp_path / "pattern")).startswith(expect.format(d=tmp_path))


def test_core_location_without_core_files(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (0, resource.RLIM_INFINITY))
    assert core_location(1).startswith("core file: none (RLIMIT_CORE is 0")


def _where(rank, world_size):
    return os.environ.get("SCALETRAIN_TEST_MARK"), os.getcwd()


def test_ranks_see_the_callers_environment_and_directory_at_their_start(tmp_path, monkeypatch):
    # Forked from a forkserver started earlier, a rank would otherwise see the server's environment and directory.
    run_ranks(_where, 2, timeout=120)
    monkeypatch.setenv("SCALETRAIN_TEST_MARK", "now")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_where, 2, timeout=120) == [("now", str(tmp_path))] * 2
