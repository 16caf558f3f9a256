"""llama2_70b_lora: the harness's sample-counted protocol with skipped first evaluations, its init keys, the official
ruleset (the newest the package ships) judging a scripted run at the real hyperparameters, the proxy rules file, and 10-run scoring."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from scaletrain import benchmarks
from scaletrain.bench.checker import check_log, known, proxy_rules_path
from scaletrain.bench.closed import official_rule_violations
from scaletrain.bench.harness import run_benchmark
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.rules import mllog_hparams
from scaletrain.bench.score import olympic_score, required_runs
from scaletrain.bench.scripted import ScriptedEngine, lora_reference_config, scripted_run
from scaletrain.sim.mlperf import convergence

# Evaluations at GBS 8 fall every 48 steps = 384 samples; 3 are skipped, so the first is at 1536 samples and a run
# converging at 3072 (the RCP's most common value) runs 5 of them.
REAL_LOSSES = [0.95, 0.94, 0.935, 0.93, 0.924]
LORA_KEYS = ["lora_rank", "lora_alpha", "opt_adamw_weight_decay", "opt_learning_rate_training_steps"]
POINT_KEYS = ("block_start", "block_stop", "eval_start", "eval_accuracy", "eval_stop", "run_stop")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The official configuration (GBS 8, seq 8192, r16/alpha 32, lr 4e-4, wd 1e-4, clip 0.3), 8-way DP."""
    cfg = lora_reference_config()
    run_dir = tmp_path_factory.mktemp("lora_real")
    result, engine = scripted_run(cfg, run_dir, REAL_LOSSES, dp_size=8, platform="8xTEST")
    return cfg, engine, run_dir, result


def _drop_key(src: Path, dst: Path, key: str) -> Path:
    lines = src.read_text().splitlines()
    kept = [ln for ln in lines if f'"key": "{key}"' not in ln]
    assert len(kept) == len(lines) - 1, key
    dst.write_text("\n".join(kept) + "\n")
    return dst


def test_real_run_stops_at_3072_samples_after_five_evaluations(real_run):
    cfg, engine, _, result = real_run
    assert official_rule_violations(cfg) == []
    assert result["status"] == "success" and result["steps"] == 384 and result["samples"] == 3072
    assert result["tokens"] == 3072 * 8192 and result["skipped_evals"] == 3
    assert [e["samples"] for e in result["evals"]] == [1536, 1920, 2304, 2688, 3072]
    assert engine.calls.count("evaluate") == 5 and engine.calls.count("train_step") == 384
    # The cluster model predicts the same stopping point for the same convergence.
    conv = convergence("llama2_70b_lora", 8, 3072)
    assert (conv.steps, conv.evals) == (result["steps"], len(result["evals"]))


def test_real_log_passes_the_official_checker(real_run):
    _, _, run_dir, _ = real_run
    check = check_log(run_dir / "mllog.txt", "llama2_70b_lora")
    assert check.ok, check.output
    newest = benchmarks.package_rulesets("llama2_70b_lora")[-1]
    assert check.command[check.command.index("--ruleset") + 1] == newest
    assert tuple(map(int, newest.split("."))) >= (6, 1, 0)
    assert "--werror" in check.command and "--config" not in check.command
    assert f"training_{newest}/closed_llama2_70b_lora.yaml" in check.output


def test_real_log_init_keys_and_values(real_run):
    _, _, run_dir, _ = real_run
    ev = read_mllog(run_dir / "mllog.txt")
    init = {e["key"]: e["value"] for e in ev[: [e["key"] for e in ev].index("init_stop")]}
    assert init["submission_benchmark"] == "llama2_70b_lora" and init["global_batch_size"] == 8
    assert init["max_sequence_length"] == 8192 and init["gradient_accumulation_steps"] == 1
    assert (init["lora_rank"], init["lora_alpha"]) == (16, 32)
    assert init["opt_base_learning_rate"] == 4e-4 and init["opt_adamw_weight_decay"] == 1e-4
    assert init["opt_gradient_clip_norm"] == 0.3 and init["opt_learning_rate_training_steps"] == 1024
    assert (init["train_samples"], init["eval_samples"]) == (3901, 173) and init["seed"] == 1234
    assert [e["key"] for e in ev].count("train_samples") == 1  # at init only, not again at run end


def test_samples_count_metadata_and_no_epoch_num(real_run):
    _, _, run_dir, _ = real_run
    ev = read_mllog(run_dir / "mllog.txt")
    timed = [e for e in ev if e["key"] in POINT_KEYS]
    assert timed and all("samples_count" in e["metadata"] for e in timed)
    assert not any(k in e["metadata"] for e in ev for k in ("epoch_num", "first_epoch_num", "epoch_count"))
    starts = [e["metadata"]["samples_count"] for e in ev if e["key"] == "block_start"]
    stops = [e["metadata"]["samples_count"] for e in ev if e["key"] == "block_stop"]
    assert starts == [0, 1536, 1920, 2304, 2688] and stops == [1536, 1920, 2304, 2688, 3072]
    assert ev[-1]["key"] == "run_stop" and ev[-1]["metadata"]["samples_count"] == 3072


@pytest.mark.parametrize("key", LORA_KEYS)
def test_official_checker_fails_without_a_required_lora_key(real_run, tmp_path, key):
    _, _, run_dir, _ = real_run
    check = check_log(_drop_key(run_dir / "mllog.txt", tmp_path / "bad.txt", key), "llama2_70b_lora")
    assert not check.ok and key in check.output


def test_official_checker_fails_on_a_missed_target_or_wrong_rank(tmp_path):
    cfg = lora_reference_config("train.max_steps=240", "lora.rank=8")
    result, _ = scripted_run(cfg, tmp_path, [0.95], dp_size=8, platform="8xTEST")
    assert result["status"] == "aborted" and "step budget" in result["reason"]
    check = check_log(tmp_path / "mllog.txt", "llama2_70b_lora")
    assert not check.ok and "0.925" in check.output and "lora_rank" in check.output


def test_harness_cadence_at_gbs_16(tmp_path):
    cfg = lora_reference_config("train.global_batch_size=16")
    result, engine = scripted_run(cfg, tmp_path, [0.96, 0.93, 0.92], platform="1xTEST")
    assert [e["samples"] for e in result["evals"]] == [1920, 2304, 2688] and result["steps"] == 168
    evals = [e["metadata"]["samples_count"] for e in read_mllog(tmp_path / "mllog.txt") if e["key"] == "eval_stop"]
    assert evals == [1920, 2304, 2688] and engine.calls.count("evaluate") == 3
    hp = dict(mllog_hparams(cfg, 173, "x", train_samples=3901))
    assert hp["gradient_accumulation_steps"] == 16 and hp["opt_learning_rate_training_steps"] == 512


def test_non_finite_loss_counts_the_samples_trained(tmp_path):
    cfg = lora_reference_config()
    result, _ = scripted_run(cfg, tmp_path, [0.95], nan_at_step=200, platform="1xTEST")
    assert result["status"] == "aborted" and result["steps"] == 199 and result["samples"] == 199 * 8
    ev = read_mllog(tmp_path / "mllog.txt")
    stops = [e["metadata"]["samples_count"] for e in ev if e["key"] == "block_stop"]
    assert stops == [1536, 199 * 8] and ev[-1]["metadata"]["status"] == "aborted"


def test_hparams_need_the_training_set_size_and_engine_must_report_it(tmp_path):
    cfg = lora_reference_config()
    with pytest.raises(ValueError, match="train_samples"):
        mllog_hparams(cfg, 173, "x")
    engine = ScriptedEngine(cfg)
    engine.train_samples = None
    with pytest.raises(ValueError, match="train_samples"):
        from scaletrain.bench.harness import run_once

        run_once(cfg, engine, tmp_path)


def test_violations_flag_the_fixed_hyperparameters():
    found = official_rule_violations(
        lora_reference_config(
            "optim.grad_clip=1.0", "lora.alpha=16", "model.seq_len=4096", "train.global_batch_size=256"
        )
    )
    assert len(found) == 4
    for field in ("optim.grad_clip", "lora.alpha", "model.seq_len", "train.global_batch_size"):
        assert any(field in v for v in found), field
    assert (
        official_rule_violations(lora_reference_config("bench.benchmark=llama2_70b_lora-proxy", "model.seq_len=256"))
        == []
    )


def test_olympic_score_of_ten_runs():
    assert required_runs("llama2_70b_lora") == required_runs("llama2_70b_lora-proxy") == 10
    assert required_runs("gpt3") == 3
    times = [130.0, 100.0, 120.0, 110.0, 90.0, 150.0, 140.0, 105.0, 115.0, 125.0]
    s = olympic_score([(t, True) for t in times])
    assert s.dropped == [4, 5] and s.score_s == pytest.approx(945.0 / 8)  # 90 and 150 dropped
    # One non-converged run (here the fastest on the clock) counts as the slowest: 150 stays in the mean.
    s = olympic_score([(t, i != 1) for i, t in enumerate(times)])
    assert s.dropped == [1, 4] and s.n_converged == 9 and s.score_s == pytest.approx(995.0 / 8)
    assert olympic_score([(t, i not in (1, 2)) for i, t in enumerate(times)]).score_s is None


def _proxy_cfg(*overrides):
    # Proxy shape: seq 256, a target the scripted losses reach; the real lora rank and cadence are kept.
    return lora_reference_config(
        "bench.benchmark=llama2_70b_lora-proxy", "model.seq_len=256", "train.target_eval_loss=2.5", *overrides
    )


def test_proxy_log_passes_the_proxy_rules_only(tmp_path):
    cfg = _proxy_cfg()
    result, _ = scripted_run(cfg, tmp_path, [3.0, 2.7, 2.4], platform="1xCPU")
    assert result["status"] == "success" and [e["samples"] for e in result["evals"]] == [1536, 1920, 2304]
    check = check_log(tmp_path / "mllog.txt", "llama2_70b_lora-proxy")
    assert check.ok, check.output
    assert "--config" in check.command and check.command[check.command.index("--config") + 1].endswith(
        "llama2_70b_lora_proxy.yaml"
    )
    official = check_log(tmp_path / "mllog.txt", "llama2_70b_lora")
    assert not official.ok and "0.925" in official.output  # the target window is size-bound: proxy only


def test_ten_proxy_runs_are_scored(tmp_path):
    cfg = _proxy_cfg("bench.runs=10", "bench.check=false")
    summary = run_benchmark(
        cfg,
        lambda c, seed, d: ScriptedEngine(c, eval_losses=[2.4]),
        tmp_path,
        console=Console(file=io.StringIO(), width=160),
    )
    assert summary["n_runs"] == summary["runs_required"] == 10 and summary["n_converged"] == 10
    assert len(summary["dropped"]) == 2 and summary["score_s"] is not None
    assert {r["samples"] for r in summary["runs"]} == {1536}


def _records(text: str) -> dict[str, dict]:
    return {r["KEY"]["NAME"]: r["KEY"] for r in yaml.load(text, Loader=yaml.BaseLoader) if "KEY" in r}


def test_proxy_rules_keep_every_official_requirement():
    import mlperf_logging.compliance_checker as cc

    # The proxy rules are built from the ruleset a proxy run resolves to by default: the newest the package ships.
    official_dir = Path(cc.__file__).parent / f"training_{benchmarks.resolve_ruleset('llama2_70b_lora-proxy')}"
    official = {}
    # The order the checker runs them in; a later file's record for a key replaces the earlier ones' verdicts.
    for name in ("common.yaml", "closed_common.yaml", "closed_llama2_70b_lora.yaml"):
        official.update(_records((official_dir / name).read_text()))
    text = proxy_rules_path("llama2_70b_lora-proxy").read_text()
    proxy = _records(text)
    relaxed = {"submission_division", "submission_benchmark", "eval_accuracy"}
    for key, rec in official.items():
        assert key in proxy, key
        assert proxy[key].get("REQ") == rec.get("REQ"), key
        if key not in relaxed:
            assert proxy[key] == rec, f"{key}: the proxy must copy the official rule verbatim"
    assert set(proxy) - set(official) == {"seed"} and proxy["seed"]["REQ"] == "EXACTLY_ONE"
    assert "ATLEAST_ONE_CHECK" not in proxy["eval_accuracy"]
    assert "'samples_count' in v['metadata']" in proxy["eval_accuracy"]["CHECK"]
    assert proxy["lora_rank"]["CHECK"].strip() == "v['value'] == 16"
    assert "enqueue_config" not in text.split("\n- BEGIN")[1]
    assert {n for n in known() if n.endswith("-proxy")} == {
        s.proxy_name for s in benchmarks.BENCHMARKS.values() if s.has_proxy
    }
