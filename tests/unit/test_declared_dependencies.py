"""The install: everything the CLI reaches imports with only scaletrain's declared requirements (pyproject.toml).

A fresh `pip install .` brings exactly the declared requirements and theirs. This machine has more (the test, bench
and lint extras, whatever else is installed), so the check runs scaletrain in a subprocess whose imports are limited
to the modules that closure provides (tests/unit/declared_imports.py): an undeclared import fails there as it would
after the README's install (`tokenizers`, imported by data/bpe.py, was one). .ci/run does the real thing too: it
installs `pip install -e .` alone first and runs scripts/smoke_install.py before the extras.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport scaletrain declares there
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("declared_imports.py")


def declared() -> list[Requirement]:
    """scaletrain's core requirements, read from this checkout's pyproject.toml: an editable install's metadata
    keeps the requirements of the day it was installed, the file is what a fresh install reads."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the distributions a fresh install of `requirements` brings: each requirement whose
    marker holds with no extra asked for, and recursively theirs, as installed here."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.requires(req.name) or []]
        except md.PackageNotFoundError:  # a platform's requirement not installed here provides nothing to import
            continue
    return seen


def allowed_modules(requirements: list[Requirement]) -> list[str]:
    """Top-level import names the distributions in the closure of `requirements` provide."""
    dists = closure(requirements)
    return sorted(
        module
        for module, owners in md.packages_distributions().items()
        if any(canonicalize_name(d) in dists for d in owners)
    )


def run_limited(tmp_path, requirements: list[Requirement], *steps: str) -> tuple[int, dict]:
    allowed = tmp_path / "allowed.json"
    allowed.write_text(json.dumps(allowed_modules(requirements)))
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(allowed), str(tmp_path / "data"), *steps],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report from {HELPER.name}: {proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1])


@pytest.mark.slow  # ~8 s: one interpreter imports every module (torch among them)
def test_every_module_and_subcommand_runs_on_the_declared_dependencies_alone(tmp_path):
    code, report = run_limited(tmp_path, declared(), "modules", "help", "bpe")
    assert code == 0 and report == {"refused_by_scaletrain": [], "errors": []}, json.dumps(report, indent=1)


def test_the_check_fails_when_tokenizers_is_undeclared(tmp_path):
    # The same check with tokenizers left out of the requirements: the BPE fetch fails as it did after the README's
    # install before tokenizers was declared.
    without = [r for r in declared() if canonicalize_name(r.name) != "tokenizers"]
    assert len(without) == len(declared()) - 1
    code, report = run_limited(tmp_path, without, "bpe")
    assert code == 1
    assert any("tokenizers" in r for r in report["refused_by_scaletrain"]), report
    assert any("No module named 'tokenizers'" in e for e in report["errors"]), report


def test_pyyaml_is_no_core_requirement_and_fp8_stays_an_extra():
    # scaletrain imports no yaml (mlperf-logging declares its own); `pip install -e ".[fp8]"` keeps working.
    names = {canonicalize_name(r.name) for r in declared()}
    assert "pyyaml" not in names and {"tokenizers", "torchao"} <= names
    with open(REPO / "pyproject.toml", "rb") as f:
        assert "fp8" in tomllib.load(f)["project"]["optional-dependencies"]
