"""gpt3 rules: init-phase hparams, closed-division violations, and the proxy rules file's coverage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scaletrain.bench.checker import proxy_rules_path, verdict
from scaletrain.bench.closed import official_rule_violations
from scaletrain.bench.rules import mllog_hparams
from scaletrain.config import resolve

FIXTURE = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "gpt3_minimal_passing_4.1.0.mllog"
REQUIRED_INIT_KEYS = [  # closed_gpt3.yaml + common.yaml keys logged in the init phase, in the reference order
    "cache_clear",
    "submission_benchmark",
    "submission_org",
    "submission_division",
    "submission_platform",
    "global_batch_size",
    "max_sequence_length",
    "opt_name",
    "opt_base_learning_rate",
    "opt_end_learning_rate",
    "opt_learning_rate_decay_steps",
    "opt_learning_rate_warmup_steps",
    "opt_learning_rate_decay_schedule",
    "opt_adam_beta_1",
    "opt_adam_beta_2",
    "opt_adam_epsilon",
    "opt_gradient_clip_norm",
    "gradient_accumulation_steps",
    "eval_samples",
    "init_checkpoint_step",
]


def gpt3(*overrides):
    return resolve("gpt3-175b", overrides=["train.global_batch_size=2048", *overrides])


def test_hparams_at_gbs_2048_are_the_reference_values():
    hp = mllog_hparams(gpt3(), 11590004, "32xTEST", dp_size=32)
    keys = [k for k, _ in hp]
    assert [k for k in keys if k in REQUIRED_INIT_KEYS] == REQUIRED_INIT_KEYS
    assert keys[-1] == "seed" and "opt_weight_decay" in keys
    d = dict(hp)
    assert d["opt_learning_rate_warmup_steps"] == 199
    assert d["opt_learning_rate_decay_steps"] == 81450
    assert d["init_checkpoint_step"] == 3000
    assert d["opt_end_learning_rate"] == 2e-6  # exact: no 2.0000000000000003e-06 float noise
    assert d["gradient_accumulation_steps"] == 64 and d["eval_samples"] == 11590004
    assert d["submission_benchmark"] == "gpt3" and d["seed"] == 1234
    assert mllog_hparams(gpt3(), 1, "x")[keys.index("gradient_accumulation_steps")][1] == 2048  # dp 1, mbs 1


def test_hparams_match_the_shared_fixture():
    if not FIXTURE.is_file():
        pytest.skip("../shared is absent")
    logged = {}
    for line in FIXTURE.read_text().splitlines():
        event = json.loads(line.split(":::MLLOG ", 1)[1])
        logged.setdefault(event["key"], event["value"])
    ours = dict(mllog_hparams(gpt3(), 11590004, "1xExample", dp_size=32))
    for key in REQUIRED_INIT_KEYS:
        if key not in ("submission_org", "submission_platform"):
            assert ours[key] == logged[key], key


def test_hparams_reject_bad_inputs():
    with pytest.raises(ValueError, match="dp_size"):
        mllog_hparams(gpt3(), 1, "x", dp_size=3)
    with pytest.raises(ValueError, match="platform"):
        mllog_hparams(gpt3(), 1, "")


def test_official_config_has_no_violations_and_proxy_never_has():
    assert official_rule_violations(gpt3()) == []
    assert official_rule_violations(gpt3("train.global_batch_size=3584", "optim.lr=3e-5")) == []  # in between
    assert official_rule_violations(resolve("gpt3-proxy")) == []


def test_violations_flag_lr_for_gbs_and_seq_len():
    bad_lr = official_rule_violations(gpt3("train.global_batch_size=4096"))
    assert len(bad_lr) == 1 and "optim.lr=2e-05" in bad_lr[0] and "3e-05" in bad_lr[0]
    assert any("optim.lr" in v for v in official_rule_violations(gpt3("optim.lr=3e-5")))
    bad_seq = official_rule_violations(gpt3("model.seq_len=1024"))
    assert len(bad_seq) == 1 and "model.seq_len=1024" in bad_seq[0]


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.n_layers=48", "n_layers"),
        ("model.vocab_size=50304", "vocab_size"),
        ("optim.warmup_samples=1000", "warmup_samples"),
        ("optim.decay_samples=1000000", "decay_samples"),
        ("optim.checkpoint_samples=0", "checkpoint_samples"),
        ("optim.beta2=0.999", "beta2"),
        ("optim.eps=1e-6", "eps"),
        ("optim.weight_decay=0.0", "weight_decay"),
        ("optim.grad_clip=0.5", "grad_clip"),
        ("optim.end_lr_ratio=0.0", "end_lr_ratio"),
        ("train.target_eval_loss=2.7", "target_eval_loss"),
        ("train.eval_interval_samples=12288", "eval_interval_samples"),
    ],
)
def test_violations_cover_every_closed_rule(override, field):
    found = official_rule_violations(gpt3(override))
    assert len(found) == 1 and field in found[0]


def _records(path: Path) -> dict[str, dict]:
    return {r["KEY"]["NAME"]: r["KEY"] for r in yaml.load(path.read_text(), Loader=yaml.BaseLoader) if "KEY" in r}


def test_proxy_rules_keep_every_official_requirement():
    import mlperf_logging.compliance_checker as cc

    official_dir = Path(cc.__file__).parent / "training_4.1.0"
    official = {}
    for name in ("common.yaml", "closed_common.yaml", "closed_gpt3.yaml"):  # later files refine earlier ones
        official.update(_records(official_dir / name))
    with proxy_rules_path().open() as f:
        proxy = {r["KEY"]["NAME"]: r["KEY"] for r in yaml.load(f, Loader=yaml.BaseLoader) if "KEY" in r}
    relaxed = {
        "submission_division",
        "submission_benchmark",
        "max_sequence_length",
        "opt_base_learning_rate",
        "eval_accuracy",
        "init_checkpoint_step",
        "eval_samples",
    }
    for key, rec in official.items():
        assert key in proxy, key
        assert proxy[key].get("REQ") == rec.get("REQ"), key
        if key not in relaxed:
            assert proxy[key] == rec, f"{key}: the proxy must copy the official rule verbatim"
    assert "ATLEAST_ONE_CHECK" not in proxy["eval_accuracy"]
    assert proxy["seed"]["REQ"] == "EXACTLY_ONE"
    assert "enqueue_config" not in proxy_rules_path().read_text().split("\n- BEGIN")[1]


def test_verdict_needs_exit_code_and_success_line():
    assert verdict(0, "INFO - Compliance checks: x\nINFO - SUCCESS\n")
    assert not verdict(1, "INFO - SUCCESS\n")
    assert not verdict(0, "WARNING - bad\nERROR - FAILED\n")
    assert not verdict(0, "no verdict at all")
    assert not verdict(0, "INFO - SUCCESS\nTraceback (most recent call last):\n")
