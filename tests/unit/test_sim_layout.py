"""One memory model: the dry run's real shards against the simulator's count, and `train --dry-run` against
`predict --from-config` through the one adapter parallel/sim_layout.py."""

import json

import pytest

from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.parallel.dry_run import dry_run
from scaletrain.parallel.layout import Layout
from scaletrain.parallel.sim_layout import sim_inputs, sim_layout

GPT = [
    "model.arch=gpt3",
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.seq_len=32",
    "model.vocab_size=256",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
]
LLAMA = [
    "model.arch=llama",
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "model.seq_len=32",
    "model.vocab_size=256",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
]
# (model, parallel overrides, world size): FSDP, TP, TP x FSDP, PP (1F1B and interleaved), HSDP, DDP, CP.
LAYOUTS = [
    (GPT, [], 4),
    (GPT, ["parallel.tp=2"], 2),
    (GPT, ["parallel.tp=2"], 4),
    (GPT, ["parallel.pp=2"], 4),
    (GPT, ["parallel.dp_replicate=2"], 4),
    (LLAMA, [], 4),
    (LLAMA, ["parallel.tp=2"], 4),
    (LLAMA, ["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b"], 2),
    (LLAMA, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], 2),
    (LLAMA, ["parallel.cp=2", "parallel.tp=2"], 4),
]


def _flags(overrides):
    return [f"--{o.split('=', 1)[0]}={o.split('=', 1)[1]}" for o in overrides]


@pytest.mark.parametrize("model,par,world", LAYOUTS)
def test_dry_run_parameters_equal_the_simulators(model, par, world):
    cfg = resolve("gpt3-proxy", overrides=[*model, *par])
    report = dry_run(cfg, world)
    assert len(report["ranks"]) == (2 if cfg.parallel.pp > 1 else 1)
    for rank in report["ranks"]:
        assert rank["local_params"] == pytest.approx(rank["sim_local_params"], rel=1e-12), rank["stages"]


def test_adapter_prices_default_fsdp_as_zero3_and_hsdp_over_its_shards():
    cfg = resolve("gpt3-proxy", overrides=GPT)
    assert cfg.parallel.dp_shard == -1
    _, lay = sim_inputs(cfg, 8)
    assert (lay.zero, lay.zero_shards, lay.dp) == (3, 8, 8)
    cfg = resolve("gpt3-proxy", overrides=[*GPT, "parallel.dp_replicate=2"])
    _, lay = sim_layout(cfg, Layout.from_config(cfg, 8))
    assert (lay.zero, lay.zero_shards, lay.dp) == (3, 4, 8)
    cfg = resolve("gpt3-proxy", overrides=[*GPT, "parallel.dp_replicate=2", "parallel.dp_shard=1"])
    assert sim_inputs(cfg, 2)[1].zero == 0  # DDP: every rank holds all 16 bytes per parameter


@pytest.mark.parametrize(
    "preset,overrides,world",
    [
        ("gpt3-proxy", [*GPT, "parallel.pp=2"], 4),
        ("gpt3-proxy", [*LLAMA, "parallel.tp=2"], 4),
        (
            "llama2-70b",
            ["parallel.tp=8", "parallel.pp=4", "train.global_batch_size=64", "train.micro_batch_size=1"],
            256,
        ),
    ],
)
def test_dry_run_and_predict_from_config_agree_on_memory(capsys, preset, overrides, world):
    flags = ["--preset", preset, *_flags(overrides)]
    assert main(["train", "--dry-run", "--json", "--world-size", str(world), *flags]) in (0, 2)
    dry = json.loads(capsys.readouterr().out)
    flags[0] = "--model"
    main(["predict", "--from-config", "--json", "--gpus", str(world), *flags])
    pred = json.loads(capsys.readouterr().out)
    assert pred["layout"]["zero"] == 3
    assert pred["memory_gib_per_gpu"] == pytest.approx(dry["max_memory_gib"], rel=0.02)


def test_predict_from_config_reports_a_bad_layout_in_one_line(capsys):
    assert main(["predict", "--from-config", "--model", "gpt3-175b", "--gpus", "10", "--parallel.tp", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scaletrain: error:") and len(err.splitlines()) == 1 and "world size 10" in err


# (trainer overrides, world size): HSDP x CP x TP(+SP) with FP8 and 2-sequence micro-batches; DDP; FSDP x
# interleaved PP.
FROM_FILE = [
    (
        [
            "parallel.tp=2",
            "parallel.cp=2",
            "parallel.dp_replicate=2",
            "train.fp8=true",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
        ],
        16,
    ),
    (["parallel.dp_replicate=4", "parallel.dp_shard=1", "train.global_batch_size=8", "train.micro_batch_size=1"], 4),
    (
        [
            "parallel.pp=2",
            "parallel.pp_virtual=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "train.global_batch_size=8",
            "train.micro_batch_size=1",
        ],
        8,
    ),
]


@pytest.mark.parametrize("overrides,world", FROM_FILE)
def test_predict_from_config_file_prices_the_layout_train_dry_run_runs(tmp_path, capsys, overrides, world):
    cfg = resolve("gpt3-proxy", overrides=overrides)
    path = str(cfg.save(tmp_path))
    # Another preset under the file: a run's config.json holds every field, so the file alone decides.
    assert (
        main(["train", "--dry-run", "--json", "--preset", "gpt3-175b", "--config", path, "--world-size", str(world)])
        == 0
    )
    dry = json.loads(capsys.readouterr().out)
    assert main(["predict", "--from-config", path, "--world-size", str(world), "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    lay, deg = pred["layout"], dry["degrees"]
    dp = deg["dp_replicate"] * deg["dp_shard"]
    assert (lay["gpus"], lay["tp"], lay["pp"], lay["cp"], lay["dp"]) == (world, deg["tp"], deg["pp"], deg["cp"], dp)
    assert (lay["vp"], lay["mbs"], lay["gbs"], lay["fp8"]) == (
        cfg.parallel.pp_virtual,
        cfg.train.micro_batch_size,
        cfg.train.global_batch_size,
        cfg.train.fp8,
    )
    sharded = dry["data_parallel"] in ("fsdp", "hsdp")
    assert lay["zero"] == (3 if sharded else 0)
    assert lay.get("shard_group", 0) == (deg["dp_shard"] * deg["cp"] if dry["data_parallel"] == "hsdp" else 0)
    # One memory model; with pipelining predict takes its in-flight micro-batches from the simulated schedule.
    rel = 1e-9 if deg["pp"] == 1 else 0.02
    assert pred["memory_gib_per_gpu"] == pytest.approx(dry["max_memory_gib"], rel=rel)


def test_predict_world_size_the_layout_does_not_divide_is_one_line(tmp_path, capsys):
    path = str(resolve("gpt3-proxy", overrides=["parallel.tp=2", "parallel.cp=2"]).save(tmp_path))
    assert main(["predict", "--from-config", path, "--world-size", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scaletrain: error:") and len(err.splitlines()) == 1 and "world size 6" in err
