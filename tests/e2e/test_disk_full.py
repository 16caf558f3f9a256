"""A full disk (ENOSPC) or quota (EDQUOT) at any write of a run: one line `no space left on device while writing
<path>`, exit status 2, result.json (when it fits) with outcome "disk_full", no `.tmp` left, earlier checkpoints
untouched. Faults are injected at each writer (no root needed); one case per save mode also fills a real tmpfs in
a private mount namespace where the machine allows it."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from test_train_e2e import tiny_config, tiny_overrides

from scaletrain.checkpoint import store
from scaletrain.checkpoint.store import READERS_LOCK, CheckpointError, complete_checkpoints, sha256, verify
from scaletrain.cli.main import main
from scaletrain.diskfull import DiskFullError, disk_full, free_bytes, is_no_space
from scaletrain.train.engine import Trainer
from scaletrain.train.run import EXIT_CODES

pytestmark = pytest.mark.hostile

UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _no_space(code=errno.ENOSPC):
    return OSError(code, os.strerror(code))


def _snapshot(root):
    return {p.relative_to(root): sha256(p) for p in root.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- the detector


def test_detector_reads_errno_through_chains_and_dcp_failures(tmp_path):
    try:
        try:
            raise _no_space()
        except OSError as inner:
            raise RuntimeError(UNEXPECTED_POS) from inner  # torch.save on a Python stream
    except RuntimeError as exc:
        chained = exc

    class CheckpointException(BaseException):  # DCP's shape: per-rank (exception, traceback) pairs
        failures = {0: (_no_space(errno.EDQUOT), "tb")}

    assert is_no_space(chained, tmp_path) and is_no_space(CheckpointException(), tmp_path)
    assert not is_no_space(OSError(errno.EIO, "I/O error"), tmp_path)
    assert not is_no_space(OSError(errno.EFBIG, "File too large"), tmp_path)
    # torch's C++ writer keeps no errno: plenty of space on tmp_path's filesystem, so it is no full disk.
    assert not is_no_space(RuntimeError(UNEXPECTED_POS), tmp_path)
    assert free_bytes(tmp_path / "not" / "yet" / "made") == free_bytes(tmp_path)
    full = disk_full(_no_space(), tmp_path / "x")
    assert str(full) == f"no space left on device while writing {tmp_path / 'x'}"


def test_detector_does_not_blame_an_earlier_full_disk_for_a_new_error(tmp_path):
    try:
        try:
            raise DiskFullError(tmp_path / "metrics.jsonl")
        except DiskFullError:
            raise ValueError("unrelated")  # noqa: B904  (the context is the point)
    except ValueError as exc:
        assert not is_no_space(exc, tmp_path)


# ---------------------------------------------------------------- a checkpoint save, phase by phase


def _fail_torch_save_of(name):
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if getattr(f, "name", str(f)).endswith(name):
            f.write(b"PK\x03\x04partial")
            raise _no_space()
        return real(obj, f, *args, **kwargs)

    return save


def _inject(monkeypatch, phase):
    """Make the save's `phase` meet a full disk."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import filesystem as dcp_fs

    if phase == "rng sidecar":
        monkeypatch.setattr(torch, "save", _fail_torch_save_of("rng_rank0.pt"))
    elif phase in ("trainer.json", "manifest"):
        real = store.write_json_durably
        name = store.TRAINER if phase == "trainer.json" else store.MANIFEST

        def write(path, data):
            if path.name == name:
                path.with_name(name + ".tmp").write_text("{")
                raise _no_space()
            return real(path, data)

        monkeypatch.setattr(store, "write_json_durably", write)
    elif phase in ("shard", "shard EDQUOT"):
        code = errno.EDQUOT if "EDQUOT" in phase else errno.ENOSPC

        def write_item(transforms, stream, *args, **kwargs):
            stream.write(b"\0" * 1000)
            raise _no_space(code)

        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    elif phase == "shard, torch writer without errno":
        # What torch's C++ writer says on a full disk; the filesystem then has no space left.
        def write_item(*args, **kwargs):
            raise RuntimeError(UNEXPECTED_POS)

        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
        monkeypatch.setattr("scaletrain.diskfull.free_bytes", lambda path: 0)
    elif phase == "metadata":

        def finish(self, metadata, results):
            (pathlib.Path(self.path) / ".metadata.tmp").write_bytes(b"\x80\x04partial")
            raise _no_space()

        monkeypatch.setattr(FileSystemWriter, "finish", finish)
    elif phase == "fsync":  # NFS and some others report a full disk at fsync, not at write

        def fsync_file(path):
            raise _no_space()

        monkeypatch.setattr(store, "fsync_file", fsync_file)
    elif phase == "publish rename":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if pathlib.Path(src).is_dir() and str(src).endswith(".tmp"):
                raise _no_space()
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(store.os, "replace", replace)
    else:
        raise AssertionError(phase)


PHASES = [
    "rng sidecar",
    "trainer.json",
    "shard",
    "shard EDQUOT",
    "shard, torch writer without errno",
    "metadata",
    "fsync",
    "manifest",
    "publish rename",
]


@pytest.fixture(scope="module")
def saved_run(excerpt_corpus, tmp_path_factory):
    """A run directory whose checkpoint at step 1 is complete."""
    run = tmp_path_factory.mktemp("full") / "run"
    cfg = tiny_config(excerpt_corpus, run, "checkpoint.keep=0")
    trainer = Trainer(cfg, run)
    trainer.init()
    trainer.train_step()
    trainer.save_checkpoint({})
    trainer.finish({})
    return run


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("phase", PHASES)
def test_full_disk_at_each_phase_of_a_save(excerpt_corpus, saved_run, tmp_path, monkeypatch, phase, mode):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    ckpts = run / "checkpoints"
    before = _snapshot(ckpts)
    cfg = tiny_config(
        excerpt_corpus, run, "checkpoint.resume=auto", "checkpoint.keep=0", f"checkpoint.async_save={mode == 'async'}"
    )
    trainer = Trainer(cfg, run)
    trainer.init()
    trainer.train_step()
    _inject(monkeypatch, phase)
    with pytest.raises(DiskFullError) as err:
        trainer.save_checkpoint({})
        trainer.wait_for_saves()  # async: the failure shows when the save is published
    monkeypatch.undo()
    msg = str(err.value)
    tmp = ckpts / "step_00000002.tmp"
    assert msg.startswith(f"no space left on device while writing {tmp} (checkpoint at step 2;"), msg
    assert "\n" not in msg and "earlier checkpoints are untouched" in msg
    assert sorted(p.name for p in ckpts.iterdir() if p.name != READERS_LOCK) == [
        "step_00000001"
    ]  # no .tmp, no half step_2
    assert _snapshot(ckpts) == before
    verify(ckpts / "step_00000001")
    trainer.finish({})


def test_torch_writer_error_with_space_left_is_not_called_a_full_disk(excerpt_corpus, saved_run, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem as dcp_fs

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    trainer = Trainer(tiny_config(excerpt_corpus, run, "checkpoint.resume=auto", "checkpoint.keep=0"), run)
    trainer.init()
    trainer.train_step()

    def write_item(*args, **kwargs):
        raise RuntimeError(UNEXPECTED_POS)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    with pytest.raises(CheckpointError) as err:
        trainer.save_checkpoint({})
    assert not isinstance(err.value, DiskFullError) and "unexpected pos" in str(err.value)
    assert not list((run / "checkpoints").glob("*.tmp"))
    trainer.finish({})


# ---------------------------------------------------------------- whole runs: exit status, result.json, one line


class _FullFile:
    """A file whose writes fail with ENOSPC after `room` successful ones (what a filling disk does)."""

    def __init__(self, f, room):
        self._f, self._room = f, room

    def write(self, data):
        if self._room <= 0:
            raise _no_space()
        self._room -= 1
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _train(capsys, excerpt_corpus, run, *extra):
    args = ["train", "--run-dir", str(run)]
    for item in [
        *tiny_overrides(excerpt_corpus),
        "train.target_eval_loss=0.1",
        "train.max_steps=6",
        "train.eval_interval_samples=32",
        "checkpoint.interval_steps=1",
        "checkpoint.keep=0",
        *extra,
    ]:
        args += ["--set", item]
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def _result(run):
    return json.loads((run / "result.json").read_text())


def _second_call_fails(monkeypatch, target, name):
    real, calls = getattr(target, name), []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise _no_space()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fail)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_with_a_full_disk_at_its_second_checkpoint(capsys, excerpt_corpus, tmp_path, monkeypatch, mode):
    from torch.distributed.checkpoint import filesystem as dcp_fs

    run = tmp_path / "run"
    _second_call_fails(monkeypatch, dcp_fs, "_write_files_from_queue")
    code, err = _train(capsys, excerpt_corpus, run, f"checkpoint.async_save={mode == 'async'}")
    tmp = run / "checkpoints" / "step_00000004.tmp"
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"scaletrain: error: no space left on device while writing {tmp}"), err
    result = _result(run)
    # An asynchronous save fails where it is published: at the next save or, here, at the run's end (step 6).
    steps = 4 if mode == "sync" else 6
    assert (result["status"], result["outcome"], result["steps"]) == ("aborted", "disk_full", steps)
    assert result["reason"] == result["error"] == err[0].removeprefix("scaletrain: error: ")
    assert EXIT_CODES[result["outcome"]] == code
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002"]
    assert not list(run.rglob("*.tmp"))
    verify(run / "checkpoints" / "step_00000002")
    if mode == "sync":  # space freed: the run is not finished, --resume auto continues it from step 2
        monkeypatch.undo()
        code, err = _train(capsys, excerpt_corpus, run, "checkpoint.resume=auto")
        assert code == 0 and _result(run)["outcome"] == "budget_exhausted" and _result(run)["steps"] == 6, err


def test_metrics_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch):
    from scaletrain.train.metrics import MetricsLogger

    real_init = MetricsLogger.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._file = _FullFile(self._file, room=3)

    monkeypatch.setattr(MetricsLogger, "__init__", init)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run)
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {run / 'metrics.jsonl'}"]
    assert _result(run)["outcome"] == "disk_full"


def test_result_json_on_a_full_disk_too(capsys, excerpt_corpus, tmp_path, monkeypatch):
    from scaletrain.train.metrics import MetricsLogger

    real_init, real_write_text = MetricsLogger.__init__, pathlib.Path.write_text

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._file = _FullFile(self._file, room=3)

    def write_text(self, data, *args, **kwargs):
        if self.name == "result.json.tmp":
            real_write_text(self, data[:10], *args, **kwargs)
            raise _no_space()
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(MetricsLogger, "__init__", init)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run)
    assert code == 2 and err == [
        f"scaletrain: error: no space left on device while writing {run / 'metrics.jsonl'} "
        f"({run / 'result.json'} not written either)"
    ]
    assert not (run / "result.json").exists() and not (run / "result.json.tmp").exists()


def test_result_json_alone_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch):
    real_write_text = pathlib.Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == "result.json.tmp":
            raise _no_space()
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run, "checkpoint.interval_steps=0")
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {run / 'result.json'}"]
    assert not (run / "result.json").exists() and not (run / "result.json.tmp").exists()


def test_tensorboard_events_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch):
    from tensorboard.compat.tensorflow_stub.io import gfile

    real, calls = gfile.LocalFileSystem.append, []

    def append(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise _no_space()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run, "checkpoint.interval_steps=0")
    # One line: the writer thread's own traceback ("Exception in thread ...") is kept off stderr.
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {run / 'tensorboard'}"]
    assert _result(run)["outcome"] == "disk_full"


def test_tensorboard_full_at_the_last_flush(capsys, excerpt_corpus, tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def close(self):
        raise _no_space()

    monkeypatch.setattr(SummaryWriter, "close", close)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run, "checkpoint.interval_steps=0")
    # The run went to its budget, but its last events were lost: not "budget_exhausted" with exit status 2.
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {run / 'tensorboard'}"]
    result = _result(run)
    assert (result["status"], result["outcome"], result["steps"]) == ("aborted", "disk_full", 6)


def test_mllog_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch):
    from scaletrain.bench import mllog

    real_open = mllog._FileHandler._open

    def _open(self):
        return _FullFile(real_open(self), room=30)  # past run_start (line 25): inside the run

    monkeypatch.setattr(mllog._FileHandler, "_open", _open)
    run = tmp_path / "run"
    code, err = _train(capsys, excerpt_corpus, run, "checkpoint.interval_steps=0")
    assert code == 2 and len(err) == 1, err  # no "--- Logging error ---" traceback
    assert err[0].startswith(f"scaletrain: error: no space left on device while writing {run / 'mllog.txt'}")
    assert _result(run)["outcome"] == "disk_full"


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing config.json kept"])
def test_config_json_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch, existing):
    run = tmp_path / "run"
    if existing:  # config.json alone is no run: this one starts there and must leave the old file whole
        run.mkdir()
        (run / "config.json").write_text('{"before": true}\n')
    real_write_text = pathlib.Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == "config.json.tmp":
            real_write_text(self, data[:10], *args, **kwargs)
            raise _no_space()
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    code, err = _train(capsys, excerpt_corpus, run)
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {run / 'config.json'}"]
    assert not (run / "config.json.tmp").exists()
    if existing:
        assert (run / "config.json").read_text() == '{"before": true}\n'
    else:
        assert not (run / "config.json").exists()


@pytest.mark.parametrize(
    "call,what",
    [
        ("pwrite", "cannot write the lock file"),
        ("open", "cannot create the lock file"),
        ("mkdir", "cannot use it as a run directory"),
    ],
)
def test_run_lock_on_a_full_disk(capsys, excerpt_corpus, tmp_path, monkeypatch, call, what):
    from scaletrain.train import rundir

    run = tmp_path / "run"
    if call == "mkdir":
        real_mkdir = pathlib.Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self == run:
                raise _no_space()
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    else:
        real = getattr(rundir.os, call)

        def fail(path_or_fd, *args, **kwargs):
            if call == "pwrite" or str(path_or_fd).endswith(rundir.LOCK_NAME):
                raise _no_space()
            return real(path_or_fd, *args, **kwargs)

        monkeypatch.setattr(rundir.os, call, fail)
    code, err = _train(capsys, excerpt_corpus, run)
    path = run if call == "mkdir" else run / rundir.LOCK_NAME
    assert code == 2 and err == [f"scaletrain: error: no space left on device while writing {path} ({what})"]
    assert not run.exists()  # made for this run, removed with its lock


# ---------------------------------------------------------------- a real full filesystem


_NS = """
set -u
mount -t tmpfs -o size=5m tmpfs "$1" || exit 77
shift
out="$1"; shift
"$@"
rc=$?
cp -a "$MNT/run" "$out/" 2>/dev/null
exit $rc
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_real_full_tmpfs(excerpt_corpus, tmp_path, mode):
    """5 MiB: the checkpoint at step 2 (3.4 MB) fits, the one at step 4 does not."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    args = ["train", "--run-dir", str(mnt / "run")]
    for item in [
        *tiny_overrides(excerpt_corpus),
        "train.target_eval_loss=0.1",
        "train.max_steps=6",
        "train.eval_interval_samples=32",
        "checkpoint.interval_steps=1",
        "checkpoint.keep=0",
        f"checkpoint.async_save={mode == 'async'}",
    ]:
        args += ["--set", item]
    env = {**os.environ, "MNT": str(mnt), "PYTHONPATH": os.pathsep.join(sys.path)}
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _NS,
            "sh",
            str(mnt),
            str(out),
            sys.executable,
            "-m",
            "scaletrain",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if proc.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-200:]}")
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith(f"scaletrain: error: no space left on device while writing {mnt / 'run'}"), err
    run = out / "run"
    assert _result(run)["outcome"] == "disk_full"
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002"]
    assert not list(run.rglob("*.tmp"))
    verify(run / "checkpoints" / "step_00000002")
