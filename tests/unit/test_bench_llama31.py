"""llama31_405b and llama31_8b: the registry and rules constants agree with the installed mlperf-logging's rules files,
RCP tables and benchmark metadata; scripted logs at the official configs pass the compliance checker and the RCP
checker (an RCP batch size and interpolated ones); planted rule breaks fail them (~12 checker calls, ~1-3 s each)."""

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
from scaletrain.benchmarks import GbsRange, LrLinear, Steps
from scaletrain.config import resolve

yaml = pytest.importorskip("yaml")
pytest.importorskip("mlperf_logging")

RULES = {name: benchmarks.get(name) for name in ("llama31_405b", "llama31_8b")}
PRESET = {"llama31_405b": "llama31-405b", "llama31_8b": "llama31-8b"}


def _pkg() -> Path:
    import mlperf_logging

    return Path(mlperf_logging.__file__).parent


def _checks(name: str, rules: str) -> dict[str, dict]:
    """closed_<name>.yaml of ruleset `rules` as {key: its KEY entry}."""
    path = _pkg() / "compliance_checker" / f"training_{rules}" / f"closed_{name}.yaml"
    return {e["KEY"]["NAME"]: e["KEY"] for e in yaml.safe_load(path.read_text())}


def _rcps(name: str, rules: str) -> dict[int, list[int]]:
    path = _pkg() / "rcp_checker" / f"training_{rules}" / f"rcps_{name}.json"
    return {r["BS"]: r[benchmarks.get(name).rcp_key] for r in json.loads(path.read_text()).values()}


def _config(name: str, gbs: int | None = None, *overrides: str):
    """The official config (the reference preset), at `gbs` with the LR, warm-up and decay the rules want there."""
    ov = []
    if gbs is not None:
        ov.append(f"train.global_batch_size={gbs}")
        if name == "llama31_405b":
            ov.append(f"optim.lr={RULES[name].rule(LrLinear).at(gbs)!r}")
        else:
            ov.append(f"optim.decay_samples={RULES[name].rule(Steps, 'decay').steps * gbs}")
    return resolve(PRESET[name], overrides=[*ov, *overrides])


def _eval_samples(name: str) -> int:
    spec = RULES[name]
    return spec.eval_tokens // spec.seq_len


def test_rulesets_are_the_newest_the_package_ships():
    assert benchmarks.package_rulesets("llama31_405b") == ("5.0.0", "5.1.0", "6.0.0")  # retired in 6.1.0
    assert benchmarks.package_rulesets("llama31_8b") == ("5.1.0", "6.0.0", "6.1.0")
    assert ruleset("llama31_405b") == "6.0.0" and ruleset("llama31_8b") == "6.1.0"
    assert ruleset("llama31_405b", "5.1.0") == "5.1.0"
    # A proxy's rules file is built from its benchmark's default ruleset, and is judged by it.
    assert ruleset("llama31_405b-proxy") == "6.0.0" and ruleset("llama31_8b-proxy") == "6.1.0"


@pytest.mark.parametrize("name", list(RULES))
def test_constants_are_the_packages(name):
    spec = RULES[name]
    rules = ruleset(name)
    checks = _checks(name, rules)
    assert checks["max_sequence_length"]["CHECK"].strip() == f"v['value'] == {spec.seq_len}"
    assert checks["eval_samples"]["CHECK"].strip() == f"v['value'] == {_eval_samples(name)}"
    assert spec.eval_tokens == _eval_samples(name) * spec.seq_len
    assert f"v['value'] <= {spec.target}" in checks["eval_accuracy"]["ATLEAST_ONE_CHECK"]
    opt_name = dict(mllog_hparams(_config(name), 1, "8xTEST", dp_size=8))["opt_name"]
    assert checks["opt_name"]["CHECK"].strip() == f"v['value'] == '{opt_name}'"
    for key, value in (
        ("opt_adamw_beta_1", spec.required("optim.beta1")),
        ("opt_adamw_beta_2", spec.required("optim.beta2")),
        ("opt_adamw_epsilon", spec.required("optim.eps")),
        ("opt_adamw_weight_decay", spec.required("optim.weight_decay")),
        ("opt_gradient_clip_norm", spec.required("optim.grad_clip")),
    ):
        assert eval(checks[key]["CHECK"], {"v": {"value": value}}), key
        assert not eval(checks[key]["CHECK"], {"v": {"value": value * 1.5}}), key
    if name == "llama31_405b":
        assert checks["init_checkpoint_step"]["CHECK"].strip() == "v['value'] == 0"
        lr_check = checks["opt_base_learning_rate"]["CHECK"]
        decay_check = checks["opt_learning_rate_decay_steps"]["CHECK"]
        lr, warmup, total = spec.rule(LrLinear), spec.rule(Steps, "warmup"), spec.rule(Steps, "decay")
        for gbs in (1152, 1728, 2304, 4608, 9216):
            s = {"global_batch_size": gbs}
            assert eval(lr_check, {"v": {"value": lr.at(gbs)}, "s": s})
            assert not eval(lr_check, {"v": {"value": lr.at(1152)}, "s": s}) or gbs == 1152
            post = {"s": dict(s), "math": math}
            exec(checks["opt_learning_rate_warmup_steps"]["POST"], post)
            assert post["s"]["opt_learning_rate_warmup_steps"] == warmup.at(gbs)
            v = {"value": total.at(gbs) - warmup.at(gbs)}
            assert eval(decay_check, {"v": v, "s": post["s"], "math": math})
    else:
        max_steps = spec.rule(Steps, "decay").steps
        assert checks["max_steps"]["CHECK"].strip() == f"v['value'] == {max_steps}"
        s = {"opt_learning_rate_warmup_steps": 96}
        assert eval(checks["opt_learning_rate_decay_steps"]["CHECK"], {"v": {"value": max_steps - 96}, "s": s})
    # Runs per submission, RCP batch sizes, and the eval cadence the RCPs' granularity shows.
    from mlperf_logging.benchmark_meta import _ALL_RESULT_FILE_COUNTS

    assert _ALL_RESULT_FILE_COUNTS["training"][name] == spec.runs
    rcps = _rcps(name, rules)
    assert (min(rcps), max(rcps)) == (spec.rule(GbsRange).low, spec.rule(GbsRange).high)
    off_grid = {bs for bs, conv in rcps.items() if any(c % spec.eval_every_sequences for c in conv)}
    assert off_grid == (set() if name == "llama31_405b" else {96})  # 8B's GBS-96 reference evaluated every 129 steps


@pytest.mark.parametrize("name", list(RULES))
def test_presets_are_the_official_configs(name):
    cfg = _config(name)
    assert official_rule_violations(cfg) == []
    assert cfg.bench.benchmark == name and cfg.bench.runs == benchmarks.get(name).runs
    assert benchmarks.get(name).default_gbs == cfg.train.global_batch_size


@pytest.mark.parametrize(
    "name,gbs",
    [("llama31_405b", None), ("llama31_405b", 3456), ("llama31_8b", None), ("llama31_8b", 48)],
    ids=["405b-1152", "405b-3456", "8b-64", "8b-48"],
)
def test_official_log_passes_the_checker(tmp_path, name, gbs):
    cfg = _config(name, gbs)
    target = cfg.train.target_eval_loss
    result, _ = scripted_run(
        cfg, tmp_path, [target + 0.2, target - 0.01], dp_size=8, platform="8xTEST", eval_samples=_eval_samples(name)
    )
    assert result["status"] == "success" and result["rule_violations"] == []
    events = read_mllog(tmp_path / "mllog.txt")
    init = {e["key"]: e["value"] for e in events}
    g = cfg.train.global_batch_size
    assert (
        init["eval_samples"] == _eval_samples(name)
        and init["train_samples"] == 2 * math.ceil(benchmarks.get(name).eval_every_sequences / g) * g
    )
    assert init["opt_learning_rate_warmup_steps"] + init["opt_learning_rate_decay_steps"] == (
        RULES[name].rule(Steps, "decay").at(g)
    )
    evals = [e for e in events if e["key"] == "eval_accuracy"]
    assert [e["metadata"]["samples_count"] for e in evals] == [
        k * math.ceil(benchmarks.get(name).eval_every_sequences / g) * g for k in (1, 2)
    ]
    check = check_log(tmp_path / "mllog.txt", name)
    assert check.ok, check.output
    assert f"training_{ruleset(name)}/closed_{name}.yaml" in check.output


def _drop(log: Path, key: str) -> None:
    log.write_text("".join(ln + "\n" for ln in log.read_text().splitlines() if f'"key": "{key}"' not in ln))


@pytest.mark.parametrize(
    "name,overrides,drop,config_field,log_key",
    [
        # 8e-5 is the LR of GBS 1152, not of 2304 (1.6e-4)
        (
            "llama31_405b",
            ["train.global_batch_size=2304", "optim.decay_samples=1382400000"],
            None,
            "optim.lr",
            "opt_base_learning_rate",
        ),
        (
            "llama31_405b",
            ["optim.warmup_samples=8000000"],
            None,
            "optim.warmup_samples",
            "opt_learning_rate_decay_steps",
        ),
        ("llama31_405b", ["optim.eps=1e-8"], None, "optim.eps", "opt_adamw_epsilon"),
        ("llama31_8b", ["optim.decay_samples=38400000"], None, "optim.decay_samples", "max_steps"),  # GBS 32's
        ("llama31_8b", [], "max_steps", None, "max_steps"),
        ("llama31_405b", [], "init_checkpoint_step", None, "init_checkpoint_step"),
    ],
    ids=["405b-lr-for-gbs", "405b-warmup", "405b-eps", "8b-max-steps", "8b-no-max-steps", "405b-no-init-ckpt"],
)
def test_a_planted_rule_break_fails_the_checker(tmp_path, name, overrides, drop, config_field, log_key):
    cfg = resolve(PRESET[name], overrides=overrides)
    t = cfg.train.target_eval_loss
    result, _ = scripted_run(cfg, tmp_path, [t - 0.01], dp_size=8, platform="8xTEST", eval_samples=_eval_samples(name))
    found = result["rule_violations"]
    if config_field is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(config_field + "="), found
    log = tmp_path / "mllog.txt"
    if drop:
        _drop(log, drop)
    check = check_log(log, name)
    assert not check.ok and log_key in check.output, check.output


@pytest.mark.parametrize(
    "name,gbs,evals,how",
    [
        ("llama31_405b", 1728, [17, 18, 19], "RCP Interpolation"),  # between GBS 1152 and 2304
        ("llama31_8b", 48, [15, 16, 16, 16, 17, 15, 16, 16, 17, 16], "RCP Interpolation"),  # between 32 and 64
    ],
    ids=["405b-1728", "8b-48"],  # at an RCP batch size: test_bench_runs_the_rcp_checker_over_a_complete_submission
)
def test_scripted_submission_passes_the_rcp_checker(tmp_path, name, gbs, evals, how):
    cfg = _config(name, gbs)
    assert len(evals) == cfg.bench.runs
    logs = scripted_submission(cfg, tmp_path, evals, dp_size=8, platform="8xTEST", eval_samples=_eval_samples(name))
    assert all(check_log(log, name).ok for log in logs[:1])
    rcp = check_rcp(logs, name)
    assert rcp.ok and f"{how}, RCP test PASSED" in rcp.output, rcp.output
    assert rcp.command[rcp.command.index("--rcp_version") + 1] == ruleset(name)


def test_proxies_have_no_rcps(tmp_path):
    # Converging too fast fails: test_bench_runs_the_rcp_checker_over_a_complete_submission[too-fast].
    with pytest.raises(ValueError, match="no reference convergence points"):
        check_rcp([tmp_path / "mllog.txt"], "gpt3-proxy")


# 16-18 evaluations = 294,912-331,776 samples at GBS 1152 (RCP mean 313,344): "RCP found", passed; 5-6 evaluations
# (92,160-110,592 samples) converge faster than the RCPs allow.
@pytest.mark.parametrize("evals,ok", [((16, 17, 18), True), ((5, 5, 6), False)], ids=["rcp-pass", "too-fast"])
def test_bench_runs_the_rcp_checker_over_a_complete_submission(tmp_path, evals, ok):
    import io

    from rich.console import Console

    from scaletrain.bench.harness import run_benchmark
    from scaletrain.bench.run import bench_exit_code
    from scaletrain.bench.scripted import ScriptedEngine

    cfg = _config("llama31_405b")
    t = cfg.train.target_eval_loss
    seeds = [cfg.train.seed + 1000 * i for i in range(3)]

    def engine(c, seed, run_dir):  # run i reaches the target at its evals[i]-th evaluation
        k = evals[seeds.index(seed)]
        return ScriptedEngine(c, eval_losses=[t + 0.1] * (k - 1) + [t - 0.01], eval_samples=5760)

    console = Console(file=io.StringIO(), width=200)
    summary = run_benchmark(cfg, engine, tmp_path, console=console, platform="8xTEST")
    assert summary["n_converged"] == 3 and summary["compliant_all"] and summary["rcp_ok"] is ok
    assert ("RCP found, RCP test PASSED" if ok else "RCP test FAILED") in (tmp_path / "rcp_checker.txt").read_text()
    assert bench_exit_code(summary) == (0 if ok else 1)
    assert ("RCP check: pass" if ok else "RCP check: FAIL") in console.file.getvalue()
