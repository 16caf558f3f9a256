"""The gpt_oss_20b and deepseekv3_671b CPU proxies: their rules files keep every official record but the size-bound
ones, their presets keep the architecture and the fixed recipe, scripted logs pass the proxy rules (and fail the
official ones on the size-bound keys), and planted breaks (a wrong auxiliary loss coefficient among them) fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain import benchmarks
from scaletrain.bench.checker import check_log, known, proxy_rules_path
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.scripted import scripted_run
from scaletrain.benchmarks import LrSqrt, Steps
from scaletrain.config import resolve

yaml = pytest.importorskip("yaml")
pytest.importorskip("mlperf_logging")

PROXY = {"gpt_oss_20b": "gpt_oss_20b-proxy", "deepseekv3_671b": "deepseekv3_671b-proxy"}
PRESET = {"gpt_oss_20b": "gpt-oss-20b-proxy", "deepseekv3_671b": "deepseek-v3-671b-proxy"}
# deepseekv3_671b-proxy's form of the LR rule (bench/rules/deepseekv3_671b_proxy.yaml): 3e-3 * sqrt(GBS / 32). The
# warm-up (4 steps), the cosine's end (step 12,000) and the auxiliary loss coefficient are the official ones.
PROXY_LR = LrSqrt(base_lr=3e-3, base_gbs=32)
# Official keys whose record the proxy replaces (size-bound), besides the two that would enqueue official files.
RELAXED = {
    "gpt_oss_20b": {
        "max_sequence_length",
        "eval_samples",
        "eval_accuracy",
        "opt_learning_rate_decay_steps",
        "max_steps",
    },
    "deepseekv3_671b": {
        "global_batch_size",
        "max_sequence_length",
        "eval_samples",
        "eval_accuracy",
        "opt_base_learning_rate",
    },
}


def _records(text: str) -> dict[str, dict]:
    return {r["KEY"]["NAME"]: r["KEY"] for r in yaml.load(text, Loader=yaml.BaseLoader) if "KEY" in r}


@pytest.mark.parametrize("name", sorted(PROXY))
def test_proxy_rules_keep_every_other_official_requirement(name):
    import mlperf_logging.compliance_checker as cc

    proxy_name = PROXY[name]
    rules = benchmarks.resolve_ruleset(proxy_name)
    assert rules == benchmarks.resolve_ruleset(name) == "6.1.0"
    official: dict[str, dict] = {}
    for f in ("common.yaml", "closed_common.yaml", f"closed_{name}.yaml"):  # the checker's order; later files win
        official.update(_records((Path(cc.__file__).parent / f"training_{rules}" / f).read_text()))
    text = proxy_rules_path(proxy_name).read_text()
    proxy = _records(text)
    relaxed = RELAXED[name] | {"submission_division", "submission_benchmark"}
    for key, rec in official.items():
        assert key in proxy, key
        assert proxy[key].get("REQ") == rec.get("REQ"), key
        if key not in relaxed:
            assert proxy[key] == rec, f"{key}: the proxy must copy the official rule verbatim"
    assert set(proxy) - set(official) == {"seed"}
    assert "ATLEAST_ONE_CHECK" not in proxy["eval_accuracy"] and "FIRST_CHECK" not in proxy["eval_accuracy"]
    assert "enqueue_config" not in text
    assert proxy["submission_benchmark"]["CHECK"].strip() == f"v['value'] == '{name}'"
    assert proxy_name in known() and proxy_name in benchmarks.names()
    if name == "deepseekv3_671b":
        assert proxy["moe_aux_loss_coeff"]["CHECK"].strip() == "v['value'] == 0.01"
        assert PROXY_LR.base_lr == 3e-3
        lr_check = proxy["opt_base_learning_rate"]["CHECK"]
        assert f"3e-3 * (s['global_batch_size'] / {PROXY_LR.base_gbs}) ** 0.5" in lr_check


def _recipe(spec) -> tuple:
    return tuple(
        spec.required(f) for f in ("optim.beta1", "optim.beta2", "optim.eps", "optim.weight_decay", "optim.grad_clip")
    )


def test_gpt_oss_proxy_keeps_the_architecture_and_recipe():
    cfg = resolve("gpt-oss-20b-proxy")
    m, o = cfg.model, cfg.optim
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip) == _recipe(benchmarks.GPT_OSS_20B)
    assert m.arch == "gpt_oss" and m.attn_sinks and m.sliding_window > 0 and m.swiglu_limit > 0
    assert m.rope_scaling == "yarn" and m.moe.router_bias and m.moe.score_func == "softmax"
    assert m.moe.n_experts > m.moe.top_k > 1 and cfg.data.default_tokenizer == "bpe"
    assert cfg.bench.runs == benchmarks.GPT_OSS_20B.runs and o.checkpoint_samples == 0
    assert not benchmarks.GPT_OSS_20B.proxy_needs_base


def test_deepseek_proxy_keeps_the_architecture_and_recipe():
    cfg = resolve("deepseek-v3-671b-proxy")
    m, o, R, gbs = cfg.model, cfg.optim, benchmarks.DEEPSEEKV3_671B, cfg.train.global_batch_size
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip) == _recipe(R)
    assert m.arch == "deepseek_v3" and m.mla.kv_lora_rank > 0 and m.mla.q_lora_rank > 0 and m.mla.qk_rope_head_dim > 0
    mo = m.moe
    assert mo.first_dense == 1 and mo.n_shared == 1 and mo.score_func == "sigmoid" and mo.topk_groups < mo.n_groups
    assert mo.aux_loss_coef == R.required("model.moe.aux_loss_coef") and mo.bias_update_rate > 0
    assert abs(o.lr - PROXY_LR.at(gbs)) < 1e-9
    assert (o.warmup_steps(gbs), o.decay_steps(gbs)) == (R.rule(Steps, "warmup").steps, R.rule(Steps, "decay").steps)
    assert cfg.bench.runs == benchmarks.DEEPSEEKV3_671B.runs and o.checkpoint_samples == 0
    assert benchmarks.DEEPSEEKV3_671B.skipped_evals(gbs) == 0  # the proxy evaluates from its first interval


def _proxy_config(name: str, *overrides: str):
    return resolve(PRESET[name], overrides=["train.target_eval_loss=3.0", "train.micro_batch_size=16", *overrides])


@pytest.mark.parametrize("name,gbs", [("gpt_oss_20b", 32), ("deepseekv3_671b", 64)])
def test_scripted_proxy_log_passes_the_proxy_rules_only(tmp_path, name, gbs):
    ov = [f"train.global_batch_size={gbs}", f"optim.warmup_samples={4 * gbs}", f"optim.decay_samples={12000 * gbs}"]
    if name == "deepseekv3_671b":
        ov.append(f"optim.lr={PROXY_LR.at(gbs)!r}")
    cfg = _proxy_config(name, *ov)
    result, _ = scripted_run(cfg, tmp_path, [3.4, 2.9], platform="1xCPU", eval_samples=97)
    assert result["status"] == "success"
    init = {e["key"]: e["value"] for e in read_mllog(tmp_path / "mllog.txt")}
    assert init["max_sequence_length"] == 256 and init["eval_samples"] == 97 and init["global_batch_size"] == gbs
    assert init["submission_benchmark"] == name
    check = check_log(tmp_path / "mllog.txt", PROXY[name])
    assert check.ok, check.output
    official = check_log(tmp_path / "mllog.txt", name)
    assert not official.ok and "max_sequence_length" in official.output


@pytest.mark.parametrize(
    "name,overrides,log_key",
    [
        ("deepseekv3_671b", ["model.moe.aux_loss_coef=0.02"], "moe_aux_loss_coeff"),
        ("deepseekv3_671b", ["train.global_batch_size=64"], "opt_base_learning_rate"),  # LR not scaled with GBS
        ("deepseekv3_671b", ["optim.warmup_samples=256"], "opt_learning_rate_warmup_steps"),  # 8 warm-up steps
        ("gpt_oss_20b", ["optim.beta2=0.999"], "opt_adamw_beta_2"),
    ],
    ids=["dsv3-aux-coeff", "dsv3-lr", "dsv3-warmup", "gpt-oss-beta2"],
)
def test_planted_proxy_break_fails(tmp_path, name, overrides, log_key):
    cfg = _proxy_config(name, *overrides)
    scripted_run(cfg, tmp_path, [2.9], platform="1xCPU", eval_samples=97)
    check = check_log(tmp_path / "mllog.txt", PROXY[name])
    assert not check.ok and log_key in check.output, check.output
