"""The gpt_oss_20b and deepseekv3_671b CPU proxies end to end at toy size on the packaged excerpt with a byte-level
BPE tokenizer: `scaletrain bench` trains the MoE model for a few steps, its log passes the proxy's rules file, and
the init phase logs the keys the official rules want (max_steps, deepseekv3_671b's moe_aux_loss_coeff)."""

from __future__ import annotations

import json

import pytest

from scaletrain.bench.mllog import read_mllog
from scaletrain.cli.main import main
from scaletrain.data.corpus import prepare_excerpt

pytest.importorskip("mlperf_logging")

TINY = [
    "model.vocab_size=1024",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.seq_len=64",
    "train.threads=1",
    "train.progress=false",
    "train.micro_batch_size=32",
    "train.eval_interval_samples=64",
    "train.target_eval_loss=100",
]
ARCH = {
    "gpt_oss_20b-proxy": [
        "model.n_kv_heads=1",
        "model.head_dim=32",
        "model.d_ff=64",
        "model.moe.d_ff_expert=64",
        "model.rope_original_seq_len=16",
        "model.sliding_window=16",
    ],
    "deepseekv3_671b-proxy": ["model.d_ff=128", "model.moe.d_ff_expert=32"],
}


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A data directory whose default BPE corpus is the packaged excerpt (vocab 1024)."""
    data_dir = tmp_path_factory.mktemp("data")
    prepare_excerpt(data_dir / "shakespeare-bpe", vocab_size=1024, tokenizer="bpe")
    return data_dir


@pytest.mark.parametrize("name", sorted(ARCH))
def test_moe_proxy_bench_logs_pass_the_proxy_rules(bpe_data, tmp_path, name):
    sets = [x for s in (*TINY, *ARCH[name], f"data.data_dir={bpe_data}") for x in ("--set", s)]
    out = tmp_path / "bench"
    code = main(["bench", "--benchmark", name, "--runs", "1", "--out", str(out), *sets])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_converged"] == 1 and summary["compliant_all"], summary
    assert code in (0, 1)  # 1 run of the 10 (gpt_oss) or 3 (deepseek) a submission needs
    events = read_mllog(out / "run_0" / "mllog.txt")
    init = {e["key"]: e["value"] for e in events}
    official = name.removesuffix("-proxy")
    assert init["submission_benchmark"] == official and init["max_sequence_length"] == 64
    # GBS 32, an evaluation every 2 steps: converged at the first one (target 100).
    assert [e["metadata"]["samples_count"] for e in events if e["key"] == "eval_accuracy"] == [64]
    if official == "deepseekv3_671b":
        assert init["moe_aux_loss_coeff"] == 0.01 and init["opt_learning_rate_warmup_steps"] == 4
        assert init["max_steps"] == 12000 and init["opt_base_learning_rate"] == 3e-3
    else:
        assert (
            init["max_steps"] == 20000 == init["opt_learning_rate_warmup_steps"] + init["opt_learning_rate_decay_steps"]
        )
