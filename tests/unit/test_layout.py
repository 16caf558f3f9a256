"""Parallel layouts: degree arithmetic, one clear message per violation, CLI flags, and the dry run at scale."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli.main import expand_field_flags, main
from scaletrain.config import resolve
from scaletrain.parallel.layout import Layout, LayoutError

TINY = [
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.seq_len=32",
    "model.vocab_size=1000",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
]


def layout(world, *over):
    return Layout.from_config(resolve("gpt3-proxy", overrides=[*TINY, *over]), world)


def test_dp_shard_fills_the_world_and_kinds():
    assert layout(8, "parallel.tp=2").dp_shard == 4
    assert layout(8, "parallel.tp=2").data_parallel_kind == "fsdp"
    assert layout(4, "parallel.dp_replicate=4", "parallel.dp_shard=1").data_parallel_kind == "ddp"
    assert layout(4, "parallel.dp_replicate=2", "parallel.dp_shard=2").data_parallel_kind == "hsdp"
    assert layout(4, "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.tp=2").data_parallel_kind == "hsdp"
    assert layout(2, "parallel.cp=2").data_parallel_kind == "fsdp"  # cp ranks share weights: FSDP over them
    assert layout(1).data_parallel_kind == "none"
    lay = layout(16, "parallel.tp=2", "parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b")
    assert (lay.dp, lay.num_stages) == (4, 4)
    assert lay.describe() == "pp2(v2,interleaved_1f1b) x dp_shard4 x tp2(sp) = 16 ranks"


@pytest.mark.parametrize(
    "world,over,needle",
    [
        (2, ["parallel.tp=3", "parallel.dp_shard=1"], "tp=3 does not divide model.n_heads=4"),
        (5, ["parallel.pp=5", "parallel.dp_shard=1"], "divide neither model.n_layers=4 nor 4 + 2"),
        (8, ["parallel.tp=2", "parallel.dp_shard=2"], "= 4, but the world size is 8"),
        (6, ["parallel.tp=4"], "do not divide the world size 6"),
        (2, ["parallel.cp=2", "model.seq_len=30"], "does not split into 2*cp=4 equal chunks"),
        (8, ["parallel.cp=2", "parallel.tp=4", "model.seq_len=36"], "is not a multiple of parallel.tp=4"),
        (2, ["parallel.pp=2", "parallel.pp_virtual=2"], "needs parallel.pp_schedule='interleaved_1f1b'"),
        (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_virtual >= 2"),
        (2, ["parallel.pp=2", "train.global_batch_size=2"], "need at least pp=2"),
        (3, ["parallel.dp_shard=3"], "not a multiple of the data-parallel size 3"),
        (2, ["parallel.tp=2", "model.vocab_size=999", "model.vocab_multiple=1"], "padded vocabulary 999"),
    ],
)
def test_bad_layouts_name_the_problem(world, over, needle):
    with pytest.raises(LayoutError) as err:
        layout(world, *over)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_field_flags_expand_to_overrides():
    assert expand_field_flags(["train", "--parallel.tp", "2", "--train.seed=3", "--run-dir", "x"]) == [
        "train",
        "--set",
        "parallel.tp=2",
        "--set",
        "train.seed=3",
        "--run-dir",
        "x",
    ]


def test_cli_rejects_bad_layout_before_any_work(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--parallel.tp", "3", "--set", f"train.run_dir={run}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("scaletrain: error:") and "tp=3" in err and len(err.splitlines()) == 1
    assert not run.exists()


def test_dry_run_gpt3_175b_at_10752_gpus(capsys):
    code = main(
        [
            "train",
            "--dry-run",
            "--json",
            "--world-size",
            "10752",
            "--preset",
            "gpt3-175b",
            "--parallel.tp",
            "4",
            "--parallel.pp",
            "8",
            "--parallel.pp_virtual",
            "12",
            "--parallel.pp_schedule",
            "interleaved_1f1b",
            "--train.global_batch_size",
            "2688",
            "--train.micro_batch_size",
            "1",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["fits"] and report["degrees"]["dp_shard"] == 336
    first, last = report["ranks"]
    assert first["stages"] == list(range(0, 96, 8)) and last["stages"] == list(range(7, 96, 8))
    shards = {s["name"]: s for s in first["shards"]}
    # Vocabulary-parallel embedding split 4 ways by TP, then dim 0 split 336 ways by FSDP (ceil chunks).
    assert shards["embed.tok.weight"]["local"] == [39, 12288]
    assert shards["blocks.0.mlp.proj.weight"]["global"] == [12288, 49152]
    assert "head.weight" in {s["name"] for s in last["shards"]}
    assert 10 < report["max_memory_gib"] < 80


def test_dry_run_rejects_what_cannot_fit_or_divide(capsys):
    assert (
        main(["train", "--dry-run", "--world-size", "512", "--preset", "gpt3-175b", "--train.micro_batch_size", "1"])
        == 2
    )
    assert "needs ~" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--dry-run",
                "--world-size",
                "10752",
                "--preset",
                "gpt3-175b",
                "--parallel.tp",
                "4",
                "--parallel.pp",
                "8",
                "--parallel.pp_virtual",
                "12",
                "--parallel.pp_schedule",
                "interleaved_1f1b",
            ]
        )
        == 2
    )
    assert "not a multiple of the data-parallel size 336" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--dry-run",
                "--world-size",
                "512",
                "--preset",
                "gpt3-175b",
                "--parallel.tp",
                "4",
                "--parallel.pp",
                "8",
                "--train.micro_batch_size",
                "1",
                "--gpu",
                "h200",
            ]
        )
        == 0
    )


def test_trainer_takes_llama_and_lora():
    from scaletrain.config import resolve

    assert Layout.from_config(resolve("llama2-70b", overrides=["parallel.tp=8"]), 8).tp == 8  # Llama built
    assert Layout.from_config(resolve("gpt3-proxy", overrides=["lora.rank=4"]), 1).world_size == 1  # LoRA built


def test_uneven_pipeline_split_counts_embedding_and_loss_as_layers():
    from scaletrain.parallel.layout import stage_sizes
    from scaletrain.parallel.pipeline import stage_layers

    # NVIDIA's llama31_405b layout: 126 blocks in pp8 x vp8 = 64 stages, Megatron's embedding/loss accounting.
    sizes = stage_sizes(126, 64)
    assert sizes is not None and sizes[0] == sizes[-1] == 1 and set(sizes[1:-1]) == {2} and sum(sizes) == 126
    assert list(stage_layers(126, 64, 0)) == [0] and list(stage_layers(126, 64, 63)) == [125]
    assert [b for s in range(64) for b in stage_layers(126, 64, s)] == list(range(126))
    assert stage_sizes(4, 3) == [1, 2, 1] and stage_sizes(4, 4) == [1] * 4
    assert stage_sizes(4, 5) is None and stage_sizes(2, 4) is None  # an end stage would hold no block
    Layout.from_config(resolve("gpt3-proxy", overrides=["parallel.pp=3", "train.micro_batch_size=8"]), 3)
