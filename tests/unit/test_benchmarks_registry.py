"""The benchmark registry (scaletrain.benchmarks): every entry resolves, and one new entry is all a benchmark needs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scaletrain import benchmarks
from scaletrain.config import ConfigError, resolve
from scaletrain.sim import mlperf


@pytest.mark.parametrize("spec", list(benchmarks.BENCHMARKS.values()), ids=list(benchmarks.BENCHMARKS))
def test_every_benchmark_resolves_its_presets_rules_and_data(spec):
    ref = resolve(spec.reference_preset)
    assert ref.bench.benchmark == spec.name and benchmarks.preset_for(spec.name) == spec.reference_preset
    assert (ref.model.arch, ref.model.seq_len) == (spec.arch, spec.seq_len)
    assert ref.train.eval_interval_samples == spec.eval_every_sequences
    assert ref.train.target_eval_loss == spec.target
    assert ref.lora.rank > 0 if spec.lora else ref.lora.rank == 0
    from scaletrain.bench.closed import official_rule_violations

    assert official_rule_violations(ref) == []  # the reference preset keeps every closed-division rule
    # The simulator's data: RCPs from the installed package when it has them, and from the carried copy of the
    # version the simulator uses, both with records; the carried calibration rows.
    assert mlperf.rcp_records(spec.name)
    version = mlperf.rcp_version(spec.name)
    raw, where = mlperf._load_rcp_raw(spec.name, version, use_package=False)
    assert raw and where.endswith(f"rcps_{version}.csv")
    from scaletrain.sim.fit.results import bundled_results

    if spec.calibration_file:  # the MoE benchmarks have no published result yet
        assert {r.benchmark for r in bundled_results(spec.name)} == {spec.name}
    else:
        assert not bundled_results(spec.name)
    proxy = resolve(spec.proxy_preset)
    assert proxy.bench.benchmark == spec.proxy_name and benchmarks.preset_for(spec.proxy_name) == spec.proxy_preset
    assert benchmarks.get(spec.proxy_name) is spec and benchmarks.is_proxy(spec.proxy_name)
    assert proxy.model.arch == spec.arch
    if spec.proxy_needs_base:
        base = resolve(spec.proxy_base_preset)
        assert base.model.arch == spec.arch and not base.checkpoint.init_from

    from scaletrain.bench.checker import proxy_rules_path

    assert proxy_rules_path(spec.proxy_name).is_file()


def test_entries_agree_with_the_mlperf_logging_package():
    mllog = pytest.importorskip("mlperf_logging.mllog")
    from mlperf_logging.benchmark_meta import _ALL_RESULT_FILE_COUNTS

    for spec in benchmarks.BENCHMARKS.values():
        # gpt_oss_20b has no constant in the package: its logs carry the name (bench.rules.submission_benchmark).
        assert (
            getattr(mllog.constants, spec.mllog_constant) == spec.name
            if spec.mllog_constant
            else spec.name == "gpt_oss_20b"
        )
        assert _ALL_RESULT_FILE_COUNTS["training"][spec.name] == spec.runs
        assert mlperf._package_rcp_file(spec.name, benchmarks.resolve_ruleset(spec.name)) is not None
        from scaletrain.bench.rules import OWN_KEY_VALUES

        constants = {v for k, v in vars(mllog.constants).items() if k.isupper()}
        assert set(spec.own_init_keys) <= set(OWN_KEY_VALUES) <= constants


def test_skip_rule_is_the_training_rules_formula():
    lora = benchmarks.BENCHMARKS["llama2_70b_lora"]
    for gbs in range(1, 300):
        assert lora.skipped_evals(gbs) == int(0.125 * gbs + 2)  # FLOOR(0.125*global_batch_size+2)
        assert benchmarks.BENCHMARKS["gpt3"].skipped_evals(gbs) == 0
    # deepseekv3_671b 6.1.0: the first evaluation (every step) at step floor(42 + 24576 / GBS), at GBS >= 15,360;
    # none skipped at a proxy's batch size.
    dsv3 = benchmarks.DEEPSEEKV3_671B
    for gbs in (15360, 16384, 18432, 24576, 24577, 49152):
        assert dsv3.skipped_evals(gbs) + 1 == int(42 + 24576 / gbs)
    assert dsv3.skipped_evals(32) == dsv3.skipped_evals(15359) == 0


def test_lookups_name_the_known_benchmarks():
    assert benchmarks.names() == (
        "gpt3",
        "gpt3-proxy",
        "llama2_70b_lora",
        "llama2_70b_lora-proxy",
        "llama31_405b",
        "llama31_405b-proxy",
        "llama31_8b",
        "llama31_8b-proxy",
        "gpt_oss_20b",
        "gpt_oss_20b-proxy",
        "deepseekv3_671b",
        "deepseekv3_671b-proxy",
    )
    with pytest.raises(ValueError, match="unknown benchmark 'llama31_8b-proxy-proxy'"):
        benchmarks.get("llama31_8b-proxy-proxy")
    assert benchmarks.for_model("llama31-405b") is benchmarks.LLAMA31_405B
    with pytest.raises(ValueError, match="unknown benchmark 'bert'.*gpt3-proxy"):
        benchmarks.get("bert")
    assert benchmarks.for_model("gpt3") is benchmarks.for_model("gpt3-175b") is benchmarks.GPT3
    assert benchmarks.for_model("gpt3-125m") is None and benchmarks.for_preset("gpt3") is None
    assert benchmarks.choices_text(["a", "b", "c"]) == "a, b or c" and benchmarks.choices_text(["a"]) == "a"


@pytest.fixture
def fake(monkeypatch):
    """A benchmark that exists only as one registry entry (gpt3's rules files and mllog name, its own numbers)."""
    spec = replace(
        benchmarks.GPT3,
        name="fake",
        reference_preset="gpt3-125m",
        proxy_preset="gpt3-proxy",
        eval_every_sequences=1000,
        eval_tokens=123_456,
        runs=5,
        lora=True,
        eval_skip_gbs_divisor=4,
        eval_skip_offset=1,
        default_gbs=64,
        calibration_file="",  # no published results yet
        init_keys="lora",
    )
    monkeypatch.setitem(benchmarks.BENCHMARKS, "fake", spec)
    return spec


def test_one_entry_is_enough_for_config_bench_and_cli(fake):
    cfg = resolve("gpt3-proxy", overrides=["bench.benchmark=fake-proxy"])
    assert cfg.bench.benchmark == "fake-proxy"
    assert resolve("gpt3-proxy", overrides=["bench.benchmark=fake"]).bench.benchmark == "fake"
    with pytest.raises(ConfigError, match="must be one of .*'fake', 'fake-proxy'"):
        resolve("gpt3-proxy", overrides=["bench.benchmark=fake-nope"])
    assert benchmarks.preset_for("fake") == "gpt3-125m"

    from scaletrain.bench import rules
    from scaletrain.bench.checker import checker_command, known
    from scaletrain.bench.score import required_runs
    from scaletrain.train.schedule import eval_skip

    assert required_runs("fake-proxy") == 5 and {"fake", "fake-proxy"} <= set(known())
    assert rules.is_lora(cfg) and rules.submission_benchmark("fake-proxy") == "gpt3"
    cfg.train.global_batch_size = 8
    assert eval_skip(cfg) == 8 // 4 + 1  # the loop's schedule reads the same entry
    assert "--ruleset" in checker_command("log.txt", "fake")


def test_one_entry_is_enough_for_the_simulator(fake):
    from scaletrain.sim.fit.results import bundled_results
    from scaletrain.sim.predict import benchmark_of, predict
    from scaletrain.sim.workload import ClusterLayout, load_workload

    assert mlperf.bench("fake") is fake and benchmark_of("gpt3-125m") == "fake"
    assert bundled_results("fake") == [] and {r.benchmark for r in bundled_results()} == {
        "gpt3",
        "llama2_70b_lora",
        "llama31_405b",
        "llama31_8b",
    }
    assert mlperf.eval_interval_steps("fake", 64) == 16 and mlperf.skipped_evals("fake", 64) == 17
    c = mlperf.convergence("fake", 64, converge=64 * 2048 * 100)  # tokens, like gpt3
    assert (c.steps, c.evals, c.eval_tokens) == (18 * 16, 1, 123_456)  # cannot stop before the first kept eval
    w = load_workload("fake")  # the benchmark name means its reference preset
    assert w.name == "gpt3-125m"
    assert benchmarks.for_model("fake").default_gbs == 64  # `predict --model fake` without --gbs
    pred = predict(w, ClusterLayout(gpus=8, gbs=64), "h100", converge=64 * 2048 * 100)
    assert pred.steps == 18 * 16 and pred.evals == 1 and pred.time_to_train_min is not None


def test_a_benchmark_missing_its_facts_is_refused():
    """No silent fallback to another benchmark's hyperparameters or rules: the entry itself is refused."""
    with pytest.raises(ValueError, match="'fake': init_keys='' is not one of"):
        replace(benchmarks.LLAMA31_8B, name="fake", init_keys="")
    with pytest.raises(ValueError, match="'fake' states no closed-division rules"):
        replace(benchmarks.LLAMA31_8B, name="fake", closed=())
    with pytest.raises(ValueError, match="'fake': lora=True needs init_keys 'lora'"):
        replace(benchmarks.LLAMA31_8B, name="fake", lora=True)


def test_one_entry_gives_a_pretraining_benchmark_its_keys_and_closed_checks(monkeypatch):
    """A new pre-training entry logs the AdamW keys plus its own (not gpt3's), and is checked by its own rules."""
    from scaletrain.bench.closed import official_rule_violations
    from scaletrain.bench.rules import mllog_hparams
    from scaletrain.benchmarks import Fixed, GbsRange

    spec = replace(
        benchmarks.LLAMA31_8B,
        name="fake8b",
        reference_preset="llama31-8b-proxy",
        own_init_keys=("max_steps", "moe_aux_loss_coeff"),
        closed=(GbsRange(1, 2), Fixed("optim.beta1", 0.5), Fixed("model.seq_len")),
    )
    monkeypatch.setitem(benchmarks.BENCHMARKS, "fake8b", spec)
    cfg = resolve("llama31-8b-proxy", overrides=["bench.benchmark=fake8b"])
    logged = dict(mllog_hparams(cfg, 97, "1xCPU"))
    assert logged["opt_name"] == "adamw" and logged["max_steps"] == cfg.optim.decay_steps(cfg.train.global_batch_size)
    assert logged["moe_aux_loss_coeff"] == cfg.model.moe.aux_loss_coef and "init_checkpoint_step" not in logged
    gbs = cfg.train.global_batch_size
    assert official_rule_violations(cfg) == [
        f"train.global_batch_size={gbs}: fake8b reference convergence points cover 1..2 only",
        "optim.beta1=0.9: fake8b requires 0.5",
        f"model.seq_len={cfg.model.seq_len}: fake8b requires 8192",
    ]
    monkeypatch.setitem(benchmarks.BENCHMARKS, "fake8b", replace(spec, own_init_keys=("max_stepz",)))
    with pytest.raises(ValueError, match=r"'fake8b': no value known for its init key\(s\) \['max_stepz'\]"):
        mllog_hparams(cfg, 97, "1xCPU")
