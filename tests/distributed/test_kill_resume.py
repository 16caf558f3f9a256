"""Crash tolerance end to end: SIGKILL at random moments (including mid-save) and elastic restarts under torchrun.

(a) scripts/kill_resume.py kills a tiny `scaletrain train` job 20 times, some kills at random delays and some
    while a checkpoint is being written; every restart must resume from the newest complete checkpoint, and the
    final losses must equal an uninterrupted run's bitwise.
(b) torchrun --max-restarts: one of two FSDP ranks is SIGKILLed once a checkpoint is complete (rank 1 after the
    first, rank 0 after the third); torchrun restarts the worker group, which resumes (checkpoint.resume=auto)
    from the newest checkpoint and finishes exactly like an uninterrupted 2-rank run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from scaletrain.bench.checker import check_log
from scaletrain.checkpoint import store
from scaletrain.data.indexed import IndexedDataset, write_indexed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "kill_resume.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("kill_resume", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ (a) 20 kills
def _short_validation_set(corpus, out_dir: Path, tokens: int = 2048) -> Path:
    """The first `tokens` tokens of the excerpt's validation set (2 evaluation batches instead of 19): every attempt
    evaluates after every second step, and the full set made the evaluations most of an attempt's training time."""
    valid = IndexedDataset(corpus.valid_prefix)
    prefix = out_dir / "valid_short"
    write_indexed(prefix, [valid.tokens[:tokens].copy()], vocab_size=1024)
    return prefix


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_twenty_sigkills_including_mid_save_resume_bit_exact(tmp_path, excerpt_corpus):
    kill_resume = _load_script()
    report = tmp_path / "kill_resume.json"
    seed = int(os.environ.get("SCALETRAIN_KILL_SEED", "0"))
    # The runs go to RAM when there is /dev/shm (a SIGKILL needs no durable storage; fsyncs on a busy disk would
    # dominate); only the attempt logs are kept, under tmp_path, when the test fails.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    workdir = Path(tempfile.mkdtemp(prefix="kill_resume_", dir=shm or tmp_path))
    t0 = time.monotonic()
    rc = None
    try:
        rc = kill_resume.main(
            [
                "--kills",
                "20",
                "--seed",
                str(seed),
                "--max-steps",
                "96",
                "--eval-every",
                "2",
                "--workdir",
                str(workdir),
                "--json",
                str(report),
                "--quiet",
                "--train-prefix",
                str(excerpt_corpus.train_prefix),
                "--valid-prefix",
                str(_short_validation_set(excerpt_corpus, tmp_path)),
                "--tokenizer",
                str(excerpt_corpus.tokenizer),
            ]
        )
    finally:
        if rc != 0 and (workdir / "logs").is_dir():
            shutil.copytree(workdir / "logs", tmp_path / "logs")
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - t0
    assert report.is_file(), f"kill_resume.py exited {rc} without a report; attempt logs in {tmp_path / 'logs'}"
    summary = json.loads(report.read_text())
    assert rc == 0, "\n".join(summary["failures"])
    assert summary["ok"] and not summary["failures"]
    assert summary["kills"] == 20
    # "including during save": the targeted kills must really have cut a save short (a step_<N>.tmp was left).
    assert summary["kills_during_save"] >= 3, summary["kills_by_phase"]
    # Every restart was checked against the newest complete checkpoint (the script fails otherwise); make sure
    # the check was exercised: most restarts logged a first step, and they resumed from several checkpoints.
    assert summary["restarts"] == 20  # attempts 1..20 (the last one finishes the run)
    assert summary["restarts_resume_observed"] >= 8
    assert summary["restarts_from_checkpoint"] >= 12
    assert len(summary["restarts_resumed_from"]) >= 4
    c = summary["compare"]
    assert c["status"][0] == c["status"][1] and c["steps"] == [96, 96]
    assert c["evals"] == 48 and c["evals_differing"] == 0
    # Every restart re-trained the steps after its checkpoint; metrics.jsonl still has each step once, untorn.
    assert c["metrics_steps"] == 96 and c["metrics_values_differing"] == 0
    assert c["relogged_steps"] == 0 and c["torn_metrics_lines"] == 0
    assert c["run_start"] == 1 and c["run_stop"] == 1 and c["mllog_checker_ok"]
    print(
        f"kill/resume: {elapsed:.0f} s, {summary['kills']} kills ({summary['kills_during_save']} during a save, "
        f"phases {summary['kills_by_phase']}), resumed from {summary['restarts_resumed_from']}"
    )


# ------------------------------------------------------------------------------------------------ (b) torchrun
TARGET = 5.70  # the tiny fp32 run's evaluation loss passes it at step 26 (5.690 there, 5.715 at step 24)
EVERY = 2  # steps between evaluations (eval_interval_samples 32 / GBS 16), each followed by a checkpoint


def _train_args(corpus, run_dir: Path) -> list[str]:
    sets = [
        f"data.train_prefix={corpus.train_prefix}",
        f"data.valid_prefix={corpus.valid_prefix}",
        f"data.tokenizer={corpus.tokenizer}",
        "model.vocab_size=1024",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=2",
        "model.seq_len=64",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.dtype=fp32",
        "train.threads=2",
        "optim.lr=2e-3",
        "optim.warmup_samples=160",
        "optim.decay_samples=3200",
        "train.progress=false",
        "train.eval_interval_samples=32",
        "train.max_steps=40",
        f"train.target_eval_loss={TARGET}",
        "parallel.dp_shard=2",
        "checkpoint.interval_steps=1",
        "checkpoint.resume=auto",
        f"train.run_dir={run_dir}",
    ]
    return ["train", *[a for s in sets for a in ("--set", s)]]


def _torchrun(corpus, run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
        "-m",
        "scaletrain",
        *_train_args(corpus, run_dir),
    ]
    # torchrun's c10d rendezvous shares ONE TCPStore with the workers across restarts, without a per-restart key
    # prefix: a restarted worker can read its peer's gloo address from the previous round and fail with
    # "Connection refused" (pytorch/pytorch#135712). A store per round (hosted by rank 0) avoids the race.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _workers(agent: int) -> dict[int, int]:
    """{pid: RANK} of the torchrun agent's worker processes (its children that carry a RANK)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(entry)] = rank[0]
    return out


def _newest_complete(root: Path) -> int:
    found = store.complete_checkpoints(root)
    return int(found[-1].name[5:]) if found else 0


def _finish(proc: subprocess.Popen, log: Path, timeout: float, started: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The workers run in process groups of their own: kill them first, or they outlive the agent (orphans
        # blocked in a gloo rendezvous for its 30-minute timeout).
        for pid in _workers(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(
            f"torchrun still running {time.monotonic() - started:.0f} s after its start:\n{log.read_text()[-4000:]}"
        ) from None


def _losses(run_dir: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def reference_2rank(excerpt_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("elastic_ref") / "run"
    log = run_dir.parent / "torchrun.log"
    rc = _finish(_torchrun(excerpt_corpus, run_dir, log), log, 180, time.monotonic())
    assert rc == 0, log.read_text()[-4000:]
    return _losses(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(240)
# One restart case (rank 0, the rendezvous host, after the 3rd checkpoint); the twenty-SIGKILL test above covers
# kills at every phase. A rank-1-after-1st-checkpoint case went to keep the suite within its CI time.
@pytest.mark.parametrize("kill_rank,after", [(0, 3)], ids=["rank0-after-3rd-ckpt"])
def test_torchrun_restarts_a_killed_rank_and_resumes(excerpt_corpus, tmp_path, reference_2rank, kill_rank, after):
    ref_records, ref = reference_2rank
    assert ref["status"] == "success" and ref["steps"] == 26  # guards TARGET against numerical drift
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    root, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    started = time.monotonic()
    proc = _torchrun(excerpt_corpus, run_dir, log)
    deadline = started + 180
    killed = killed_at = None
    generations: list[set[int]] = []  # worker pids of each round torchrun started
    restart = None  # (newest complete checkpoint, metrics.jsonl lines) when the second round's workers appeared
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            workers = _workers(proc.pid)
            if workers and (not generations or not set(workers) & generations[-1]):
                generations.append(set(workers))  # a new round: none of the previous round's workers is left
                if len(generations) == 2:  # the old group is gone, the new one is starting
                    restart = (_newest_complete(root), set(metrics.read_text(errors="replace").splitlines()))
            elif workers:
                generations[-1] |= set(workers)
            if killed is None and _newest_complete(root) >= after * EVERY:  # that checkpoint is complete:
                victim = [pid for pid, rank in workers.items() if rank == kill_rank]  # kill one rank now
                assert victim, f"no worker with RANK={kill_rank} among {workers}"
                os.kill(victim[0], signal.SIGKILL)
                killed, killed_at = victim[0], _newest_complete(root)
            time.sleep(0.005)
    finally:
        rc = _finish(proc, log, max(1.0, deadline - time.monotonic()), started)
    elapsed = time.monotonic() - started
    output = log.read_text()
    assert killed is not None, f"no checkpoint appeared before the run ended:\n{output[-4000:]}"
    assert restart is not None, f"torchrun did not restart the workers after the kill:\n{output[-4000:]}"
    assert rc == 0, output[-4000:]
    assert len(generations) == 2, f"{len(generations)} rounds of workers, expected the first and one restart"

    records, result = _losses(run_dir)
    # The restarted group resumed from the newest complete checkpoint: its first training line is that step + 1,
    # and step 1 was never trained twice (a restart from scratch would re-log it).
    # (Each line carries its time stamp: the restart's lines are those the file did not hold when it began.)
    resumed_from, seen = restart
    assert resumed_from >= killed_at >= after * EVERY
    after = [json.loads(line) for line in metrics.read_text().splitlines() if line not in seen]
    first = next(r["step"] for r in after if "loss" in r)
    assert first == resumed_from + 1, (first, resumed_from)
    # The resume cut metrics.jsonl back to its checkpoint: the steps the killed round ran past it are not there
    # twice, and no line torn by the kill is left.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, ref["steps"] + 1))
    assert [r["step"] for r in records if "eval_loss" in r] == [e["step"] for e in ref["evals"]]

    # Same end as the uninterrupted 2-rank run: same steps and status, bitwise-equal losses (same layout).
    assert result["status"] == ref["status"] == "success"
    assert result["steps"] == ref["steps"]
    assert [e["step"] for e in result["evals"]] == [e["step"] for e in ref["evals"]]
    for a, b in zip(result["evals"], ref["evals"]):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-5)
    assert [e["eval_loss"] for e in result["evals"]] == [e["eval_loss"] for e in ref["evals"]]
    last = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert last == {r["step"]: r["loss"] for r in ref_records if "loss" in r}

    # One timed run in the log, compliant; every checkpoint left behind verifies.
    text = (run_dir / "mllog.txt").read_text()
    assert [text.count(f'"key": "{k}"') for k in ("init_start", "run_start", "run_stop")] == [1, 1, 1]
    verdict = check_log(run_dir / "mllog.txt", "gpt3-proxy")
    assert verdict.ok, verdict.output[-3000:]
    for name in os.listdir(root):
        if re.fullmatch(r"step_\d{8}", name):
            store.verify(root / name)
    print(
        f"torchrun: killed rank {kill_rank} once step {killed_at} was saved; the restarted group resumed from "
        f"step {resumed_from} and finished {result['status']} at step {result['steps']} in {elapsed:.0f} s"
    )
