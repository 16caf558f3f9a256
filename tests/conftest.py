"""Shared fixtures: a tiny model config and a prepared excerpt corpus (no network).

Every test runs with the collective check on (SCALETRAIN_CHECK_COLLECTIVES=1, scaletrain/parallel/collective_check.py),
inherited by the ranks the tests start (tests/distributed/launch.py, torchrun); the end of the run counts the
distributed groups the launcher retried after a native crash.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
RETRY_LOG = "native-crash-retries.jsonl"

os.environ.setdefault("SCALETRAIN_CHECK_COLLECTIVES", "1")


@pytest.fixture(scope="session", autouse=True)
def _native_crash_log(tmp_path_factory):
    """Point the launcher's retry log into this session's tmp dir (unless the caller chose a file)."""
    os.environ.setdefault("SCALETRAIN_NATIVE_CRASH_LOG", str(tmp_path_factory.getbasetemp() / RETRY_LOG))


def pytest_terminal_summary(terminalreporter):
    """One line at the end of every run: how many distributed groups were retried after a native crash."""
    log = os.environ.get("SCALETRAIN_NATIVE_CRASH_LOG")
    if not log:
        return
    sys.path.insert(0, str(Path(__file__).parent / "distributed"))
    try:
        from launch import retry_summary
    finally:
        sys.path.pop(0)
    terminalreporter.write_sep("-", retry_summary(log))


@pytest.fixture(scope="session")
def excerpt_corpus(tmp_path_factory):
    """The packaged Shakespeare excerpt tokenized with a 1024-token vocabulary (built once per session)."""
    from scaletrain.data.corpus import prepare_excerpt

    return prepare_excerpt(tmp_path_factory.mktemp("excerpt"), 1024)
