"""Shared fixtures: a tiny model config and a prepared excerpt corpus (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def excerpt_corpus(tmp_path_factory):
    """The packaged Shakespeare excerpt tokenized with a 1024-token vocabulary (built once per session)."""
    from scaletrain.data.corpus import prepare_excerpt
    return prepare_excerpt(tmp_path_factory.mktemp("excerpt"), 1024)
