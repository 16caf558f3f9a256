"""Uneven pipeline stages (parallel.pp_first_layers / pp_last_layers / pp_stage_layers; predict's and plan's
--pp-first-layers / --pp-last-layers / --pp-stage-layers): one rule (`sim.workload.stage_split`) in the trainer's
config and cut, the dry run, predict and plan. The gloo parity runs are in tests/distributed/test_layouts.py."""

import json
import shlex

import pytest

from scaletrain.cli.main import main
from scaletrain.config import ConfigError, resolve
from scaletrain.parallel.dry_run import dry_run
from scaletrain.parallel.layout import Layout, stage_sizes
from scaletrain.parallel.sim_layout import sim_inputs

TINY = [
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
    "parallel.pp=2",
]
INTERLEAVED = ["parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b"]


def _layout(extra, world=2):
    return Layout.from_config(resolve("gpt3-proxy", overrides=[*TINY, *extra], host=False), world)


def test_stage_sizes_follow_first_last_and_the_list():
    assert stage_sizes(4, 2) == [2, 2]
    assert stage_sizes(4, 2, first=1) == [1, 3] and stage_sizes(4, 2, last=0) == [4, 0]
    assert stage_sizes(126, 128, first=0, last=0) == [0] + [1] * 126 + [0]  # Llama 3.1 405B, pp16 x vp8
    assert stage_sizes(61, 16, first=3, last=2) == [3] + [4] * 14 + [2]  # DeepSeek-V3, pp16
    assert stage_sizes(4, 4, stages=(0, 2, 2, 0)) == [0, 2, 2, 0]
    assert stage_sizes(4, 2, first=3, last=3) is None and stage_sizes(4, 3, stages=(1, 0, 3)) is None


@pytest.mark.parametrize(
    "extra,sizes",
    [
        (["parallel.pp_first_layers=1"], [1, 3]),
        (["parallel.pp_last_layers=0"], [4, 0]),
        (["parallel.pp_stage_layers=[3,1]"], [3, 1]),
        (["parallel.pp_stage_layers=3,1"], [3, 1]),  # --set K=3,1 (a tuple literal)
        ([*INTERLEAVED, "parallel.pp_stage_layers=[0,2,2,0]"], [0, 2, 2, 0]),
    ],
)
def test_config_carries_the_split_to_the_layout(extra, sizes):
    assert _layout(extra).stage_blocks(4) == sizes


def test_toml_list_and_field_flag(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\npp = 2\npp_stage_layers = [1, 3]\n")
    cfg = resolve("gpt3-proxy", config_file=str(path), overrides=TINY[:-1], host=False)
    assert cfg.parallel.pp_stage_layers == [1, 3]
    assert Layout.from_config(cfg, 2).stage_blocks(4) == [1, 3]
    # A saved run's config.json reads back the same list.
    assert resolve("gpt3-proxy", config_file=str(cfg.save(tmp_path)), host=False).parallel.pp_stage_layers == [1, 3]


@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (["parallel.pp_stage_layers=[1,3]", "parallel.pp_first_layers=1"], 2, "leave parallel.pp_first_layers"),
        (["parallel.pp_stage_layers=[1,1,2]"], 2, "has 3 entries, but pp*vp = 2 virtual stages"),
        (["parallel.pp_stage_layers=[1,2]"], 2, "sums to 3 blocks, but the model has 4"),
        ([*INTERLEAVED, "parallel.pp_stage_layers=[1,0,2,1]"], 2, "every stage but the first and the last"),
        (["parallel.pp_first_layers=3", "parallel.pp_last_layers=3"], 2, "cannot split the remaining -2 blocks"),
        (["parallel.pp=1", "parallel.pp_last_layers=4"], 1, "parallel.pp_last_layers split pipeline stages"),
    ],
)
def test_bad_splits_are_one_line_naming_the_fields(extra, world, needle):
    with pytest.raises(ConfigError) as exc:
        _layout(extra, world)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["parallel.pp_first_layers=-2"], "parallel.pp_first_layers=-2: must be in [-1, 4096]"),
        (["parallel.pp_stage_layers=[-1,5]"], "parallel.pp_stage_layers[0]=-1: must be in [0, 4096]"),
        (["parallel.pp_stage_layers=[a,3]"], "'a' is not an integer"),
    ],
)
def test_bad_values_are_refused_by_the_config(extra, needle):
    with pytest.raises(ConfigError, match=".*") as exc:
        resolve("gpt3-proxy", overrides=[*TINY, *extra], host=False)
    assert needle in str(exc.value)


def test_cut_stage_keeps_the_blocks_of_the_split_and_empty_end_stages():
    import torch

    from scaletrain.model.build import build_model
    from scaletrain.parallel.pipeline import cut_stage, stage_layers

    cfg = resolve("gpt3-proxy", overrides=[*TINY, *INTERLEAVED, "parallel.pp_stage_layers=[0,2,2,0]"], host=False)
    sizes = Layout.from_config(cfg, 2).stage_blocks(4)
    assert [list(stage_layers(4, 4, s, sizes)) for s in range(4)] == [[], [0, 1], [2, 3], []]
    with torch.device("meta"):
        model = build_model(cfg.model)
    first, last = cut_stage(model, 0, 4, sizes), cut_stage(model, 3, 4, sizes)
    assert not list(first.blocks) and first.embed is not None and first.head is None  # the embedding alone
    assert not list(last.blocks) and last.embed is None and last.head is not None and last.ln_f is not None


@pytest.mark.parametrize(
    "extra,world",
    [
        (["parallel.pp_first_layers=1"], 2),
        (["parallel.pp_stage_layers=[4,0]"], 4),
        ([*INTERLEAVED, "parallel.pp_stage_layers=[0,2,2,0]"], 2),
    ],
)
def test_dry_run_of_uneven_stages_counts_what_the_simulator_counts(extra, world, capsys):
    cfg = resolve("gpt3-proxy", overrides=[*TINY, *extra])
    report = dry_run(cfg, world)
    sizes = Layout.from_config(cfg, world).stage_blocks(4)
    assert report["uneven_stages"]
    for rank in report["ranks"]:
        assert rank["stage_blocks"] == [sizes[s] for s in rank["stages"]]
        assert rank["memory_gib"]["layers_on_rank"] == sum(rank["stage_blocks"])
        blocks = {s["name"].split(".")[1] for s in rank["shards"] if s["name"].startswith("blocks.")}
        assert len(blocks) == sum(rank["stage_blocks"])
        assert rank["local_params"] == pytest.approx(rank["sim_local_params"], rel=1e-12), rank["stages"]
    flags = [f"--{o.split('=', 1)[0]}={o.split('=', 1)[1]}" for o in [*TINY, *extra]]
    assert main(["train", "--dry-run", "--world-size", str(world), "--preset", "gpt3-proxy", *flags]) == 0
    out = capsys.readouterr().out
    assert f"layers {sum(report['ranks'][0]['stage_blocks'])} (blocks per stage " in out
    # predict --from-config prices the same split.
    w, lay = sim_inputs(cfg, world)
    # chunks are [rank][chunk]; virtual stage k is rank k % pp, chunk k // pp.
    assert [b for chunk in zip(*lay.chunks(w)) for b in chunk] == sizes


def _predict(capsys, *args):
    code = main(["predict", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_predict_json_carries_the_split(capsys):
    args = ["--model", "llama31-8b", "--gpu", "h100", "--gpus", "64", "--tp", "2", "--pp", "4", "--gbs", "64"]
    _, even = _predict(capsys, *args)
    assert "pp_first_layers" not in even["layout"] and "chunk_layers" not in even["layout"]
    _, p = _predict(capsys, *args, "--pp-first-layers", "5", "--pp-last-layers", "9")
    lay = p["layout"]
    assert (lay["pp_first_layers"], lay["pp_last_layers"], lay["pp_stage_layers"]) == (5, 9, [])
    assert lay["chunk_layers"] == [[5], [9], [9], [9]]
    _, q = _predict(capsys, *args, "--pp-stage-layers", "5,9,9,9")
    assert q["layout"]["chunk_layers"] == [[5], [9], [9], [9]] and q["step_time_s"] == p["step_time_s"]
    assert p["step_time_s"] != even["step_time_s"]  # the uneven stages are priced, not only printed


def test_frontier_layouts_split(capsys):
    # Llama 3.1 405B: TP8 PP16 VP8 with the embedding and the output layer alone on their stages (126 = 128 - 2).
    _, p = _predict(
        capsys,
        *("--model", "llama31-405b", "--gpu", "h100", "--gpus", "8192", "--tp", "8", "--pp", "16", "--vp", "8"),
        *("--pp-first-layers", "0", "--pp-last-layers", "0"),
    )
    assert not any("divide" in r or "split" in r for r in p["reasons"]), p["reasons"]
    assert p["layout"]["chunk_layers"][0] == [0] + [1] * 7 and p["layout"]["chunk_layers"][15] == [1] * 7 + [0]
    # DeepSeek-V3: PP16 over 61 blocks, 3 on the first stage and 2 on the last.
    _, d = _predict(
        capsys,
        *("--model", "deepseek-v3-671b", "--gpu", "h100", "--gpus", "2048", "--pp", "16", "--ep", "64", "--fp8"),
        *("--pp-first-layers", "3", "--pp-last-layers", "2"),
    )
    assert not any("divide" in r or "split" in r for r in d["reasons"]), d["reasons"]
    assert d["layout"]["chunk_layers"] == [[3]] + [[4]] * 14 + [[2]]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--pp", "4", "--pp-stage-layers", "8,8,8"], "has 3 entries, but pp*vp = 4"),
        (["--pp", "4", "--pp-first-layers", "4", "--pp-stage-layers", "8,8,8,8"], "drop --pp-first-layers"),
        (["--pp-first-layers", "4"], "need --pp 2 or more"),
        (["--pp", "4", "--pp-first-layers", "3"], "cannot split the remaining 29 blocks"),
        (["--pp", "4", "--pp-stage-layers", "8,x"], "not a comma-separated list"),
        (["--pp", "4", "--pp-last-layers", "-1"], "must be an integer in [0, 4096]"),
    ],
)
def test_predict_refuses_bad_split_flags_in_one_line(capsys, flags, needle):
    try:
        code = main(["predict", "--model", "llama31-8b", "--gpus", "64", *flags])
    except SystemExit as exc:  # argparse's refusal of a flag's value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_plan_searches_only_the_layouts_the_split_fits_and_runs_them_as_priced(capsys):
    assert main(["plan", "--model", "gpt3-proxy", "--gpus", "8", "--top", "2", "--as-trained", "--json",
                 "--pp-last-layers", "0"]) == 0  # fmt: skip
    best = json.loads(capsys.readouterr().out)
    assert best
    for entry in best:
        lay = entry["layout"]
        assert lay["pp"] >= 2 and lay["pp_last_layers"] == 0 and lay["chunk_layers"][-1][-1] == 0
        assert "parallel.pp_last_layers=0" in entry["train_overrides"] and entry["run_as_priced"]
        args = shlex.split(entry["dry_run_command"])
        assert main([*args[1:], "--json"]) == 0
        dry = json.loads(capsys.readouterr().out)
        assert dry["uneven_stages"] and dry["ranks"][-1]["stage_blocks"][-1] == 0
    assert main(["plan", "--model", "gpt3-proxy", "--gpus", "8", "--pp-stage-layers", "1,1"]) == 2
    assert "sums to 2 blocks, but gpt3-proxy has 4" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt3-proxy", "--gpus", "8", "--pp-first-layers", "9"]) == 2
    assert "fits no pp x vp (vp <= 16) of gpt3-proxy's 4 blocks" in capsys.readouterr().err
    # 5 stages fit only pp 5, which 8 GPUs do not divide: nothing fits, and the plan says why.
    assert main(["plan", "--model", "gpt3-proxy", "--gpus", "8", "--pp-stage-layers", "1,1,1,1,0"]) == 1
    assert (
        "the pipeline depths the uneven split fits (pp [5]) divide no layout of the 8 GPUs" in capsys.readouterr().out
    )
