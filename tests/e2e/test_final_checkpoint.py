"""A run that converges or uses up its budget saves its last step, outside the timed region, and a resume of that
checkpoint (a kill before result.json) ends the run with the same result and a valid MLPerf log."""

from __future__ import annotations

import json

from test_train_e2e import read_jsonl, tiny_config

from scaletrain.bench.checker import check_log
from scaletrain.bench.harness import run_once
from scaletrain.checkpoint.store import complete_checkpoints, verify
from scaletrain.train.engine import Trainer

# An evaluation every 4 steps; a save after an evaluation at least 4 steps after the last one. The first evaluation
# (step 4, eval loss ~6.8) already meets the target, so the only save is the final one.
CONVERGES = ["train.eval_interval_samples=64", "checkpoint.interval_steps=4", "train.target_eval_loss=7.5"]


def test_a_converged_run_saves_its_final_step_and_resuming_it_ends_the_same(excerpt_corpus, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(excerpt_corpus, run, *CONVERGES)
    result = run_once(cfg, Trainer(cfg, run), run)
    assert result["outcome"] == "converged" and result["steps"] == 4
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000004"]  # none before the fix
    info = verify(run / "checkpoints" / "step_00000004")
    assert info["step"] == 4
    saved = [r for r in read_jsonl(run / "metrics.jsonl") if "checkpoint_s" in r]
    assert [r["step"] for r in saved] == [4]
    assert check_log(run / "mllog.txt", cfg.bench.benchmark).ok  # the save logs nothing inside the run

    log = (run / "mllog.txt").read_text()
    (run / "result.json").unlink()  # killed after the final save, before result.json
    cfg = tiny_config(excerpt_corpus, run, *CONVERGES, "checkpoint.resume=auto")
    again = run_once(cfg, Trainer(cfg, run), run)
    for key in ("status", "outcome", "steps", "evals", "time_to_train_s"):
        assert again[key] == result[key], key
    # The same events, run_stop at the same time; only train_samples, logged after run_stop, is stamped anew.
    now = (run / "mllog.txt").read_text().splitlines()
    assert len(now) == len(log.splitlines()) and '"train_samples"' in now[-1] and '"run_stop"' in now[-2]
    assert now[:-1] == log.splitlines()[:-1]
    assert json.loads((run / "result.json").read_text())["outcome"] == "converged"
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000004"]
