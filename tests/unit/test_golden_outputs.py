"""The simulator's, the dry runs' and the models' outputs equal tests/golden/cli_outputs.json.

A restructuring must leave every number where it was. A change meant to move numbers regenerates the file with
`python3 scripts/golden_outputs.py --update` and says so in its commit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("golden_outputs", ROOT / "scripts" / "golden_outputs.py")
assert _spec and _spec.loader
golden_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_outputs)

GOLDEN = json.loads(golden_outputs.GOLDEN.read_text())


@pytest.fixture(scope="module")
def current():
    return golden_outputs.run_all()


def test_the_golden_file_covers_every_command():
    assert set(GOLDEN) == set(golden_outputs.COMMANDS) | {f"model {p}" for p in golden_outputs.MODEL_PRESETS}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_output_is_unchanged(current, key):
    # 1e-9 relative: a refactor may reorder a float sum, not move a number.
    assert golden_outputs.differences(GOLDEN[key], current[key], rel=1e-9) == []


def test_the_comparison_sees_a_moved_number():
    key = next(k for k in GOLDEN if k.startswith("predict") and "json" in GOLDEN[k])
    moved = json.loads(json.dumps(GOLDEN[key]))
    moved["json"]["step_time_s"] *= 1 + 1e-6
    assert golden_outputs.differences(GOLDEN[key], moved, rel=1e-9)
