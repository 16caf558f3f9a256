"""The llama31_8b and llama31_405b CPU proxies: their rules files keep every official record but the size-bound ones,
their presets follow the proxy form of the rules, scripted logs pass the proxy rules (and fail the official ones on
the size-bound keys only), and planted schedule breaks fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain import benchmarks
from scaletrain.bench.checker import check_log, known, proxy_rules_path
from scaletrain.bench.mllog import read_mllog
from scaletrain.bench.scripted import scripted_run
from scaletrain.benchmarks import LrLinear, Steps
from scaletrain.config import resolve

yaml = pytest.importorskip("yaml")
pytest.importorskip("mlperf_logging")

PROXY = {"llama31_8b": "llama31_8b-proxy", "llama31_405b": "llama31_405b-proxy"}
# Official keys whose record the proxy replaces (size-bound), besides the two that would enqueue official files.
RELAXED = {
    "llama31_8b": {
        "max_sequence_length",
        "eval_samples",
        "eval_accuracy",
        "opt_learning_rate_decay_steps",
        "max_steps",
    },
    "llama31_405b": {
        "max_sequence_length",
        "eval_samples",
        "eval_accuracy",
        "opt_base_learning_rate",
        "opt_learning_rate_warmup_steps",
        "opt_learning_rate_decay_steps",
    },
}


def _records(text: str) -> dict[str, dict]:
    return {r["KEY"]["NAME"]: r["KEY"] for r in yaml.load(text, Loader=yaml.BaseLoader) if "KEY" in r}


@pytest.mark.parametrize("name", sorted(PROXY))
def test_proxy_rules_keep_every_other_official_requirement(name):
    import mlperf_logging.compliance_checker as cc

    proxy_name = PROXY[name]
    rules = benchmarks.resolve_ruleset(proxy_name)
    assert rules == benchmarks.resolve_ruleset(name)  # built from the official benchmark's default ruleset
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
    assert "ATLEAST_ONE_CHECK" not in proxy["eval_accuracy"] and "enqueue_config" not in text
    assert proxy["submission_benchmark"]["CHECK"].strip() == f"v['value'] == '{name}'"
    assert PROXY[name] in known()


# The 405B proxy's form of the official schedule rules (bench/rules/llama31_405b_proxy.yaml): the same formulas with
# the constants scaled to the CPU proxy. LR 2e-3 * GBS / 32, warm-up ceil(64 * 32 / GBS) steps, cosine to
# ceil(20000 * 32 / GBS) steps; at GBS 32 an evaluation every 16 steps, as 405B's every 18,432 samples at 1152.
PROXY_LR = LrLinear(base_lr=2e-3, base_gbs=32)
PROXY_WARMUP, PROXY_DECAY = Steps("warmup", 64, base_gbs=32), Steps("decay", 20_000, base_gbs=32)


def test_405b_proxy_preset_follows_the_proxy_schedule_rule():
    cfg = resolve("llama31-405b-proxy")
    R, o, gbs = PROXY_LR, cfg.optim, cfg.train.global_batch_size
    assert o.lr * R.base_gbs == gbs * R.base_lr
    assert o.warmup_steps(gbs) == PROXY_WARMUP.at(gbs)
    assert o.decay_steps(gbs) == PROXY_DECAY.at(gbs)
    # 405B evaluates every 16 steps at its base GBS (18,432 / 1152); the proxy does at its own.
    assert cfg.train.eval_interval_samples // gbs == benchmarks.LLAMA31_405B.eval_every_sequences // 1152
    text = proxy_rules_path("llama31_405b-proxy").read_text()
    assert f"v['value'] * {R.base_gbs} == s['global_batch_size'] * 2e-3" in text and R.base_lr == 2e-3
    assert f"math.ceil({PROXY_WARMUP.steps} * {PROXY_WARMUP.base_gbs} / s['global_batch_size'] )" in text
    assert benchmarks.get("llama31_405b-proxy").proxy_base_preset == "llama31-8b-proxy"


@pytest.mark.parametrize("preset", ["llama31-8b-proxy", "llama31-405b-proxy"])
def test_proxy_presets_keep_the_fixed_llama31_recipe(preset):
    cfg = resolve(preset)
    o, m = cfg.optim, cfg.model
    official = benchmarks.get(cfg.bench.benchmark)
    fields = ("optim.beta1", "optim.beta2", "optim.eps", "optim.weight_decay", "optim.grad_clip")
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip) == tuple(official.required(f) for f in fields)
    assert m.arch == "llama31" and m.rope_scaling == "llama3" and cfg.data.default_tokenizer == "bpe"
    assert cfg.bench.runs == benchmarks.get(cfg.bench.benchmark).runs and o.checkpoint_samples == 0


def _proxy_config(preset: str, *overrides: str):
    return resolve(preset, overrides=["train.target_eval_loss=3.0", *overrides])


@pytest.mark.parametrize("preset,gbs", [("llama31-8b-proxy", 32), ("llama31-405b-proxy", 64)])
def test_scripted_proxy_log_passes_the_proxy_rules_only(tmp_path, preset, gbs):
    ov = [f"train.global_batch_size={gbs}", "train.micro_batch_size=16"]
    if preset == "llama31-405b-proxy":
        ov.append(f"optim.lr={PROXY_LR.at(gbs)!r}")
    cfg = _proxy_config(preset, *ov)
    result, _ = scripted_run(cfg, tmp_path, [3.4, 2.9], platform="1xCPU", eval_samples=97)
    assert result["status"] == "success"
    init = {e["key"]: e["value"] for e in read_mllog(tmp_path / "mllog.txt")}
    assert init["max_sequence_length"] == 256 and init["eval_samples"] == 97 and init["global_batch_size"] == gbs
    name = cfg.bench.benchmark
    check = check_log(tmp_path / "mllog.txt", name)
    assert check.ok, check.output
    official = check_log(tmp_path / "mllog.txt", name.removesuffix("-proxy"))
    assert not official.ok and "max_sequence_length" in official.output


@pytest.mark.parametrize(
    "preset,overrides,log_key",
    [
        ("llama31-405b-proxy", ["train.global_batch_size=64"], "opt_base_learning_rate"),  # LR not scaled with GBS
        ("llama31-405b-proxy", ["optim.warmup_samples=1024"], "opt_learning_rate_decay_steps"),  # 32 warm-up steps
        ("llama31-8b-proxy", ["optim.decay_samples=320000"], "max_steps"),  # the cosine must end at max_steps
        ("llama31-8b-proxy", ["optim.beta2=0.999"], "opt_adamw_beta_2"),
    ],
    ids=["405b-lr", "405b-warmup", "8b-max-steps", "8b-beta2"],
)
def test_planted_proxy_schedule_break_fails(tmp_path, preset, overrides, log_key):
    cfg = _proxy_config(preset, *overrides)
    if log_key == "max_steps":
        # The log says max_steps = the cosine's end; a break is a cosine ending elsewhere than the logged max_steps.
        text_log = tmp_path / "mllog.txt"
        scripted_run(cfg, tmp_path, [2.9], platform="1xCPU", eval_samples=97)
        lines = text_log.read_text().splitlines()
        edited = [ln.replace('"value": 10000', '"value": 20000') if '"key": "max_steps"' in ln else ln for ln in lines]
        assert edited != lines
        text_log.write_text("\n".join(edited) + "\n")
    else:
        scripted_run(cfg, tmp_path, [2.9], platform="1xCPU", eval_samples=97)
    check = check_log(tmp_path / "mllog.txt", cfg.bench.benchmark)
    assert not check.ok and log_key in check.output, check.output
