"""Batch jobs: plain log lines off a terminal, and SIGTERM/SIGUSR1 save a checkpoint that resumes bit-exactly.

The in-process tests raise the signal from inside a chosen step, so the save lands at a known step (inside a block,
and at a block's last step just before its evaluation); the subprocess tests send it from outside, as Slurm or
torchrun would, to the `scaletrain train` command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from test_train_e2e import read_jsonl, tiny_config, tiny_overrides

from scaletrain.bench.checker import check_log
from scaletrain.bench.harness import mlperf_observers, run_once
from scaletrain.checkpoint.store import complete_checkpoints, verify
from scaletrain.train.engine import Trainer
from scaletrain.train.protocol import Preempted
from scaletrain.train.run import train

# 40 steps at most, an evaluation every 10, a checkpoint after each; the target is out of reach.
RUN = ["checkpoint.interval_steps=1", "train.max_steps=40"]


def cli_args(corpus, run_dir, *extra, progress=False):
    sets = [*tiny_overrides(corpus), "train.target_eval_loss=0.1", *RUN, f"train.run_dir={run_dir}", *extra]
    if progress:
        sets.remove("train.progress=false")
    return [
        sys.executable,
        "-m",
        "scaletrain",
        "train",
        "--preset",
        "gpt3-proxy",
        *[a for s in sets for a in ("--set", s)],
    ]


@pytest.fixture(scope="module")
def reference(excerpt_corpus, tmp_path_factory):
    """The uninterrupted run: (training loss per step, result.json, MLLOG events without times and line numbers)."""
    run = tmp_path_factory.mktemp("batch_ref") / "run"
    result = train(tiny_config(excerpt_corpus, run, *RUN), observers=mlperf_observers)
    assert result["steps"] == 40 and len(result["evals"]) == 4
    return _losses(run), result, _events(run)


def _losses(run):
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def _events(run):
    out = []
    for line in (run / "mllog.txt").read_text().splitlines():
        event = json.loads(line.split(":::MLLOG ", 1)[1])
        meta = {k: v for k, v in event["metadata"].items() if k != "lineno"}
        out.append((event["key"], event["value"], meta))
    return out


def _assert_resumed_like_reference(run, result, reference, every=1):
    ref_losses, ref_result, ref_events = reference
    assert result["status"] == ref_result["status"] and result["steps"] == ref_result["steps"]
    # Bitwise, every logged step (every `every`-th: train.log_interval) exactly once.
    assert _losses(run) == {k: v for k, v in ref_losses.items() if k % every == 0}
    keys = ("step", "eval_loss", "train_loss", "lr")
    assert [[e[k] for k in keys] for e in result["evals"]] == [[e[k] for k in keys] for e in ref_result["evals"]]
    # The same MLLOG events in the same order as the uninterrupted run (one block_start per block, one run_stop).
    assert _events(run) == ref_events
    verdict = check_log(run / "mllog.txt", "gpt3-proxy")
    assert verdict.ok, verdict.output[-2000:]


def _assert_stopped_cleanly(run, step, signum):
    ckpts = complete_checkpoints(run / "checkpoints")
    assert ckpts[-1].name == f"step_{step:08d}" and (ckpts[-1] / "manifest.json").is_file()
    verify(ckpts[-1])
    assert json.loads((ckpts[-1] / "trainer.json").read_text())["step"] == step
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "preempted" and result["steps"] == step
    assert signal.Signals(signum).name in result["reason"]
    log = (run / "mllog.txt").read_text()
    assert '"run_stop"' not in log  # the run is not over


# ------------------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize(
    "signum,step,periodic",
    [(signal.SIGTERM, 7, 1), (signal.SIGUSR1, 10, 0)],
    ids=["sigterm-mid-block", "sigusr1-last-step-of-block-no-periodic-checkpoints"],
)
def test_signal_saves_the_step_and_resume_continues_the_block(
    excerpt_corpus, tmp_path, monkeypatch, reference, signum, step, periodic
):
    run = tmp_path / "run"
    ckpt = f"checkpoint.interval_steps={periodic}"  # 0: the signal saves even when no periodic save is asked for
    real = Trainer.train_step

    def signalled(self):
        out = real(self)
        if self.step == step:
            os.kill(os.getpid(), signum)  # arrives inside the step, as an external signal would
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled)
    cfg = tiny_config(excerpt_corpus, run, *RUN, ckpt)
    with pytest.raises(Preempted) as info:
        run_once(cfg, Trainer(cfg, run), run)
    assert info.value.step == step and info.value.exit_code == 128 + signum
    _assert_stopped_cleanly(run, step, signum)
    assert signal.getsignal(signum) == signal.SIG_DFL  # the handlers are given back
    monkeypatch.setattr(Trainer, "train_step", real)

    assert len(complete_checkpoints(run / "checkpoints")) == (step // 10 if periodic else 0) + 1

    cfg = tiny_config(excerpt_corpus, run, *RUN, ckpt, "checkpoint.resume=auto")
    result = run_once(cfg, Trainer(cfg, run), run)
    _assert_resumed_like_reference(run, result, reference)


# ------------------------------------------------------------------------------------------------ subprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_to_the_train_command_exits_resumable(excerpt_corpus, tmp_path, reference, signum):
    """Both signals save and exit 128+signal. After SIGTERM the run is resumed through the CLI too (SIGUSR1's resume
    runs the same code, covered in process above), and its stdout, a pipe, shows the plain log lines: a line every
    `train.log_interval` (2) steps and one per evaluation, with train.progress left at its default (true)."""
    run = tmp_path / "run"
    args = cli_args(excerpt_corpus, run, "train.log_interval=2", progress=True)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step: 2/"):  # training is under way: stop it, as Slurm would
            proc.send_signal(signum)
            break
    proc.stdout.read()
    err = proc.stderr.read()
    assert proc.wait(timeout=400) == 128 + signum, err[-3000:]
    stopped = re.search(r"stopped after step (\d+) and saved (\S+);", err)
    assert stopped, err[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 40, "the run ended before the signal was handled"
    _assert_stopped_cleanly(run, step, signum)
    assert f"(exit status {128 + signum})" in err and "resume it with --resume auto" in err
    if signum != signal.SIGTERM:
        return

    resumed = subprocess.run([*args, "--resume", "auto"], capture_output=True, text=True, timeout=400)
    # The budget runs out above the target: a normal end (exit 0), not a failure that a launcher would restart.
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_resumed_like_reference(run, json.loads((run / "result.json").read_text()), reference, every=2)

    out = resumed.stdout
    assert "\x1b[" not in out and "\r" not in out  # no terminal control codes, no redraws
    lines = [line for line in out.splitlines() if line.startswith("step: ")]
    train_lines = [line for line in lines if " loss: " in line]
    eval_lines = [line for line in lines if " eval_loss: " in line]
    first = step + 2 - step % 2  # the first even step after the checkpoint
    assert [int(line.split()[1].split("/")[0]) for line in train_lines] == list(range(first, 41, 2))
    assert [int(line.split()[1].split("/")[0]) for line in eval_lines] == [s for s in (10, 20, 30, 40) if s > step]
    for line in train_lines:
        assert re.fullmatch(
            r"step: \d+/<=40  loss: \d+\.\d{4}  lr: \d\.\d\de-\d\d  grad_norm: \d+\.\d{4}  "
            r"tok/s: [\d,]+  memory: \d+\.\d\d GiB peak RSS"
            r"(  eta: (~\d+:\d\d:\d\d to the target \(step ~\d+\), )?<=\d+:\d\d:\d\d to step 40 "
            r"\(step budget\))?",
            line,
        ), line
        assert ("eta:" in line) == (not line.startswith("step: 40/"))  # no peak FLOP/s for a CPU: no mfu
    for line in eval_lines:
        assert re.fullmatch(r"step: \d0/<=40  eval_loss: \d+\.\d{4}  target: 0\.1", line), line
    # The printed numbers are the run's own: the same as metrics.jsonl's for those steps.
    # A checkpoint save's own line ({"step", "checkpoint_s"}; the final save's too) is no step's numbers.
    records = {(r["step"], "eval_loss" in r): r for r in read_jsonl(run / "metrics.jsonl") if "checkpoint_s" not in r}
    assert train_lines[-1].startswith(f"step: 40/<=40  loss: {records[(40, False)]['loss']:.4f}  ")
    assert eval_lines[-1] == f"step: 40/<=40  eval_loss: {records[(40, True)]['eval_loss']:.4f}  target: 0.1"
