"""`scaletrain export` never destroys: it writes into a new or empty directory, --overwrite replaces only its own
files, and a run directory, a checkpoint, the current directory or one containing the checkpoint is never a target.
It exports a finished run's last step and says so, and reads a live run's checkpoint without racing its pruner."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_e2e import tiny_config, tiny_overrides

from scaletrain.checkpoint import store
from scaletrain.cli.main import main
from scaletrain.train.run import train
from scaletrain.train.rundir import LOCK_NAME

pytestmark = pytest.mark.hostile

# 12 steps, an evaluation every 4 and a save after each: the target is out of reach, so the budget ends the run at
# step 12, after the last evaluation (before the final save existed the newest checkpoint was step 8).
TWELVE = ["train.eval_interval_samples=64", "train.max_steps=12", "checkpoint.interval_steps=4"]
FINAL = "step_00000012"


@pytest.fixture(scope="module")
def run12(excerpt_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    result = train(tiny_config(excerpt_corpus, run, *TWELVE))
    assert result["outcome"] == "budget_exhausted" and result["steps"] == 12
    return run


def tree(*roots: Path) -> dict:
    """Every path under `roots` (links as links) with its mode and content hash: what "nothing changed" means."""
    out = {}
    for root in roots:
        for path in [root, *sorted(root.rglob("*"))] if root.exists() or root.is_symlink() else []:
            st = path.lstat()
            if path.is_symlink():
                out[str(path)] = ("link", os.readlink(path))
            elif path.is_file():
                out[str(path)] = (st.st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[str(path)] = (st.st_mode, "dir")
    return out


def export(capsys, *args) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out.strip()


def _run_like(d: Path, *names: str) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model": {}}\n')
    for name in names:
        (d / name).mkdir() if "." not in name else (d / name).write_text("{}\n")


# Targets that are never written, with or without --overwrite: name -> builder(run, playground) -> (target, cwd).
def _dot_in_empty_dir(run, play):
    (play / "empty").mkdir()
    return ".", play / "empty"


def _dot_in_project(run, play):
    _run_like(play / "project", "src", "notes.txt")
    return ".", play / "project"


def _dotdot(run, play):
    (play / "a" / "b").mkdir(parents=True)
    return "..", play / "a" / "b"


def _other_run(*names):
    def build(run, play):
        _run_like(play / "other", *names)
        return play / "other", None

    return build


def _other_checkpoint(run, play):
    shutil.copytree(run / "checkpoints" / FINAL, play / "ckpt")
    return play / "ckpt", None


def _other_checkpoints_folder(run, play):
    (play / "ckpts" / "step_00000003").mkdir(parents=True)
    (play / "ckpts" / "step_00000003" / "manifest.json").write_text("{}")
    return play / "ckpts", None


def _inside_other_checkpoint(run, play):
    shutil.copytree(run / "checkpoints" / FINAL, play / "ckpt")
    return play / "ckpt" / "hf", None


def _other_run_locked(run, play):
    _run_like(play / "other")
    (play / "other" / LOCK_NAME).write_text('{"pid": 1, "host": "elsewhere"}\n')
    return play / "other", None


def _link_to(target_of):
    def build(run, play):
        (play / "link").symlink_to(target_of(run, play))
        return play / "link", None

    return build


def _a_file(run, play):
    (play / "model.bin").write_bytes(b"precious")
    return play / "model.bin", None


def _bench(run, play):
    (play / "bench" / "run_0").mkdir(parents=True)
    (play / "bench" / "summary.json").write_text("{}")
    return play / "bench", None


NEVER = {
    "the-run-directory": lambda run, play: (run, None),
    "its-checkpoints-folder": lambda run, play: (run / "checkpoints", None),
    "the-checkpoint": lambda run, play: (run / "checkpoints" / FINAL, None),
    "inside-the-checkpoint": lambda run, play: (run / "checkpoints" / FINAL / "hf", None),
    "the-runs-parent": lambda run, play: (run.parent, None),
    "dot-empty": _dot_in_empty_dir,
    "dot-project": _dot_in_project,
    "dotdot": _dotdot,
    "root": lambda run, play: (Path("/"), None),
    "other-run-metrics": _other_run("metrics.jsonl", "result.json"),
    "other-run-lock-only": _other_run_locked,
    "other-run-checkpoints-only": _other_run("checkpoints"),
    "other-run-tensorboard-only": _other_run("tensorboard"),
    "other-run-mllog-only": _other_run("mllog.txt"),
    "benchmark-directory": _bench,
    "a-checkpoint-elsewhere": _other_checkpoint,
    "a-checkpoints-folder": _other_checkpoints_folder,
    "inside-another-checkpoint": _inside_other_checkpoint,
    "link-to-the-run": _link_to(lambda run, play: run),
    "link-to-a-run-like-dir": _link_to(lambda run, play: _other_run("metrics.jsonl")(run, play)[0]),
    "a-file": _a_file,
    "dangling-link": _link_to(lambda run, play: play / "nowhere"),
    "link-to-a-file": _link_to(lambda run, play: _a_file(run, play)[0]),
}


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case", list(NEVER))
def test_never_a_target(case, overwrite, run12, tmp_path, capsys, monkeypatch):
    play = tmp_path / "play"
    play.mkdir()
    target, cwd = NEVER[case](run12, play)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    before = tree(play, run12)
    code, err, out = export(capsys, run12, "--hf", target, *(["--overwrite"] if overwrite else []))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("scaletrain: error: export: "), err
    assert "--overwrite" not in err  # no hint that the flag would help: it would not
    assert tree(play, run12) == before, "something changed"
    assert not list(play.parent.glob(".*.tmp-*")) and not list(run12.parent.glob(".*.tmp-*"))


NON_EMPTY = {
    "project-with-config": ("config.json", "notes.txt"),
    "earlier-export": ("config.json", "model.safetensors"),
    "hidden-file-only": (".gitkeep",),
}


@pytest.mark.parametrize("case", list(NON_EMPTY))
def test_non_empty_refused_without_overwrite(case, run12, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for name in NON_EMPTY[case]:
        (target / name).write_text(f"mine: {name}\n")
    before = tree(tmp_path, run12)
    code, err, _ = export(capsys, run12, "--hf", target)
    assert code == 2 and len(err.splitlines()) == 1 and "is not empty" in err and "--overwrite" in err, err
    assert tree(tmp_path, run12) == before


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model-00001-of-00002.safetensors"])
def test_overwrite_refused_where_an_export_file_name_is_a_directory(name, run12, tmp_path, capsys):
    target = tmp_path / "target"
    (target / name).mkdir(parents=True)
    (target / name / "keep.txt").write_text("mine")
    before = tree(tmp_path, run12)
    code, err, _ = export(capsys, run12, "--hf", target, "--overwrite")
    assert code == 2 and len(err.splitlines()) == 1 and "is a directory where the export writes a file" in err, err
    assert tree(tmp_path, run12) == before


SOURCES = {
    "missing": lambda play: play / "nope",
    "empty-dir": lambda play: (play / "empty").mkdir() or play / "empty",
    "a-file": lambda play: (play / "f").write_text("x") or play / "f",
    "run-without-checkpoints": lambda play: (play / "r" / "checkpoints").mkdir(parents=True) or play / "r",
}


@pytest.mark.parametrize("case", list(SOURCES))
def test_bad_source_is_one_line(case, tmp_path, capsys):
    source = SOURCES[case](tmp_path)
    code, err, _ = export(capsys, source, "--hf", tmp_path / "out")
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("scaletrain: error: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_final_step_exported_with_the_umask_modes(mask, run12, tmp_path, capsys):
    old = os.umask(mask)
    try:
        code, err, out = export(capsys, run12, "--hf", tmp_path / "new" / "hf")
    finally:
        os.umask(old)
    assert code == 0, err
    assert out.startswith(f"exported step 12 of {run12} (the final step): {run12 / 'checkpoints' / FINAL} -> ")
    hf = tmp_path / "new" / "hf"
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert hf.stat().st_mode & 0o777 == 0o777 & ~mask  # mkdtemp's 0700 before
    for f in hf.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    assert not list(hf.parent.glob(".*"))


def test_empty_directory_and_lone_checkpoint_and_folder(run12, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err, out = export(capsys, run12 / "checkpoints" / "step_00000008", "--hf", tmp_path / "empty")
    assert code == 0 and "exported step 8 of" in out and "(the run ended at step 12" not in out, (err, out)
    code, err, out = export(capsys, run12 / "checkpoints", "--hf", tmp_path / "folder")
    assert code == 0 and out.startswith(f"exported step 12 of {run12 / 'checkpoints'} (the final step)"), (err, out)
    from scaletrain.checkpoint.hf import import_hf

    assert import_hf(tmp_path / "empty")[0] == import_hf(tmp_path / "folder")[0]


def test_overwrite_replaces_only_export_files(run12, tmp_path, capsys):
    from safetensors.torch import load_file

    assert export(capsys, run12, "--hf", tmp_path / "fresh")[0] == 0
    target = tmp_path / "target"
    target.mkdir()
    keep = {"README.md": b"# my model\n", "sub/notes.txt": b"mine"}
    (target / "tokenizer.json").write_bytes(b"{}")  # an export file now: replaced by the run's
    for name, data in keep.items():
        (target / name).parent.mkdir(exist_ok=True)
        (target / name).write_bytes(data)
    # An earlier export, sharded: its index and shards are export files too, and would be stale.
    for name in (
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ):
        (target / name).write_text("old")
    code, err, out = export(capsys, run12, "--hf", target, "--overwrite")
    assert code == 0, err
    tokenizer = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == sorted(
        ["README.md", "sub", "sub/notes.txt", "config.json", "model.safetensors", *tokenizer]
    )
    assert all((target / n).read_bytes() == d for n, d in keep.items())
    for name in ("config.json", *tokenizer):
        assert (target / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    fresh, now = load_file(tmp_path / "fresh" / "model.safetensors"), load_file(target / "model.safetensors")
    assert fresh.keys() == now.keys() and all((fresh[k] == now[k]).all() for k in fresh)
    assert not list(tmp_path.glob(".*"))


def _copy(run12, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run12, run)
    return run


def test_live_run_is_named_and_its_newest_checkpoint_exported(run12, tmp_path, capsys):
    run = _copy(run12, tmp_path)
    (run / "result.json").unlink()  # still training
    (run / LOCK_NAME).write_text(f'{{"pid": {os.getpid()}, "host": "{socket.gethostname()}"}}\n')
    code, err, out = export(capsys, run, "--hf", tmp_path / "hf")
    assert code == 0, err
    assert f"exported step 12 of {run} (its newest complete checkpoint: the run is live, pid {os.getpid()}" in out


def test_the_pruner_waits_for_an_export_reading(run12, tmp_path, capsys, monkeypatch):
    """A live run saves step 13 and prunes (keep=1) while export reads step 12: the prune waits for the next save."""
    from scaletrain.checkpoint import init_from

    run = _copy(run12, tmp_path)
    root = run / "checkpoints"
    real = init_from.load_state
    pruned = []

    def racing(*args, **kwargs):
        shutil.copytree(root / FINAL, root / "step_00000013")  # the run publishes a newer checkpoint ...
        pruned.extend(store.prune(root, keep=1))  # ... and prunes down to it
        return real(*args, **kwargs)

    monkeypatch.setattr(init_from, "load_state", racing)
    code, err, out = export(capsys, run, "--hf", tmp_path / "hf")
    assert code == 0 and f"exported step 12 of {run}" in out, err
    assert pruned == [] and (root / FINAL / "manifest.json").is_file()
    monkeypatch.undo()
    assert [p.name for p in store.prune(root, keep=1)] == ["step_00000008", FINAL]  # the next save's prune


def test_a_checkpoint_removed_while_read_is_one_line(run12, tmp_path, capsys, monkeypatch):
    from scaletrain.checkpoint import init_from

    run = _copy(run12, tmp_path)
    real = init_from.load_state

    def removed(flat, path, *args, **kwargs):
        shutil.rmtree(path)  # not the pruner: e.g. `train --overwrite` of that run directory
        return real(flat, path, *args, **kwargs)

    monkeypatch.setattr(init_from, "load_state", removed)
    code, err, _ = export(capsys, run, "--hf", tmp_path / "hf")
    assert code == 2 and len(err.splitlines()) == 1 and "removed while being exported" in err, err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))


@pytest.mark.timeout(240)
def test_export_during_a_live_pruning_run_never_tracebacks(excerpt_corpus, tmp_path, capsys):
    """A real run saving and pruning (keep=1) after every step while exports of it run back to back."""
    run = tmp_path / "run"
    sets = [
        *tiny_overrides(excerpt_corpus),
        "train.eval_interval_samples=32",
        "train.max_steps=10",
        "train.target_eval_loss=0.1",
        "checkpoint.interval_steps=1",
        "checkpoint.keep=1",
    ]
    cmd = [sys.executable, "-m", "scaletrain", "train", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]]
    trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    outcomes = []
    try:
        deadline = time.monotonic() + 200
        while not store.complete_checkpoints(run / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.1)
        while trainer.poll() is None and time.monotonic() < deadline:
            try:  # in process: a subprocess each would spend its time importing torch, not racing the pruner
                code = main(["export", str(run), "--hf", str(tmp_path / f"hf{len(outcomes)}")])
            except BaseException as exc:  # what the user would have seen as a traceback
                code = f"{type(exc).__name__}: {exc}"
            captured = capsys.readouterr()
            outcomes.append((code, captured.out, captured.err))
    finally:
        trainer.wait(timeout=200)
    assert trainer.returncode == 0, trainer.stderr.read()[-2000:]
    assert len(outcomes) >= 2, "exports did not overlap the run"
    for code, out, err in outcomes:
        assert code == 0 and "exported step" in out, (code, err[-2000:])
    assert any("the run is live" in out for _, out, _ in outcomes)
