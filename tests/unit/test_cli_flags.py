"""`--section.field` flags for every config section, boolean flags, `config --fields` values, `bench` parsing."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.cli.main import build_parser, cmd_bench, cmd_bench_check, expand_field_flags, main
from scaletrain.config import Config, ConfigError


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name))]


def test_every_config_section_takes_field_flags():
    # Derived from the dataclass, so a section added later is covered without editing this test.
    sections = _sections()
    assert {"lora", "checkpoint", "model", "parallel"} <= set(sections)
    for section in sections:
        name = dataclasses.fields(getattr(Config(), section))[0].name
        assert expand_field_flags(["train", f"--{section}.{name}", "7"]) == ["train", "--set", f"{section}.{name}=7"]


def test_lora_and_checkpoint_flags_reach_the_config(capsys):
    code = main(["config", "--lora.rank", "8", "--checkpoint.keep", "5", "--checkpoint.verify=size"])
    out = capsys.readouterr().out
    assert code == 0 and '"rank": 8' in out and '"keep": 5' in out and '"verify": "size"' in out


def test_boolean_flag_alone_means_true_and_keeps_the_next_flag():
    assert expand_field_flags(["train", "--train.compile", "--set", "x=y"]) == [
        "train",
        "--set",
        "train.compile=true",
        "--set",
        "x=y",
    ]
    assert expand_field_flags(["train", "--train.compile"]) == ["train", "--set", "train.compile=true"]
    assert expand_field_flags(["train", "--train.compile", "false", "--run-dir", "r"]) == [
        "train",
        "--set",
        "train.compile=false",
        "--run-dir",
        "r",
    ]
    assert expand_field_flags(["train", "--checkpoint.async_save", "--parallel.tp", "2"]) == [
        "train",
        "--set",
        "checkpoint.async_save=true",
        "--set",
        "parallel.tp=2",
    ]


def test_boolean_flag_resolves_to_true(capsys):
    assert main(["config", "--train.compile", "--set", "train.seed=9"]) == 0
    out = capsys.readouterr().out
    assert '"compile": true' in out and '"seed": 9' in out


@pytest.mark.parametrize("argv", [["train", "--optim.lr"], ["train", "--optim.lr", "--set", "x=y"]])
def test_non_boolean_flag_without_value_is_an_error(argv):
    with pytest.raises(ConfigError, match="--optim.lr: missing value"):
        expand_field_flags(argv)


def _fields(capsys, *argv) -> dict[str, str]:
    assert main(["config", "--fields", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {ln.split()[0]: ln.split()[1] for ln in lines[1:]}, lines[0]


def test_config_fields_show_the_preset_values(capsys):
    rows, header = _fields(capsys)
    # gpt3-proxy's values, not the dataclass defaults (lr 2e-05, target 2.69, benchmark gpt3)
    assert "gpt3-proxy" in header
    assert rows["optim.lr"] == "0.001" and rows["bench.benchmark"] == "'gpt3-proxy'"
    assert rows["train.target_eval_loss"] == "5.9"
    rows, header = _fields(capsys, "--preset", "gpt3-175b")
    assert "gpt3-175b" in header and rows["model.n_layers"] == "96" and rows["optim.lr"] == "2e-05"
    rows, _ = _fields(capsys, "--preset", "llama2-70b-lora-proxy", "--set", "lora.rank=4")
    assert rows["lora.rank"] == "4" and rows["model.arch"] == "'llama'"


def test_bench_without_check_still_parses_as_the_benchmark():
    args = build_parser().parse_args(
        [
            "bench",
            "--preset",
            "gpt3-proxy",
            "--runs",
            "1",
            "--benchmark",
            "gpt3-proxy",
            "--out",
            "x",
            "--set",
            "train.seed=3",
        ]
    )
    assert args.func is cmd_bench and args.runs == 1 and args.benchmark == "gpt3-proxy" and args.out == "x"
    assert build_parser().parse_args(["bench"]).func is cmd_bench
    args = build_parser().parse_args(["bench", "check", "run_0/mllog.txt", "--benchmark", "gpt3"])
    assert args.func is cmd_bench_check and args.log == "run_0/mllog.txt" and args.check_benchmark == "gpt3"
