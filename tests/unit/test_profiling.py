"""Profiling on demand without a training run: the config fields, which steps a StepProfiler traces (resume, early
end, ranks), the CPU memory-snapshot warning and the pickle-free memory summary; the W&B sink's lazy import."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.config import ConfigError, TrainConfig, from_dict, parse_ranks, parse_step_range, resolve
from scaletrain.train.profiling import StepProfiler, memory_summary
from scaletrain.train.sinks import WandbSink, optional_sinks, scalars_of


@pytest.mark.parametrize(
    "text, want", [("", None), ("7", (7, 7)), ("10-12", (10, 12)), (" 3 - 5 ", (3, 5)), ("1-1", (1, 1))]
)
def test_profile_steps_parse(text, want):
    assert parse_step_range(text) == want


@pytest.mark.parametrize("text", ["12-10", "x", "-3", "0", "0-2", "1-2-3", "3-", "1.5", "²"])
def test_bad_profile_steps_are_one_line_config_errors(text):
    with pytest.raises(ConfigError, match=r"^train\.profile_steps=") as err:
        resolve("gpt3-proxy", overrides=[f"train.profile_steps={text}"])
    assert "\n" not in str(err.value)


def test_profile_ranks():
    assert parse_ranks("all") is None and parse_ranks("0") == {0}
    # --set train.profile_ranks=0,3 arrives as a Python literal, a TOML list as its text: both mean ranks 0 and 3.
    assert parse_ranks(resolve("gpt3-proxy", overrides=["train.profile_ranks=0,3"]).train.profile_ranks) == {0, 3}
    assert parse_ranks("[0, 3]") == {0, 3}
    for bad in ("x", "-1", "0,,1", "", "1;2"):
        with pytest.raises(ConfigError, match=r"^train\.profile_ranks="):
            resolve("gpt3-proxy", overrides=[f"train.profile_ranks='{bad}'"])


def test_wandb_needs_its_extra(monkeypatch):
    cfg = resolve("gpt3-proxy")
    assert optional_sinks(cfg, "unused") == []  # off by default: wandb is never imported
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    with pytest.raises(ConfigError, match=r"^train\.wandb_project needs wandb, the \[wandb\] extra"):
        resolve("gpt3-proxy", overrides=["train.wandb_project=p"])
    # A finished run's config.json reads back without wandb (sim calibrate); training it again says the same.
    cfg.train.wandb_project = "p"
    assert from_dict(cfg.to_dict()).train.wandb_project == "p"
    with pytest.raises(ConfigError, match=r"^train\.wandb_project needs wandb"):
        WandbSink(cfg, Path("unused"))


def test_scalars_of_keeps_numbers_only():
    record = {"time": 1.0, "step": 3, "loss": 2.5, "world_size": 1, "mfu_peak": "H100 989", "gpu": "H100"}
    assert scalars_of(record) == {"loss": 2.5, "world_size": 1}


def _trace(train: TrainConfig, run_dir, steps, rank=0):
    prof = StepProfiler(train, run_dir, rank=rank)
    for n in steps:
        with prof.step(n):
            torch.ones(4).mul_(n)  # one op per step, so each step has events
    prof.close()
    return prof


def _step_marks(path):
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_trace_steps_follow_resume_and_early_end(tmp_path):
    train = TrainConfig(profile_steps="3-5")
    resumed = _trace(train, tmp_path / "resumed", range(4, 9))  # resumed at step 3: steps 4 and 5 only
    assert [p.name for p in resumed.files] == ["trace_rank0_steps4-5.pt.trace.json"]
    assert _step_marks(resumed.files[0]) == [4, 5]
    early = _trace(train, tmp_path / "early", range(1, 5))  # the run ended after step 4: close() writes 3-4
    assert [p.name for p in early.files] == ["trace_rank0_steps3-4.pt.trace.json"]
    assert _step_marks(early.files[0]) == [3, 4]
    assert _trace(train, tmp_path / "past", range(6, 9)).files == []  # resumed after the range: nothing
    assert not (tmp_path / "past" / "profile").exists()


def test_only_chosen_ranks_profile(tmp_path):
    assert not StepProfiler(TrainConfig(profile_steps="1", profile_ranks="1,2"), tmp_path, rank=0).enabled
    assert StepProfiler(TrainConfig(profile_steps="1", profile_ranks="1,2"), tmp_path, rank=2).enabled
    assert StepProfiler(TrainConfig(profile_steps="1", profile_ranks="all"), tmp_path, rank=5).enabled
    assert not StepProfiler(TrainConfig(), tmp_path).enabled  # the default: off


def test_memory_snapshot_on_cpu_warns_and_continues(tmp_path, capsys):
    prof = _trace(TrainConfig(memory_snapshot=True), tmp_path, range(1, 4))
    err = capsys.readouterr().err
    assert "scaletrain: warning: train.memory_snapshot: memory snapshots need CUDA" in err
    assert not prof.enabled and prof.files == [] and not (tmp_path / "profile").exists()


def test_memory_summary_is_plain_json():
    frame = {"filename": "/x/scaletrain/model/gpt.py", "line": 42, "name": "forward"}
    snapshot = {
        "segments": [
            {
                "total_size": 4096,
                "blocks": [{"size": 1024, "state": "active_allocated"}, {"size": 3072, "state": "inactive"}],
            }
        ],
        "device_traces": [
            [
                {"action": "alloc", "size": 512, "frames": [{"filename": "torch/nn.py", "line": 1, "name": "f"}]},
                {"action": "free_requested", "size": 512, "frames": []},
                {
                    "action": "alloc",
                    "size": 2048,
                    "frames": [{"filename": "torch/a.py", "line": 9, "name": "g"}, frame],
                },
            ]
        ],
    }
    peaks = {"max_allocated_bytes": 3000, "max_reserved_bytes": 4096}
    summary = memory_summary(snapshot, peaks, [2, 3, 4], "memory_snapshot_rank0.UNTRUSTED.pickle")
    assert json.loads(json.dumps(summary)) == summary
    assert summary["steps"] == [2, 4] and summary["max_allocated_bytes"] == 3000
    assert summary["reserved_bytes_at_dump"] == 4096 and summary["allocated_bytes_at_dump"] == 1024
    assert summary["alloc_events"] == 2
    assert summary["top_allocations"] == [
        {"size_bytes": 2048, "frame": "/x/scaletrain/model/gpt.py:42 forward"},
        {"size_bytes": 512, "frame": "torch/nn.py:1 f"},
    ]


def test_memory_history_spans_the_first_steps_without_profile_steps(tmp_path, monkeypatch):
    """The CUDA path's bookkeeping with the allocator API faked (this machine has no GPU; the real one is below)."""
    calls = []
    memory = torch.cuda.memory
    monkeypatch.setattr(
        memory, "_record_memory_history", lambda enabled="all", **kw: calls.append(("history", enabled))
    )
    monkeypatch.setattr(memory, "_snapshot", lambda device=None: {"segments": [], "device_traces": [[]]})
    monkeypatch.setattr(memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8)
    prof = StepProfiler(
        TrainConfig(memory_snapshot=True, profile_ranks="2"), tmp_path, rank=2, device=torch.device("cuda", 0)
    )
    for n in range(11, 16):  # a run resumed at step 10: the history covers steps 11-13
        with prof.step(n):
            calls.append(("step", n))
    prof.close()
    assert calls == [
        ("history", "all"),
        ("step", 11),
        ("step", 12),
        ("step", 13),
        ("dump", "memory_snapshot_rank2.UNTRUSTED.pickle"),
        ("history", None),
        ("step", 14),
        ("step", 15),
    ]
    summary = json.loads((tmp_path / "profile" / "memory_snapshot_rank2.json").read_text())
    assert summary["steps"] == [11, 13] and summary["max_reserved_bytes"] == 8
    assert summary["snapshot_file"] == "memory_snapshot_rank2.UNTRUSTED.pickle"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trace_and_memory_snapshot(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    prof = StepProfiler(TrainConfig(profile_steps="2-3", memory_snapshot=True), tmp_path, device=device)
    for n in range(1, 5):
        with prof.step(n):
            x = torch.randn(1024, 1024, device=device)
            (x @ x).sum().item()
    prof.close()
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == [
        "memory_snapshot_rank0.UNTRUSTED.pickle",
        "memory_snapshot_rank0.json",
        "trace_rank0_steps2-3.pt.trace.json",
    ]
    summary = json.loads((out / "memory_snapshot_rank0.json").read_text())
    assert summary["steps"] == [2, 3] and summary["max_allocated_bytes"] >= 4 * 1024 * 1024
    assert summary["alloc_events"] >= 2 and summary["top_allocations"][0]["size_bytes"] >= 4 * 1024 * 1024
    events = json.loads((out / "trace_rank0_steps2-3.pt.trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity is traced on a GPU
    assert _step_marks(out / "trace_rank0_steps2-3.pt.trace.json") == [2, 3]
