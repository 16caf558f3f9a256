"""A run directory is never corrupted: one writer (lock), no mixing of two runs, strict JSON, honest exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from test_train_e2e import tiny_overrides

from scaletrain.cli.main import main
from scaletrain.train.rundir import LOCK_NAME, RunDirLock, truncate_metrics

# 4 steps, an evaluation every 2; the target is out of reach, so the run stops at its step budget.
TINY = ["train.eval_interval_samples=32", "train.max_steps=4", "train.target_eval_loss=0.1"]


def cli(capsys, corpus, run_dir, *extra, sets=()):
    args = ["train"]
    for s in [*tiny_overrides(corpus), *TINY, *sets]:
        args += ["--set", s]
    if run_dir is not None:
        args += ["--run-dir", str(run_dir)]
    code = main([*args, *extra])
    captured = capsys.readouterr()
    return code, captured.err.strip(), captured.out


def strict_load(text: str):
    """json.loads that fails on NaN/Infinity, which strict JSON does not have."""

    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(text, parse_constant=refuse)


def steps_of(run_dir, key="loss"):
    return [r["step"] for r in map(strict_load, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def test_busy_run_dir_refused_with_owner_and_stale_lock_taken_over(capsys, tmp_path, excerpt_corpus):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from scaletrain.train.rundir import RunDirLock; "
            f"RunDirLock({str(run)!r}).acquire(); print('locked', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err, _ = cli(capsys, excerpt_corpus, run)
        assert code == 2 and "\n" not in err, err
        assert err == (
            f"scaletrain: error: run directory {run} is in use by pid {holder.pid} on host "
            f"{socket.gethostname()} (lock file {run / LOCK_NAME}); wait for it to end or choose "
            f"another directory"
        )
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # the refused run wrote nothing
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, its flock goes with the process
        holder.wait()
    lock = RunDirLock(run)
    warning = lock.acquire()
    assert warning == (
        f"took over the stale lock of pid {holder.pid} on host {socket.gethostname()} in {run} (not running)"
    )
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(ValueError, match="in use by pid"):  # a second lock, even in this process, is refused
        RunDirLock(run).acquire()
    lock.release()
    assert not (run / LOCK_NAME).exists()


def test_rerun_refused_overwrite_clears_and_finished_resume_is_not_retrained(capsys, tmp_path, excerpt_corpus):
    run = tmp_path / "run"
    code, err, _ = cli(capsys, excerpt_corpus, run)
    assert code == 0, err  # the step budget was used up as asked: not a failure
    result = strict_load((run / "result.json").read_text())
    assert (result["status"], result["outcome"]) == ("aborted", "budget_exhausted")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert LOCK_NAME not in before  # released at the end

    code, err, _ = cli(capsys, excerpt_corpus, run)
    assert code == 2 and err == (
        f"scaletrain: error: {run} already holds a run (result.json); pass --resume auto "
        f"to continue it, --overwrite to replace it, or --run-dir DIR for a new one"
    )
    code, err, _ = cli(capsys, excerpt_corpus, run, "--overwrite", "--resume", "auto")
    assert code == 2 and err == (
        "scaletrain: error: --overwrite and --resume auto: choose one (--overwrite starts "
        "the run again, --resume continues it)"
    )
    # Asking to resume a run that already ended is not a reason to train its tail again.
    code, err, out = cli(capsys, excerpt_corpus, run, "--resume", "auto")
    assert code == 0 and f"{run} already finished (aborted, budget_exhausted); nothing to train" in out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before

    (run / "notes.txt").write_text("mine")  # not a run file: --overwrite leaves it alone
    code, err, _ = cli(capsys, excerpt_corpus, run, "--overwrite", sets=["train.max_steps=2"])
    # checkpoints: the finished run saved its last step (checkpoint.final, on by default)
    assert code == 0 and err == (
        f"--overwrite: removed the previous run's checkpoints, config.json, metrics.jsonl, "
        f"mllog.txt, prediction.json, result.json, tensorboard from {run}"
    )
    assert steps_of(run) == [1, 2] and steps_of(run, "eval_loss") == [2]
    assert strict_load((run / "result.json").read_text())["steps"] == 2
    assert (run / "notes.txt").read_text() == "mine"
    mllog = (run / "mllog.txt").read_text()
    assert mllog.count('"key": "run_start"') == 1


def test_default_run_dir_moves_the_previous_run_aside(capsys, tmp_path, excerpt_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, excerpt_corpus, None)[0] == 0
    first = (tmp_path / "runs/latest/result.json").read_text()
    code, err, _ = cli(capsys, excerpt_corpus, None, sets=["train.max_steps=2"])
    assert code == 0 and err == "moved the previous run in runs/latest to runs/latest.1"
    assert (tmp_path / "runs/latest.1/result.json").read_text() == first
    assert steps_of(tmp_path / "runs/latest") == [1, 2]


def test_bench_out_holding_a_benchmark_is_refused(capsys, tmp_path):
    out = tmp_path / "bench"
    (out / "run_0").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    code = main(["bench", "--out", str(out), "--runs", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"scaletrain: error: {out} already holds a run (summary.json); pass --resume auto "
        f"to continue it, --overwrite to replace it, or --out DIR for a new one"
    )
    assert (out / "summary.json").read_text() == "{}" and not (out / LOCK_NAME).exists()


def test_non_finite_eval_loss_is_strict_json_and_exit_1(capsys, tmp_path, excerpt_corpus, monkeypatch):
    import torch

    from scaletrain.train.engine import Trainer

    monkeypatch.setattr(Trainer, "_eval_loss_sum", lambda self, x, y: torch.tensor(float("nan"), dtype=torch.float64))
    run = tmp_path / "run"
    code, err, _ = cli(capsys, excerpt_corpus, run)
    assert code == 1, err
    result = strict_load((run / "result.json").read_text())
    assert (result["status"], result["outcome"]) == ("aborted", "diverged")
    assert result["reason"] == "non-finite eval loss nan at step 2"
    assert result["eval_loss"] is None and result["non_finite"] == {"eval_loss": "nan"}
    assert result["evals"][-1]["eval_loss"] is None and result["evals"][-1]["non_finite"] == {"eval_loss": "nan"}
    evals = [r for r in map(strict_load, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert evals and evals[-1]["eval_loss"] is None and evals[-1]["non_finite"] == {"eval_loss": "nan"}


def test_exit_codes_target_diverged_crashed(capsys, tmp_path, excerpt_corpus, monkeypatch):
    code, err, _ = cli(capsys, excerpt_corpus, tmp_path / "ok", sets=["train.target_eval_loss=9"])
    assert code == 0 and strict_load((tmp_path / "ok/result.json").read_text())["outcome"] == "converged"
    code, err, _ = cli(capsys, excerpt_corpus, tmp_path / "div", sets=["optim.lr=1e3"])  # the largest lr config allows
    assert (tmp_path / "div/result.json").is_file(), (code, err)
    result = strict_load((tmp_path / "div/result.json").read_text())
    assert code == 1 and result["outcome"] == "diverged" and result["reason"].startswith("non-finite training loss")

    from scaletrain.train.engine import Trainer

    def boom(self):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(Trainer, "train_step", boom)
    with pytest.raises(RuntimeError):  # uncaught: the interpreter exits 1 with the traceback
        cli(capsys, excerpt_corpus, tmp_path / "crash")
    result = strict_load((tmp_path / "crash/result.json").read_text())
    assert result["outcome"] == "crashed" and result["error"] == "RuntimeError: simulated crash"
    assert not (tmp_path / "crash" / LOCK_NAME).exists()  # released on the exception too


def test_model_too_big_for_host_memory_fails_before_allocating(capsys, tmp_path, monkeypatch):
    import scaletrain.parallel.parallelize as parallelize
    import scaletrain.train.host as host

    monkeypatch.setattr(host, "available_memory_bytes", lambda: 24 * 10**9)
    monkeypatch.setattr(parallelize, "parallelize", lambda *a, **k: pytest.fail("the model was built"))
    code = main(["train", "--preset", "gpt3-175b", "--set", "train.device=cpu", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "scaletrain: error: gpt3-175b needs ~2.8 TB for fp32 weights, gradients and Adam; "
        "this machine has 24 GB available"
    )
    assert not (tmp_path / "r").exists()


def test_truncate_metrics_keeps_records_through_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)] + [json.dumps({"step": 2, "eval_loss": 1.0})]
    lines += [json.dumps({"step": 3, "loss": 1.0}), '{"step": 4, "lo']  # a line torn by a kill
    path.write_text("\n".join(lines))
    truncate_metrics(path, 2)
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    truncate_metrics(path, 0)
    assert path.read_text() == ""


def test_overwrite_clears_only_run_files_and_outside_checkpoints(tmp_path):
    from scaletrain.train.rundir import RunDirError, apply_plan, plan_existing

    run, ext = tmp_path / "run", tmp_path / "ckpt"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "fabric.json").write_text("{}")  # someone else's file in the run directory
    (ext / "step_00000004").mkdir(parents=True)
    (ext / "step_00000006.tmp").mkdir()
    (ext / "notes.txt").write_text("mine")
    # Checkpoints of an earlier run in checkpoint.dir count as a run even when the run directory looks empty.
    with pytest.raises(RunDirError, match=f"already holds a run \\({ext}\\)"):
        plan_existing(tmp_path / "new", resume="none", overwrite=False, checkpoint_dir=ext)
    assert plan_existing(run, resume="none", overwrite=True, checkpoint_dir=ext) == "overwrite"
    line = apply_plan(run, "overwrite", checkpoint_dir=ext)
    assert line == (
        f"--overwrite: removed the previous run's checkpoints, config.json, {ext / 'step_00000004'}, "
        f"{ext / 'step_00000006.tmp'} from {run}"
    )
    assert sorted(p.name for p in run.iterdir()) == ["fabric.json"]
    assert sorted(p.name for p in ext.iterdir()) == ["notes.txt"]


def test_default_bench_out_moves_the_previous_benchmark_aside(capsys, tmp_path, excerpt_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs/bench/run_0").mkdir(parents=True)
    (tmp_path / "runs/bench/summary.json").write_text("{}")
    args = ["bench", "--runs", "1"] + [a for s in [*tiny_overrides(excerpt_corpus), *TINY] for a in ("--set", s)]
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 0 and err.splitlines()[0] == "moved the previous run in runs/bench to runs/bench.1", err
    assert (tmp_path / "runs/bench.1/summary.json").read_text() == "{}"
    summary = strict_load((tmp_path / "runs/bench/summary.json").read_text())
    assert [r["outcome"] for r in summary["runs"]] == ["budget_exhausted"] and not summary["converged_all"]
