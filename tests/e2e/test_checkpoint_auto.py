"""checkpoint.interval_steps = "auto": the trainer takes its checkpoint interval from the failure model
(sim/goodput.py) for the cluster it runs on, and saves at it."""

from __future__ import annotations

import pytest
from test_train_e2e import tiny_config

import scaletrain.train.engine as engine_module
from scaletrain.bench.harness import run_once
from scaletrain.checkpoint.store import complete_checkpoints
from scaletrain.config import ConfigError, resolve
from scaletrain.parallel.layout import Layout
from scaletrain.parallel.sim_layout import sim_layout
from scaletrain.sim.goodput import checkpoint_bytes
from scaletrain.train.engine import Trainer
from scaletrain.train.perf import resolve_auto_interval

STEP_S = 1.0
"""The predicted step time the run is given: the interval in steps then follows from figures the test sets, not
from this machine's measured CPU rates."""


def test_auto_interval_saves_at_the_computed_step_interval(excerpt_corpus, tmp_path, monkeypatch, capfd):
    run = tmp_path / "run"
    base = ["train.eval_interval_samples=16", "train.max_steps=12", "checkpoint.keep=0", "checkpoint.final=false"]
    cfg = tiny_config(excerpt_corpus, run, *base)
    # A failure rate that makes Young's interval sqrt(2 delta M) about 3.5 steps: M = tau^2 / (2 delta).
    w, cluster = sim_layout(cfg, Layout.from_config(cfg, 1))
    delta = checkpoint_bytes(w, cluster, trainer=True) / 100e9  # at 100 GB/s
    rate = 3600.0 / ((3.5 * STEP_S) ** 2 / (2 * delta))
    cfg = tiny_config(
        excerpt_corpus,
        run,
        *base,
        "checkpoint.interval_steps=auto",
        "checkpoint.storage_gbps=100",
        f"checkpoint.interruptions_per_gpu_hour={rate}",
    )
    start_run = engine_module.start_run

    def fixed_step(trainer):
        doc = start_run(trainer)
        doc.pop("error", None)
        doc["step_time_s"] = STEP_S
        return doc

    monkeypatch.setattr(engine_module, "start_run", fixed_step)
    trainer = Trainer(cfg, run)
    run_once(cfg, trainer, run)
    steps, seconds, line = resolve_auto_interval(cfg, trainer.layout, trainer.prediction)
    assert 2 <= steps <= 5 and seconds == 0.0 and trainer.checkpointer.interval_steps == steps
    assert line in capfd.readouterr().err  # the chosen interval is logged
    # An evaluation every step: a save every `steps` steps (without "auto" there is none: interval_steps 0).
    saved = [int(p.name.split("_")[1]) for p in complete_checkpoints(run / "checkpoints")]
    assert saved == list(range(steps, 13, steps))


def test_auto_interval_without_a_prediction_uses_the_time_trigger(excerpt_corpus, tmp_path):
    cfg = tiny_config(excerpt_corpus, tmp_path / "run", "checkpoint.interval_steps=auto")
    layout = Layout.from_config(cfg, 1)
    steps, seconds, line = resolve_auto_interval(cfg, layout, {"error": "no prediction"})
    assert steps == 0 and seconds > 0 and "wall time" in line


@pytest.mark.parametrize("value", ["auto", "'auto'", "5"])
def test_interval_steps_takes_auto_or_a_number(value):
    cfg = resolve("gpt3-proxy", overrides=[f"checkpoint.interval_steps={value}"], host=False)
    assert cfg.checkpoint.interval_steps == ("auto" if "auto" in value else 5)


def test_interval_steps_auto_from_toml_and_bad_words(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[checkpoint]\ninterval_steps = "auto"\n')
    assert resolve("gpt3-proxy", str(toml), host=False).checkpoint.interval_steps == "auto"
    for bad in ("sometimes", "-1", "1.5"):
        with pytest.raises(ConfigError) as info:
            resolve("gpt3-proxy", overrides=[f"checkpoint.interval_steps={bad}"], host=False)
        assert "checkpoint.interval_steps" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="checkpoint.storage_gbps"):
        resolve("gpt3-proxy", overrides=["checkpoint.storage_gbps=0"], host=False)


def test_auto_interval_on_a_catalog_gpu_uses_its_node():
    auto = ["checkpoint.interval_steps=auto", "train.micro_batch_size=1"]
    cfg = resolve("gpt3-proxy", overrides=auto, host=False)
    layout = Layout.from_config(cfg, 16)
    cuda = {"device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "catalog_key": "h100"}, "step_time_s": 0.5}
    steps, seconds, line = resolve_auto_interval(cfg, layout, cuda)
    # 16 H100s fill 2 HGX nodes at the catalog's 0.98 GB/s each: the line names both.
    assert steps >= 1 and seconds == 0.0 and "over 2 node(s) at 0.977 GB/s" in line and "x 16 GPUs" in line
    faster = resolve("gpt3-proxy", overrides=[*auto, "checkpoint.storage_gbps=9.5"], host=False)
    assert "at 9.5 GB/s" in resolve_auto_interval(faster, layout, cuda)[2]
