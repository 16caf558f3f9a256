"""The MLPerf-style benchmark under torchrun: same compliant logs and the same losses as one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scaletrain.cli.main import main


def _args(corpus, out):
    return [
        "bench",
        "--runs",
        "1",
        "--out",
        str(out),
        "--set",
        f"data.train_prefix={corpus.train_prefix}",
        "--set",
        f"data.valid_prefix={corpus.valid_prefix}",
        "--set",
        f"data.tokenizer={corpus.tokenizer}",
        "--model.vocab_size",
        "1024",
        "--model.n_layers",
        "2",
        "--model.d_model",
        "64",
        "--model.n_heads",
        "2",
        "--model.seq_len",
        "64",
        "--train.global_batch_size",
        "16",
        "--train.micro_batch_size",
        "4",
        "--train.dtype",
        "fp32",
        "--train.eval_interval_samples",
        "160",
        "--train.target_eval_loss",
        "6.0",
        "--train.max_steps",
        "40",
        "--optim.lr",
        "2e-3",
        "--optim.warmup_samples",
        "160",
        "--optim.decay_samples",
        "3200",
        "--train.threads",
        "2",
        "--train.progress",
        "false",
    ]


def _crash_report(stderr: str) -> str:
    """The faulthandler dumps of crashed ranks (train/distributed.py enables it) and the end of stderr."""
    at = stderr.find("Fatal Python error")
    head = stderr[at : at + 6000] + "\n...\n" if at >= 0 else ""
    return head + stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe"], ["--parallel.tp", "2"]], ids=["pp2", "tp2"]
)
def test_bench_under_torchrun_matches_single_process(excerpt_corpus, tmp_path, layout):
    assert main(_args(excerpt_corpus, tmp_path / "single")) == 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "scaletrain",
        *_args(excerpt_corpus, tmp_path / "multi"),
        *layout,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + _crash_report(proc.stderr)
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    multi = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert multi["compliant_all"] and multi["converged_all"]
    a, b = single["runs"][0], multi["runs"][0]
    assert a["steps"] == b["steps"] and len(a["evals"]) == len(b["evals"])
    for ea, eb in zip(a["evals"], b["evals"]):
        assert eb["eval_loss"] == pytest.approx(ea["eval_loss"], abs=1e-5)
    log = (tmp_path / "multi" / "run_0" / "mllog.txt").read_text()
    assert '"submission_platform", "value": "2xCPU"' in log
    assert not (tmp_path / "multi" / "run_1").exists()
