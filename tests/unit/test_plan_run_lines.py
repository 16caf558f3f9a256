"""`plan` prints how to run its best layouts: the `train --set` overrides, fed to `train --dry-run`, give the layout
the plan priced (degrees, virtual stages, memory from the same model), and a Slurm line for scripts/slurm/train.sbatch."""

import json
import shlex

import pytest

from scaletrain.cli.main import main
from scaletrain.cli.run_lines import run_lines, slurm_command

LORA_512 = ["--model", "llama2-70b-lora", "--gpu", "h200", "--gpus", "512"]


def _plan(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _dry_run(capsys, plan_entry):
    args = shlex.split(plan_entry["dry_run_command"])
    assert args[:3] == ["scaletrain", "train", "--dry-run"]
    assert main([*args[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _assert_same_layout(lay, dry):
    deg = dry["degrees"]
    assert (deg["tp"], deg["pp"], deg["cp"], deg["dp_replicate"] * deg["dp_shard"]) == (
        lay["tp"],
        lay["pp"],
        lay["cp"],
        lay["dp"],
    )
    assert len(dry["ranks"][0]["stages"]) == lay["vp"]  # virtual stages per pipeline rank
    assert dry["fits"]
    # One memory model; with pipelining the plan's in-flight count comes from the simulated schedule.
    assert dry["max_memory_gib"] == pytest.approx(lay["memory_gib_per_gpu"], rel=1e-9 if lay["pp"] == 1 else 0.02)


def test_lora_record_plan_as_trained_runs_as_priced(capsys):
    best = _plan(capsys, *LORA_512, "--top", "1", "--as-trained")[0]
    lay = best["layout"]
    assert best["run_as_priced"] and "run_differs" not in best and lay["zero"] == 3 and not lay["bf16_grads"]
    assert best["train_overrides"][:2] == [f"parallel.tp={lay['tp']}", f"parallel.pp={lay['pp']}"]
    assert best["slurm_command"].startswith("sbatch --nodes 64 scripts/slurm/train.sbatch train --preset llama2-70b")
    _assert_same_layout({**lay, "memory_gib_per_gpu": best["memory_gib_per_gpu"]}, _dry_run(capsys, best))


def test_proxy_plan_overrides_reproduce_each_layout(capsys):
    for best in _plan(capsys, "--model", "gpt3-proxy", "--gpus", "8", "--top", "2", "--as-trained"):
        assert best["run_as_priced"]
        _assert_same_layout(
            {**best["layout"], "memory_gib_per_gpu": best["memory_gib_per_gpu"]}, _dry_run(capsys, best)
        )


def test_plan_table_prints_run_and_slurm_lines_and_what_the_trainer_changes(capsys):
    assert main(["plan", *LORA_512, "--top", "1"]) == 0
    out = capsys.readouterr().out
    run = next(ln for ln in out.splitlines() if ln.startswith("  run: "))
    assert run.startswith("  run: scaletrain train --preset llama2-70b-lora --set parallel.tp=")
    assert "--set train.global_batch_size=" in run and "--set train.fp8=" in run
    assert "  slurm: sbatch --nodes 64 scripts/slurm/train.sbatch train --preset llama2-70b-lora" in out
    # The default plan prices Megatron's distributed optimizer (ZeRO-1, bf16 gradients under FP8); the trainer
    # shards with FSDP, and the plan says so.
    assert "  trained as: zero 1->3" in out and "plan --as-trained" in out


def test_run_lines_for_other_nodes_and_what_the_trainer_cannot_run():
    lay = {
        "gpus": 72,
        "tp": 2,
        "pp": 1,
        "vp": 1,
        "cp": 1,
        "dp": 36,
        "mbs": 1,
        "gbs": 72,
        "recompute": "none",
        "fp8": True,
        "sp": False,
    }
    lines = run_lines("llama2_70b_lora", ["lora.rank=8"], lay, "gb200", 4)
    assert lines["train_overrides"][:3] == ["lora.rank=8", "parallel.tp=2", "parallel.pp=1"]
    assert "parallel.sequence_parallel=false" in lines["train_overrides"]
    assert lines["slurm_command"].startswith(
        "NPROC_PER_NODE=4 sbatch --nodes 18 --gpus-per-node=4 scripts/slurm/train.sbatch train --preset llama2-70b-lora"
    )
    assert slurm_command(12, 8, ["train"]) is None and slurm_command(4, 8, ["train"]).startswith(
        "NPROC_PER_NODE=4 sbatch --nodes 1 --gpus-per-node=4"
    )
    assert "FP4" in run_lines("gpt3", [], {**lay, "fp4": True}, "gb200", 4)["run_error"]
