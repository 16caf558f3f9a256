"""The llama31_8b and llama31_405b CPU proxies end to end at toy size on the packaged excerpt with a byte-level BPE
tokenizer: the 405B proxy's base is one llama31_8b-proxy run (bench/proxy_base.py), whose log passes that proxy's
rules; `scaletrain bench` then continues it under the 405B proxy's schedule from step 0, and the checker passes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scaletrain.bench.checker import check_log
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.proxy_base import ensure_proxy_base
from scaletrain.checkpoint.init_from import load_full_model
from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.data.corpus import prepare_excerpt

pytest.importorskip("mlperf_logging")

TINY = [
    "model.vocab_size=1024",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=224",
    "model.seq_len=64",
    "model.rope_original_seq_len=64",
    "train.threads=1",
    "train.progress=false",
    "train.micro_batch_size=32",
]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A data directory whose default BPE corpus is the packaged excerpt (vocab 1024)."""
    data_dir = tmp_path_factory.mktemp("data")
    prepare_excerpt(data_dir / "shakespeare-bpe", vocab_size=1024, tokenizer="bpe")
    return data_dir


def _sets(*overrides):
    return [x for s in (*TINY, *overrides) for x in ("--set", s)]


def test_8b_proxy_run_is_the_405b_proxy_base_and_the_405b_proxy_continues_it(bpe_data, tmp_path):
    cfg = resolve("llama31-405b-proxy", overrides=[f"data.data_dir={bpe_data}", *TINY])
    tiny_base = (*TINY, "train.target_eval_loss=100")
    path = ensure_proxy_base(cfg, extra_overrides=tiny_base)
    assert ensure_proxy_base(cfg, extra_overrides=tiny_base) == path  # built once, then reused
    assert "llama31-8b-proxy-base" in path
    base_cfg, _ = load_full_model(path)
    assert base_cfg.bench.benchmark == "llama31_8b-proxy" and base_cfg.model.arch == "llama31"
    # The base is one timed llama31_8b-proxy run from scratch (the 8B proxy's recipe): its log passes that proxy's
    # rules. GBS 32, an evaluation every 1024 samples: converged at the first one; the cosine ends at max_steps.
    base_log = Path(path).parents[1] / "mllog.txt"
    check = check_log(base_log, "llama31_8b-proxy")
    assert check.ok, check.output
    base_init = {e["key"]: e["value"] for e in read_mllog(base_log)}
    assert base_init["submission_benchmark"] == "llama31_8b" and base_init["max_steps"] == 20_000
    assert base_init["opt_learning_rate_warmup_steps"] + base_init["opt_learning_rate_decay_steps"] == 20_000
    assert base_init["seed"] == 1234 and [
        e["metadata"]["samples_count"] for e in read_mllog(base_log) if e["key"] == "eval_accuracy"
    ] == [1024]
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--benchmark",
            "llama31_405b-proxy",
            "--runs",
            "1",
            "--out",
            str(out),
            *_sets(f"data.data_dir={bpe_data}", "train.target_eval_loss=100"),
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_converged"] == 1 and summary["compliant_all"], summary
    assert code in (0, 1)
    run = out / "run_0"
    assert json.loads((run / "config.json").read_text())["checkpoint"]["init_from"] == path
    init = {e["key"]: e["value"] for e in read_mllog(run / "mllog.txt")}
    # GBS 32 = the proxy's base GBS: LR 2e-3, 64 warm-up steps, cosine to step 20000; evaluation every 16 steps.
    assert (init["opt_base_learning_rate"], init["opt_learning_rate_warmup_steps"]) == (2e-3, 64)
    assert init["init_checkpoint_step"] == 0 and json.loads((run / "result.json").read_text())["steps"] == 16
    # The base's weights were the starting point: 16 steps on, the loss is about where the base ended, far below
    # where 16 steps from a random init would be (the base itself needed 32 to get there).
    first = next(e["value"] for e in read_mllog(run / "mllog.txt") if e["key"] == "eval_accuracy")
    base_evals = [e["value"] for e in read_mllog(base_log) if e["key"] == "eval_accuracy"]
    assert first < base_evals[-1] + 0.05 and base_evals[-1] < math.log(1024) - 0.3
