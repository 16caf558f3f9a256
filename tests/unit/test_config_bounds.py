"""Bounds on every numeric config field and CLI flag, and config-like files that are not what they claim to be.

Each hostile case ends in ONE line on stderr naming the field, flag, file or variable, and exit status 2 (issue 25,
findings 4 and 7). Nothing here starts a run: the threads and batch cases are refused at config resolve time or by
the memory guard before any thread, batch or run directory exists.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from scaletrain import config_bounds
from scaletrain.cli.main import main
from scaletrain.config import Config, ConfigError, list_presets, resolve
from scaletrain.config_bounds import BOUNDS, INT64_MAX, SEED_MAX, numeric_fields

hostile = pytest.mark.hostile  # the tests feeding a bad value; the others check that good ones still pass


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """(exit status, stderr) of `scaletrain ARGS`, argparse's SystemExit included."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    return code, capsys.readouterr().err.strip()


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


# ---------------------------------------------------------------- every numeric field has a declared range


def test_every_numeric_field_has_a_bound():
    # Enumerated from the dataclasses: a numeric field added without a BOUNDS entry fails here.
    names = dict(numeric_fields(Config()))
    missing = sorted(set(names) - set(BOUNDS))
    assert not missing, f"numeric config fields without a range in config_bounds.BOUNDS: {missing}"
    stale = sorted(set(BOUNDS) - set(names))
    assert not stale, f"BOUNDS entries for fields that do not exist: {stale}"
    for name, value in names.items():
        bound = BOUNDS[name]
        if isinstance(value, int):  # an int reaches numpy/torch as int64: a finite upper end is required
            assert math.isfinite(bound.hi) and bound.hi <= INT64_MAX, name
        assert bound.holds(value), (name, value)  # the default itself is inside


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_is_inside_the_bounds(preset):
    cfg = resolve(preset, host=False)
    outside = [(n, v) for n, v in numeric_fields(cfg) if not BOUNDS[n].holds(v)]
    assert not outside


def _outside(name: str) -> list[tuple[str, object]]:
    """Values just past each end of a field's range: the end itself where it is open."""
    b = BOUNDS[name]
    is_int = isinstance(dict(numeric_fields(Config()))[name], int)
    cases: list[tuple[str, object]] = []
    if is_int:
        cases.append(("low", int(b.lo) - 1))
        cases.append(("high", int(b.hi) + 1))
        return cases
    cases.append(("low", b.lo if b.lo_open else b.lo - 1.0))
    if math.isfinite(b.hi):
        cases.append(("high", b.hi if b.hi_open else b.hi * 2))
    return cases


# Lower ends the checks before this change already refused by name (test_config_model, test_cli_errors, ...): left
# out so that every case here is one the old code accepted.
_ALREADY_REFUSED_LOW = {
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_heads",
    "model.d_ff",
    "model.seq_len",
    "model.vocab_size",
    "model.vocab_multiple",
    "model.ln_eps",
    "model.init_std",
    "model.rope_theta",
    "model.head_dim",
    "model.swiglu_limit",
    "model.swiglu_alpha",
    "model.sliding_window",
    "model.sliding_window_pattern",
    "model.moe.n_experts",
    "model.mla.kv_lora_rank",
    "model.mla.q_lora_rank",
    "lora.rank",
    "lora.alpha",
    "lora.dropout",
    "optim.lr",
    "optim.end_lr_ratio",
    "optim.warmup_samples",
    "optim.decay_samples",
    "optim.checkpoint_samples",
    "optim.beta1",
    "optim.beta2",
    "optim.eps",
    "optim.weight_decay",
    "optim.grad_clip",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.max_steps",
    "train.eval_interval_samples",
    "train.threads",
    "train.probe_window_s",
    "train.log_interval",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.tp",
    "parallel.pp",
    "parallel.pp_virtual",
    "parallel.cp",
    "parallel.ep",
    "checkpoint.interval_steps",
    "checkpoint.interval_minutes",
    "checkpoint.keep",
    "bench.runs",
}
# Upper ends whose finer check existed and still speaks first (it names the field too).
_ALREADY_REFUSED_HIGH = {
    "model.ln_eps",
    "optim.end_lr_ratio",
    "optim.beta1",
    "optim.beta2",
    "lora.dropout",
    "train.probe_window_s",
    "model.n_kv_heads",
    "train.micro_batch_size",
}

CASES = [
    pytest.param(name, value, id=f"{name}-{end}")
    for name in BOUNDS
    for end, value in _outside(name)
    if name not in (_ALREADY_REFUSED_LOW if end == "low" else _ALREADY_REFUSED_HIGH)
]


@hostile
@pytest.mark.parametrize("name,value", CASES)
def test_a_value_outside_its_range_is_one_line_naming_the_field(name, value):
    with pytest.raises(ConfigError) as info:
        resolve("gpt3-proxy", overrides=[f"{name}={value!r}"], host=False)
    message = str(info.value)
    assert name in message and "\n" not in message, message


def test_the_cases_cover_most_fields():
    assert len({p.values[0] for p in CASES}) >= 60 and len(CASES) >= 70


@hostile
@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.seed=-1", "train.seed=-1: must be in [0, 4294967295]"),
        (f"train.seed={2**64}", f"train.seed={2**64}: must be in [0, 4294967295]"),
        (f"train.seed={2**32}", "train.seed=4294967296"),
        (f"train.max_steps={10**30}", "train.max_steps="),
        ("optim.lr=1e308", "optim.lr=1e+308: must be in (0, 1000]"),
        ("optim.lr=1000.5", "optim.lr=1000.5"),
        (f"train.global_batch_size={10**12}", f"train.global_batch_size={10**12}: must be in [1, 16777216]"),
        ("model.n_layers=10000000", "model.n_layers=10000000"),
        ("parallel.tp=1000000000", "parallel.tp=1000000000"),
    ],
)
def test_the_issue_values_are_refused_in_one_line(override, needle):
    # Through the CLI: today these were tracebacks (seed, max_steps, lr) or a 16 GB process (the batch).
    with pytest.raises(ConfigError) as info:
        resolve("gpt3-proxy", overrides=[override])
    assert needle in str(info.value) and "\n" not in str(info.value)


@hostile
def test_the_same_values_through_the_cli_are_exit_2(capsys, tmp_path):
    for override in ("train.seed=-1", "optim.lr=1e308", f"train.max_steps={10**30}", f"train.seed={2**64}"):
        code, err = run_cli(capsys, "train", "--set", override, "--run-dir", str(tmp_path / "r"))
        assert_one_line(code, err, override.split("=")[0])
    assert not (tmp_path / "r").exists()


@hostile
@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([f"train.max_steps={2**62}"], "overflows int64"),
        ([f"train.max_steps={2**40}", "train.global_batch_size=16777216", "train.micro_batch_size=8"], "int64"),
        ([f"optim.decay_samples={2**53}", "model.seq_len=16777216", "train.max_steps=0"], "optim.decay_samples"),
    ],
)
def test_a_run_whose_token_count_overflows_int64_is_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve("gpt3-proxy", overrides=overrides, host=False)


# ---------------------------------------------------------------- threads: at most the cores this process may use


@hostile
@pytest.mark.parametrize("threads", [1000000, 65536, "cores+1"])
def test_more_threads_than_cores_is_refused_at_resolve(threads):
    # Refused before any thread is started: the old code handed 10^6 to torch.set_num_threads in the run.
    cores = config_bounds.available_cores()
    value = cores + 1 if threads == "cores+1" else threads
    with pytest.raises(ConfigError) as info:
        resolve("gpt3-proxy", overrides=[f"train.threads={value}"])
    msg = str(info.value)
    assert f"train.threads={value}: more than the {cores} CPU core" in msg and "\n" not in msg


def test_threads_up_to_the_cores_are_accepted():
    cores = config_bounds.available_cores()
    assert resolve("gpt3-proxy", overrides=[f"train.threads={cores}"]).train.threads == cores
    assert resolve("gpt3-proxy", overrides=["train.threads=0"]).train.threads == 0


def test_a_presets_threads_shrink_to_a_smaller_host(monkeypatch):
    # The CPU presets ask for 2 threads; on a 1-core host that is no user's mistake.
    monkeypatch.setattr("scaletrain.config.available_cores", lambda: 1)
    monkeypatch.setattr("scaletrain.config_bounds.available_cores", lambda: 1)
    assert resolve("gpt3-proxy").train.threads == 1
    with pytest.raises(ConfigError, match="train.threads=3"):
        resolve("gpt3-proxy", overrides=["train.threads=3"])


def test_the_simulator_prices_a_config_with_more_threads_than_this_host(capsys):
    # predict --from-config reads configs written on other machines: threads are theirs, not this host's.
    code = main(
        [
            "predict",
            "--from-config",
            "--model",
            "gpt3-proxy",
            "--gpus",
            "1",
            "--gpu",
            "h100",
            "--set",
            "train.threads=4096",
        ]
    )
    assert code in (0, 1), capsys.readouterr().err


# ---------------------------------------------------------------- the batch buffers must fit in memory


@hostile
def test_a_global_batch_whose_token_buffers_cannot_fit_is_refused_before_allocation(monkeypatch):
    from scaletrain.parallel.layout import Layout
    from scaletrain.train import host

    cfg = resolve("gpt3-proxy", overrides=["train.global_batch_size=16777216"])
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 32 * 10**9)
    with pytest.raises(ConfigError) as info:
        host.check_host_memory(cfg, Layout.from_config(cfg, 1))
    msg = str(info.value)
    assert "train.global_batch_size=16777216: one step's token batches need ~69 GB" in msg and "32 GB" in msg
    # On a GPU run the batches are still built on the host.
    with pytest.raises(ConfigError, match="global_batch_size"):
        host.check_host_memory(cfg, Layout.from_config(cfg, 1), "cuda")
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 10**12)
    host.check_host_memory(cfg, Layout.from_config(cfg, 1))


# ---------------------------------------------------------------- numeric flags of every subcommand

PREDICT = ["predict", "--model", "gpt3-175b", "--gpus", "512"]
FLAG_CASES = [
    (["predict", "--gpus", "0"], "--gpus/--world-size: must be an integer in [1, "),
    (["predict", "--gpus", "-8"], "--gpus/--world-size"),
    (["predict", "--gpus", str(10**30)], "--gpus/--world-size"),
    (["predict", "--gpus", "nan"], "'nan' is not an integer"),
    ([*PREDICT, "--gbs", "0"], "--gbs: must be an integer in [1, "),
    ([*PREDICT, "--gbs", "-1"], "--gbs"),
    ([*PREDICT, "--gbs", str(10**29)], "--gbs"),
    ([*PREDICT, "--tp", "0"], "--tp"),
    ([*PREDICT, "--tp", "-1"], "--tp"),
    ([*PREDICT, "--pp", "0"], "--pp"),
    ([*PREDICT, "--vp", "0"], "--vp"),
    ([*PREDICT, "--cp", "0"], "--cp"),
    ([*PREDICT, "--ep", "0"], "--ep"),
    ([*PREDICT, "--mbs", "0"], "--mbs"),
    ([*PREDICT, "--tp", str(10**20)], "--tp"),
    ([*PREDICT, "--moe-imbalance", "nan"], "--moe-imbalance: must be a finite number"),
    ([*PREDICT, "--moe-imbalance", "inf"], "--moe-imbalance"),
    ([*PREDICT, "--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["plan", "--gpus", "0"], "--gpus/--world-size"),
    (["plan", "--gpus", "512", "--top", "0"], "--top"),
    (["plan", "--gpus", "512", "--top", "1000000000"], "--top: must be an integer in [1, 100]"),
    (["plan", "--gpus", "512", "--gbs", "0"], "--gbs"),
    (["train", "--dry-run", "--world-size", "0"], "--world-size: must be an integer in [1, "),
    (["train", "--dry-run", "--world-size", "-1"], "--world-size"),
    (["bench", "--runs", "0"], "--runs: must be an integer in [1, 1000]"),
    (["bench", "--runs", "-1"], "--runs"),
    (["bench", "--runs", "1000001"], "--runs"),
    (["sim", "validate", "--jobs", "0"], "--jobs"),
    (["sim", "validate", "--jobs", str(10**9)], "--jobs"),
    (["sim", "validate", "--cv", "scale", "--cv-threshold", "-3"], "--cv-threshold"),
    (["data", "prepare", "x.txt", "--out", "o", "--vocab-size", str(10**13)], "--vocab-size"),
    (["data", "fetch", "--vocab-size", "-1"], "--vocab-size"),
]


@hostile
@pytest.mark.parametrize("argv,needle", FLAG_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in FLAG_CASES])
def test_a_bad_numeric_flag_is_one_line_and_exit_2(capsys, argv, needle):
    code, err = run_cli(capsys, *argv)
    assert_one_line(code, err, needle)


def test_predict_gbs_is_the_given_one_not_the_default(capsys):
    # `--gbs 0` once priced the benchmark's default GBS 2048; an explicit batch is what gets priced.
    code = main([*PREDICT, "--gbs", "1536", "--tp", "8", "--pp", "8", "--json"])
    assert code in (0, 1) and json.loads(capsys.readouterr().out)["layout"]["gbs"] == 1536


@hostile
def test_a_layout_too_large_to_simulate_is_one_line(capsys):
    # 131,072 micro-batches over 16 virtual stages: 2M forward ops, once a multi-GB simulation, now refused.
    code, err = run_cli(
        capsys,
        "predict",
        "--model",
        "llama2-7b",
        "--gpus",
        "64",
        "--tp",
        "8",
        "--pp",
        "8",
        "--vp",
        "2",
        "--gbs",
        "131072",
    )
    assert_one_line(code, err, "forward ops per step", "pipeline simulation")


@hostile
def test_the_schedule_refuses_more_ops_than_it_simulates():
    from scaletrain.sim import schedule

    with pytest.raises(ValueError, match="forward ops"):
        schedule.simulate("1f1b", 1, schedule.MAX_FORWARD_OPS + 1)


@hostile
def test_bench_seeds_past_the_seed_range_are_refused(capsys, tmp_path):
    code, err = run_cli(capsys, "bench", "--set", f"train.seed={SEED_MAX}", "--out", str(tmp_path / "b"))
    assert_one_line(code, err, f"train.seed={SEED_MAX} with bench.runs=3")
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------- files: config, catalog, efficiency, results


def _bad_file(tmp_path, kind: str) -> str:
    path = tmp_path / f"bad-{kind}.toml"
    if kind == "binary":
        path.write_bytes(bytes(range(128, 256)) * 4)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "blank":
        path.write_text(" \n\t\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "missing":
        pass
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with open(path, "wb") as fh:  # sparse: 17 MiB on paper, nothing on disk
            fh.truncate(17 * 2**20)
    elif kind == "deep":
        path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    return str(path)


# What each kind of bad file is called; the messages before this change named none of these (a directory or a
# FIFO was "no such file", binary and deep ones were tracebacks, empty ones were read as no settings at all).
FILE_KINDS = {
    "binary": "not a UTF-8 text file",
    "empty": "the file is empty",
    "blank": "the file is empty",
    "directory": "is a directory, not a file",
    "fifo": "not a regular file",
    "huge": "more than the 16777216 a config file may have",
    "deep": "nested too deeply",
}


@hostile
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_bad_config_file_is_one_line_naming_it(capsys, tmp_path, kind):
    path = _bad_file(tmp_path, kind)
    code, err = run_cli(capsys, "config", "--config", path)
    assert_one_line(code, err, path, FILE_KINDS[kind])


@hostile
def test_a_deeply_nested_config_json_is_one_line(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100000 + "]" * 100000)
    code, err = run_cli(capsys, "config", "--config", str(path))
    assert_one_line(code, err, str(path), "nested more than")


@hostile
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_bad_catalog_file_is_one_line_naming_it(capsys, tmp_path, kind):
    path = _bad_file(tmp_path, kind)
    code, err = run_cli(capsys, "predict", "--gpus", "8", "--catalog", path)
    assert_one_line(code, err, path, FILE_KINDS[kind])


@hostile
@pytest.mark.parametrize("kind", ["binary", "empty", "directory", "deep"])
def test_a_bad_catalog_from_the_environment_is_one_line_naming_it(capsys, tmp_path, monkeypatch, kind):
    path = _bad_file(tmp_path, kind)
    monkeypatch.setenv("SCALETRAIN_CATALOG", path)
    code, err = run_cli(capsys, "predict", "--gpus", "8")
    assert_one_line(code, err, path, FILE_KINDS[kind])


def _bad_efficiency(tmp_path, kind: str) -> str:
    contents = {
        "not-json": "sets: none",
        "list": "[]",
        "sets-not-object": '{"sets": 5}',
        "set-not-object": '{"sets": {"v5.1/hopper": [1, 2]}}',
        "nan-scalar": '{"sets": {"v5.1/hopper": {"gemm_eff": NaN}}}',
        "string-scalar": '{"sets": {"v5.1/hopper": {"gemm_eff": "fast"}}}',
        "no-sets": '{"fit": {}}',
        "deep": "[" * 100000 + "]" * 100000,
        "run-terms-string": '{"sets": {}, "run_terms": {"llama2_70b_lora": {"software": {"NeMo": {"one_off_s": "x"}}}}}',
        "run-terms-negative": '{"sets": {}, "run_terms": {"gpt3": {"software": {"NeMo": {"one_off_s": -3}}}}}',
        "run-terms-default": '{"sets": {}, "run_terms": {"gpt3": {"software": {}, "default": {"v4.1": 7}}}}',
    }
    if kind in contents:
        path = tmp_path / f"eff-{kind}.json"
        path.write_text(contents[kind])
        return str(path)
    return _bad_file(tmp_path, kind)


EFF_KINDS = {
    "missing": "no such file",  # once silently ignored, like a directory or a FIFO
    "directory": "is a directory",
    "fifo": "not a regular file",
    "binary": "not a UTF-8 text file",
    "empty": "the file is empty",
    "not-json": "not valid JSON",
    "list": "a JSON object of sections, got list",
    "sets-not-object": "'sets' must be an object",  # once a traceback, like the next three
    "set-not-object": "must be an object of scalars",
    "nan-scalar": "gemm_eff=nan is not a finite number",  # once a silent NaN prediction
    "string-scalar": "gemm_eff='fast' is not a finite number",
    "no-sets": "no 'sets' section",
    "deep": "not valid JSON",
    "run-terms-string": "run_terms.llama2_70b_lora.software.'NeMo'.one_off_s='x' is not a finite number",
    "run-terms-negative": "one_off_s=-3 is negative",
    "run-terms-default": "run_terms.gpt3.default must map rounds to software labels",
}


@hostile
@pytest.mark.parametrize("kind", EFF_KINDS)
def test_a_bad_efficiency_file_is_one_line_naming_the_variable(capsys, tmp_path, monkeypatch, kind):
    # A mistyped path used to be ignored: predictions silently used the shipped sets.
    path = _bad_efficiency(tmp_path, kind)
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", path)
    code, err = run_cli(capsys, "predict", "--gpus", "8")
    assert_one_line(code, err, f"$SCALETRAIN_EFFICIENCY={path}", EFF_KINDS[kind])


@hostile
@pytest.mark.parametrize("kind", ["missing", "directory", "nan-scalar"])
def test_train_refuses_a_bad_efficiency_file_before_the_run(capsys, tmp_path, monkeypatch, kind):
    path = _bad_efficiency(tmp_path, kind)
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", path)
    code, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "r"))
    assert_one_line(code, err, f"$SCALETRAIN_EFFICIENCY={path}")
    assert not (tmp_path / "r").exists()


def test_an_empty_efficiency_variable_means_unset(capsys, monkeypatch):
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", "")
    assert main(["predict", "--gpus", "512"]) in (0, 1)  # 1: the layout does not fit; a price all the same
    assert "error" not in capsys.readouterr().err


@hostile
@pytest.mark.parametrize("kind", ["binary", "directory", "missing", "fifo"])
def test_unreadable_results_csv_is_one_line_naming_it(capsys, tmp_path, kind):
    # Once a TypeError traceback (nothing left to summarise), or for a binary file a message naming no file.
    path = _bad_file(tmp_path, kind)
    code, err = run_cli(capsys, "sim", "validate", "--results", path)
    assert_one_line(code, err, path)


@hostile
@pytest.mark.parametrize("kind", ["binary", "directory", "empty", "deep"])
def test_unreadable_layer_timings_are_one_line_naming_them(capsys, tmp_path, kind):
    path = _bad_file(tmp_path, kind)
    code, err = run_cli(capsys, "sim", "calibrate", "--layer-timings", path)
    assert_one_line(code, err, path)
