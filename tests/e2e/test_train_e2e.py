"""Tiny end-to-end runs on the packaged excerpt: golden losses, the run-directory contract, MLLOG compliance."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from scaletrain.bench.checker import check_log
from scaletrain.bench.harness import mlperf_observers
from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.train.engine import Trainer
from scaletrain.train.run import train

# fp32, 1 thread, seed 1234 on the excerpt at vocab 1024. Regenerate only for an intended numerical change.
GOLDEN_LOSS = {1: 6.92303, 10: 6.48883, 20: 5.8494, 30: 5.72932}
GOLDEN_EVAL = {10: 6.38235, 20: 5.79966, 30: 5.65593}
TOL = 2e-3  # summation order differs across CPU kernels (AVX2 vs AVX-512); a real bug moves losses far more


def tiny_overrides(corpus):
    """2-layer d64 model on the excerpt, fp32 on one thread so the golden losses are reproducible."""
    return [
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
        "train.threads=1",
        "train.eval_interval_samples=160",
        "optim.lr=2e-3",
        "optim.warmup_samples=160",
        "optim.decay_samples=3200",
        "train.progress=false",
    ]


def tiny_config(corpus, run_dir, *extra):
    return resolve(
        "gpt3-proxy",
        overrides=[
            *tiny_overrides(corpus),
            "train.target_eval_loss=0.1",
            "train.max_steps=30",
            f"train.run_dir={run_dir}",
            *extra,
        ],
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_golden_run_and_run_directory_contract(excerpt_corpus, tmp_path):
    cfg = tiny_config(excerpt_corpus, tmp_path / "run")
    result = train(cfg)
    run = tmp_path / "run"
    lines = read_jsonl(run / "metrics.jsonl")
    steps = {r["step"]: r for r in lines if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}
    print({k: round(steps[k]["loss"], 5) for k in GOLDEN_LOSS}, {k: round(v, 5) for k, v in evals.items()})
    for step, want in GOLDEN_LOSS.items():
        assert steps[step]["loss"] == pytest.approx(want, abs=TOL), f"train loss at step {step}"
    for step, want in GOLDEN_EVAL.items():
        assert evals[step] == pytest.approx(want, abs=TOL), f"eval loss at step {step}"
    # Contract: every training line has these keys; tokens count whole global batches.
    for r in steps.values():
        assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 16 * 64
    assert result == json.loads((run / "result.json").read_text())
    assert result["status"] == "aborted" and result["steps"] == 30 and result["seed"] == 1234
    assert result["eval_loss"] == pytest.approx(evals[30])
    assert json.loads((run / "config.json").read_text())["model"]["d_model"] == 64
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert main(["report", str(run)]) == 0 and (run / "loss.png").stat().st_size > 10_000
    assert (run / "perf.png").stat().st_size > 10_000
    # Measured breakdown: the parts sum to the step time by construction, and other_s (what no part holds) is small.
    parts = ("data_s", "fwd_bwd_s", "optimizer_s")
    for r in steps.values():
        assert min(r[k] for k in (*parts, "comm_exposed_s")) >= 0
        assert sum(r[k] for k in parts) + r["other_s"] == pytest.approx(r["step_time_s"], abs=1e-9)
    timed = sum(r["step_time_s"] for r in steps.values())
    assert sum(r[k] for r in steps.values() for k in parts) == pytest.approx(timed, rel=0.05)
    assert all(r["comm_exposed_s"] == 0 for r in steps.values())  # one process: no collective
    assert all(r["eval_s"] > 0 for r in lines if "eval_loss" in r)
    # prediction.json: the simulator's view of this run on the CPU measured at start-up.
    pred = json.loads((run / "prediction.json").read_text())
    assert pred["schema"] == 1 and "error" not in pred and pred["world_size"] == 1 and pred["layout"]
    dev = pred["device"]
    assert dev["kind"] == "cpu" and dev["catalog_key"] is None and dev["measured"] and dev["threads"] == 1
    assert dev["peak_flops"] == dev["gemm_flops"]["fp32"] > 0 and dev["mem_bw_bytes_s"] > 0
    # One rank: the host figures are its own, and it keeps all of them.
    assert dev["local_ranks"] == 1 and dev["cores"] >= 1 and dev["probe_window_s"] == 0.03
    assert (dev["host_peak_flops"], dev["host_mem_bw_bytes_s"]) == (dev["peak_flops"], dev["mem_bw_bytes_s"])
    for key in ("step_time_s", "tokens_per_s", "mfu", "memory_per_rank_gib"):
        assert pred[key] > 0, key
    assert pred["tokens_per_s"] == pytest.approx(16 * 64 / pred["step_time_s"])
    assert set(pred["breakdown"]) == {*parts, "comm_exposed_s", "other_s"}
    assert sum(pred["breakdown"][k] for k in (*parts, "other_s")) == pytest.approx(pred["step_time_s"])
    assert pred["efficiency"]["gemm_eff"] > 0
    block = result["predicted_vs_measured"]
    assert block["step_time_s"]["predicted"] == pred["step_time_s"]
    assert block["step_time_s"]["measured"] > 0
    assert block["step_time_s"]["ratio"] == pytest.approx(block["step_time_s"]["measured"] / pred["step_time_s"])
    assert block["tokens_per_s"]["measured"] == pytest.approx(16 * 64 / block["step_time_s"]["measured"])
    assert block["memory_peak_gib"]["predicted"] == pred["memory_per_rank_gib"]
    assert block["memory_peak_gib"]["measured"] == pytest.approx(steps[30]["peak_mem_gib"])


def test_reaching_the_target_is_success_and_log_is_compliant(excerpt_corpus, tmp_path, monkeypatch):
    target = (GOLDEN_EVAL[20] + GOLDEN_EVAL[10]) / 2  # reached at the second evaluation
    cfg = tiny_config(excerpt_corpus, tmp_path / "run", f"train.target_eval_loss={target}")

    def unsupported(*args, **kwargs):
        raise ValueError("this layout is not\nsupported")

    # A run the simulator cannot price says why in prediction.json and trains on.
    monkeypatch.setattr("scaletrain.sim.run_prediction.step_time", unsupported)
    result = train(cfg, observers=mlperf_observers)  # the MLPerf log, as `scaletrain train` attaches it
    assert result["status"] == "success" and result["steps"] == 20
    pred = json.loads((tmp_path / "run" / "prediction.json").read_text())
    assert pred["error"] == "ValueError: this layout is not supported" and pred["device"]["kind"] == "cpu"
    block = result["predicted_vs_measured"]
    assert all(block[k]["predicted"] is None and block[k]["ratio"] is None for k in block)
    assert block["step_time_s"]["measured"] > 0
    assert 0 < result["time_to_train_s"] < 120
    verdict = check_log(tmp_path / "run" / "mllog.txt", "gpt3-proxy")
    assert verdict.ok, verdict.output


def test_a_plain_train_call_never_imports_bench(excerpt_corpus, tmp_path):
    """`train(cfg)` from Python without observers: the loop alone writes the run directory, no MLLOG, and
    `scaletrain.bench` is never imported (train/ sits below bench/)."""
    run, out = tmp_path / "run", tmp_path / "out.json"
    overrides = [*tiny_overrides(excerpt_corpus), "train.max_steps=10", f"train.run_dir={run}"]
    code = (
        "import json, sys\n"
        "from scaletrain.config import resolve\n"
        "from scaletrain.train.run import train\n"
        f"result = train(resolve('gpt3-proxy', overrides={overrides!r}))\n"
        "bench = sorted(m for m in sys.modules if m == 'scaletrain.bench' or m.startswith('scaletrain.bench.'))\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'bench': bench, 'result': result}}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["bench"] == []
    assert seen["result"] == json.loads((run / "result.json").read_text()) and seen["result"]["steps"] == 10
    assert seen["result"]["outcome"] == "budget_exhausted" and (run / "metrics.jsonl").is_file()
    assert not (run / "mllog.txt").exists() and "mllog" not in seen["result"]


def test_warm_up_does_not_change_the_run(excerpt_corpus, tmp_path, monkeypatch):
    def losses(run_dir, warm):
        if not warm:
            monkeypatch.setattr(Trainer, "_warm_up", lambda self, steps=2: None)
        trainer = Trainer(tiny_config(excerpt_corpus, run_dir), run_dir)
        trainer.init()
        out = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.finish({})
        return out

    assert losses(tmp_path / "a", True) == losses(tmp_path / "b", False)


def test_gradient_accumulation_matches_one_big_batch(excerpt_corpus, tmp_path):
    def first_losses(mbs):
        cfg = tiny_config(excerpt_corpus, tmp_path / f"m{mbs}", f"train.micro_batch_size={mbs}")
        trainer = Trainer(cfg, tmp_path / f"m{mbs}")
        trainer.init()
        out = [trainer.train_step()["loss"] for _ in range(3)]
        trainer.finish({})
        return out

    assert first_losses(16) == pytest.approx(first_losses(4), abs=1e-5)


def test_nan_loss_aborts_with_clear_reason_and_keeps_weights(excerpt_corpus, tmp_path, monkeypatch):
    cfg = tiny_config(excerpt_corpus, tmp_path / "run")
    trainer = Trainer(cfg, tmp_path / "run")
    real = Trainer._forward_backward

    def poisoned(self, batches):
        value = real(self, batches)
        return math.nan if self.step == 4 else value

    monkeypatch.setattr(Trainer, "_forward_backward", poisoned)
    from scaletrain.bench.harness import run_once

    snapshot = {}
    orig_step = Trainer.train_step

    def spy(self):
        if self.step == 4:
            snapshot.update({k: v.clone() for k, v in self.model.state_dict().items()})
        return orig_step(self)

    monkeypatch.setattr(Trainer, "train_step", spy)
    result = run_once(cfg, trainer, tmp_path / "run")
    assert result["status"] == "aborted" and result["steps"] == 4
    assert "step 5" in result["reason"] and "nan" in result["reason"].lower()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in snapshot.items())
    assert '"status": "aborted"' in (tmp_path / "run" / "mllog.txt").read_text()


def test_bench_cli_three_runs_scored_and_checked(excerpt_corpus, tmp_path, capsys):
    cfg_file = tmp_path / "tiny.toml"
    target = (GOLDEN_EVAL[10] + GOLDEN_EVAL[20]) / 2
    cfg_file.write_text(f"[train]\ntarget_eval_loss = {target}\nmax_steps = 40\n")
    args = ["bench", "--runs", "3", "--out", str(tmp_path / "bench"), "--config", str(cfg_file)]
    over = [a for o in tiny_overrides(excerpt_corpus) for a in ("--set", o)]
    assert main(args + over) == 0
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["n_converged"] == 3 and summary["converged_all"] and summary["compliant_all"]
    times = sorted(r["time_to_train_s"] for r in summary["runs"])
    assert summary["score_s"] == pytest.approx(times[1], rel=1e-6)  # olympic mean of 3 = median
    assert len({r["seed"] for r in summary["runs"]}) == 3
    assert "score" in capsys.readouterr().out.lower()
