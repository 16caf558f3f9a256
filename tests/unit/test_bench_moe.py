"""gpt_oss_20b and deepseekv3_671b: the rules constants agree with the installed mlperf-logging's rules files and RCP
tables; scripted logs at the official configs pass the compliance checker (deepseekv3_671b's first evaluation where
6.1.0 wants it) and the RCP checker; a wrong MoE auxiliary loss coefficient and other planted breaks fail
(~8 checker calls, ~1-3 s each)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scaletrain import benchmarks
from scaletrain.bench.checker import check_log, check_rcp, ruleset
from scaletrain.bench.closed import official_rule_violations
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.rules import mllog_hparams
from scaletrain.bench.scripted import scripted_run, scripted_submission
from scaletrain.benchmarks import GbsRange, LrSqrt, Steps
from scaletrain.config import resolve

yaml = pytest.importorskip("yaml")
pytest.importorskip("mlperf_logging")

RULES = {name: benchmarks.get(name) for name in ("gpt_oss_20b", "deepseekv3_671b")}
PRESET = {"gpt_oss_20b": "gpt-oss-20b", "deepseekv3_671b": "deepseek-v3-671b"}


def _pkg() -> Path:
    import mlperf_logging

    return Path(mlperf_logging.__file__).parent


def _checks(name: str) -> dict[str, dict]:
    path = _pkg() / "compliance_checker" / f"training_{ruleset(name)}" / f"closed_{name}.yaml"
    return {e["KEY"]["NAME"]: e["KEY"] for e in yaml.safe_load(path.read_text())}


def _config(name: str, gbs: int | None = None, *overrides: str):
    """The official config at `gbs`, with the LR, warm-up and decay the rules want there."""
    ov = []
    if gbs is not None:
        ov.append(f"train.global_batch_size={gbs}")
        spec = RULES[name]
        if name == "deepseekv3_671b":
            ov.append(f"optim.lr={spec.rule(LrSqrt).at(gbs)!r}")
            ov.append(f"optim.warmup_samples={spec.rule(Steps, 'warmup').steps * gbs}")
        ov.append(f"optim.decay_samples={spec.rule(Steps, 'decay').steps * gbs}")
    return resolve(PRESET[name], overrides=[*ov, *overrides])


def test_rulesets_and_keys():
    for name in RULES:
        assert benchmarks.package_rulesets(name) == ("6.0.0", "6.1.0") and ruleset(name) == "6.1.0"
        official = set(_checks(name))
        own = set(RULES[name].own_init_keys)
        # Every key of the closed file is one mllog_hparams logs (eval_accuracy is the loop's).
        cfg = _config(name)
        logged = {k for k, _ in mllog_hparams(cfg, 1024, "8xTEST", dp_size=8)}
        assert official - {"eval_accuracy"} <= logged and own <= official


@pytest.mark.parametrize("name", list(RULES))
def test_constants_are_the_packages(name):
    spec, checks = RULES[name], _checks(name)
    assert checks["max_sequence_length"]["CHECK"].strip() == f"v['value'] == {spec.seq_len}"
    assert checks["eval_samples"]["CHECK"].strip() == "v['value'] == 1024"
    assert spec.eval_tokens == 1024 * spec.seq_len
    assert f"v['value'] <= {spec.target}" in checks["eval_accuracy"]["ATLEAST_ONE_CHECK"]
    for key, value in (
        ("opt_adamw_beta_1", spec.required("optim.beta1")),
        ("opt_adamw_beta_2", spec.required("optim.beta2")),
        ("opt_adamw_epsilon", spec.required("optim.eps")),
        ("opt_adamw_weight_decay", spec.required("optim.weight_decay")),
        ("opt_gradient_clip_norm", spec.required("optim.grad_clip")),
    ):
        assert eval(checks[key]["CHECK"], {"v": {"value": value}}), key
        assert not eval(checks[key]["CHECK"], {"v": {"value": value * 1.5}}), key
    path = _pkg() / "rcp_checker" / f"training_{ruleset(name)}" / f"rcps_{name}.json"
    rcps = {r["BS"]: r[spec.rcp_key] for r in json.loads(path.read_text()).values()}
    gbs_range = spec.rule(GbsRange)
    assert (min(rcps), max(rcps)) == (gbs_range.low, gbs_range.high)
    if name == "gpt_oss_20b":
        assert checks["max_steps"]["CHECK"].strip() == f"v['value'] == {spec.rule(Steps, 'decay').steps}"
        # Every converged count is a whole number of evaluations.
        assert all(c % spec.eval_every_sequences == 0 for conv in rcps.values() for c in conv)
        return
    warmup, total = spec.rule(Steps, "warmup").steps, spec.rule(Steps, "decay").steps
    assert checks["moe_aux_loss_coeff"]["CHECK"].strip() == f"v['value'] == {spec.required('model.moe.aux_loss_coef')}"
    assert checks["opt_learning_rate_warmup_steps"]["CHECK"].strip() == f"v['value'] == {warmup}"
    s = {"opt_learning_rate_warmup_steps": 4}
    assert eval(checks["opt_learning_rate_decay_steps"]["CHECK"], {"v": {"value": total - 4}, "s": s})
    assert eval(checks["global_batch_size"]["CHECK"], {"v": {"value": gbs_range.low}})
    assert not eval(checks["global_batch_size"]["CHECK"], {"v": {"value": gbs_range.low - 1}})
    for gbs in (15360, 16384, 18432, 32768):
        lr = spec.rule(LrSqrt).at(gbs)
        assert eval(checks["opt_base_learning_rate"]["CHECK"], {"v": {"value": lr}, "s": {"global_batch_size": gbs}})
        # The registry's skip puts the first evaluation (every step at GBS >= 15,360) where FIRST_CHECK wants it.
        meta = {"metadata": {"samples_count": (spec.skipped_evals(gbs) + 1) * gbs}}
        assert eval(checks["eval_accuracy"]["FIRST_CHECK"], {"v": meta, "s": {"global_batch_size": gbs}, "math": math})
        assert math.ceil(spec.eval_every_sequences / gbs) == 1
    assert spec.skipped_evals(32) == 0  # a proxy's GBS: the rule is the legal batch sizes'
    # The RCPs' converged counts are whole steps (an evaluation every step) after the first evaluation.
    assert all(c % bs == 0 and c // bs > spec.skipped_evals(bs) for bs, conv in rcps.items() for c in conv)


@pytest.mark.parametrize("name", list(RULES))
def test_presets_are_the_official_configs(name):
    cfg = _config(name)
    assert official_rule_violations(cfg) == []
    assert cfg.bench.benchmark == name and cfg.bench.runs == benchmarks.get(name).runs
    assert benchmarks.get(name).default_gbs == cfg.train.global_batch_size


@pytest.mark.parametrize(
    "name,gbs", [("gpt_oss_20b", None), ("gpt_oss_20b", 48), ("deepseekv3_671b", None), ("deepseekv3_671b", 15360)]
)
def test_official_log_passes_the_checker(tmp_path, name, gbs):
    cfg = _config(name, gbs)
    t = cfg.train.target_eval_loss
    result, _ = scripted_run(cfg, tmp_path, [t + 0.2, t - 0.01], dp_size=8, platform="8xTEST", eval_samples=1024)
    assert result["status"] == "success" and result["rule_violations"] == []
    events = read_mllog(tmp_path / "mllog.txt")
    init = {e["key"]: e["value"] for e in events}
    g = cfg.train.global_batch_size
    every = math.ceil(benchmarks.get(name).eval_every_sequences / g)
    first = benchmarks.get(name).skipped_evals(g) + 1
    evals = [e["metadata"]["samples_count"] for e in events if e["key"] == "eval_accuracy"]
    assert evals == [k * every * g for k in (first, first + 1)] and init["train_samples"] == evals[-1]
    if name == "deepseekv3_671b":
        assert init["moe_aux_loss_coeff"] == 0.01 and init["max_steps"] == 12000 and evals[0] == 43 * g
    else:
        assert init["max_steps"] == 1_200_000 and init["submission_benchmark"] == "gpt_oss_20b"
    check = check_log(tmp_path / "mllog.txt", name)
    assert check.ok, check.output
    assert f"training_6.1.0/closed_{name}.yaml" in check.output


@pytest.mark.parametrize(
    "name,overrides,config_field,log_key",
    [
        ("deepseekv3_671b", ["model.moe.aux_loss_coef=0.001"], "model.moe.aux_loss_coef", "moe_aux_loss_coeff"),
        ("deepseekv3_671b", ["optim.lr=2e-5"], "optim.lr", "opt_base_learning_rate"),
        ("deepseekv3_671b", ["optim.warmup_samples=131072"], "optim.warmup_samples", "opt_learning_rate_warmup_steps"),
        ("gpt_oss_20b", ["optim.decay_samples=38400000"], "optim.decay_samples", "max_steps"),  # GBS 32's
    ],
    ids=["dsv3-aux-coeff", "dsv3-lr", "dsv3-warmup", "gpt-oss-max-steps"],
)
def test_a_planted_rule_break_fails_the_checker(tmp_path, name, overrides, config_field, log_key):
    cfg = resolve(PRESET[name], overrides=overrides)
    t = cfg.train.target_eval_loss
    result, _ = scripted_run(cfg, tmp_path, [t - 0.01], dp_size=8, platform="8xTEST", eval_samples=1024)
    found = result["rule_violations"]
    assert len(found) == 1 and found[0].startswith(config_field + "="), found
    check = check_log(tmp_path / "mllog.txt", name)
    assert not check.ok and log_key in check.output, check.output


def test_a_log_evaluating_from_the_first_step_fails_deepseek_6_1(tmp_path):
    # Without the skip (6.0.0's cadence) the first evaluation is at step 1: 6.1.0's FIRST_CHECK refuses it.
    from dataclasses import replace

    cfg = _config("deepseekv3_671b")
    spec = replace(benchmarks.DEEPSEEKV3_671B, eval_skip_samples=0, eval_skip_offset=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(benchmarks.BENCHMARKS, "deepseekv3_671b", spec)
        scripted_run(cfg, tmp_path, [3.5], dp_size=8, platform="8xTEST", eval_samples=1024)
    check = check_log(tmp_path / "mllog.txt", "deepseekv3_671b")
    assert not check.ok and "eval_accuracy" in check.output, check.output
    assert check_log(tmp_path / "mllog.txt", "deepseekv3_671b", rules="6.0.0").ok


@pytest.mark.parametrize(
    "name,gbs,evals",
    [("deepseekv3_671b", 16384, [5, 4, 5]), ("gpt_oss_20b", 24, [19] * 10)],
    ids=["dsv3-16384", "gpt-oss-24"],
)
def test_scripted_submission_passes_the_rcp_checker(tmp_path, name, gbs, evals):
    cfg = _config(name, gbs)
    assert len(evals) == cfg.bench.runs
    logs = scripted_submission(cfg, tmp_path, evals, dp_size=8, platform="8xTEST", eval_samples=1024)
    rcp = check_rcp(logs, name)
    assert rcp.ok and "RCP test PASSED" in rcp.output, rcp.output


def test_expert_parallel_degree_is_disclosed():
    cfg = _config("deepseekv3_671b", None, "parallel.ep=8")
    logged = dict(mllog_hparams(cfg, 1024, "64xTEST", dp_size=64))
    assert logged["expert_parallelism"] == 8 and logged["moe_aux_loss_coeff"] == 0.01
    assert dict(mllog_hparams(_config("gpt_oss_20b"), 1024, "8xTEST", dp_size=8))["expert_parallelism"] == 1
