"""Config resolution, validation messages, and the gpt3 LR rule."""

import json
import math

import pytest

from scaletrain.config import Config, ConfigError, describe, from_dict, list_presets, resolve
from scaletrain.train.optim import lr_at


def test_presets_resolve_and_roundtrip(tmp_path):
    assert {"gpt3-proxy", "gpt3-125m", "gpt3-1.3b", "gpt3-175b"} <= set(list_presets())
    for name in list_presets():
        cfg = resolve(name)
        path = cfg.save(tmp_path / name)
        assert from_dict(json.loads(path.read_text())) == cfg


def test_overrides_and_config_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nseed = 5\n[model]\nn_layers = 3\n")
    cfg = resolve("gpt3-proxy", str(f), ["train.seed=9", "optim.lr=3e-4", "train.dtype=fp32", "train.progress=false"])
    assert (cfg.train.seed, cfg.model.n_layers, cfg.optim.lr, cfg.train.dtype) == (9, 3, 3e-4, "fp32")
    assert cfg.train.progress is False


@pytest.mark.parametrize(
    "preset,overrides,message",
    [
        ("nope", [], "unknown preset 'nope'"),
        ("gpt3-proxy", ["train.sed=1"], "unknown field 'train.sed'"),
        ("gpt3-proxy", ["train.seed"], "expected KEY=VALUE"),
        ("gpt3-proxy", ["train.seed=abc"], "train.seed='abc' is not a valid int"),
        ("gpt3-proxy", ["model.n_heads=3"], "model.n_heads=3: must divide model.d_model=256"),
        ("gpt3-proxy", ["train.global_batch_size=30"], "must be a multiple of train.micro_batch_size=16"),
        ("gpt3-proxy", ["train.dtype=fp16"], "train.dtype='fp16'"),
        ("gpt3-proxy", ["bench.benchmark=bert"], "bench.benchmark='bert'"),
        ("gpt3-proxy", ["train=3"], "'train' is a section"),
    ],
)
def test_bad_config_is_one_clear_line(preset, overrides, message):
    with pytest.raises(ConfigError) as info:
        resolve(preset, None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="no such file"):
        resolve("gpt3-proxy", "/nonexistent.toml")


def test_every_field_documented():
    rows = describe(Config)
    assert len(rows) > 30
    assert all(doc for _, _, doc in rows), [name for name, _, doc in rows if not doc]


def test_gpt3_lr_rule_at_gbs_2048():
    o = resolve("gpt3-175b").optim
    gbs = 2048
    assert (o.warmup_steps(gbs), o.decay_steps(gbs), o.init_checkpoint_step(gbs)) == (199, 81450, 3000)
    assert lr_at(1, o, gbs) == pytest.approx(2e-5 / 199)
    assert lr_at(199, o, gbs) == pytest.approx(2e-5)
    # The benchmark's first step is past warm-up: ~0.997 * base, as the reference schedule gives.
    first = lr_at(3001, o, gbs)
    expected = 2e-6 + 1.8e-5 * 0.5 * (1 + math.cos(math.pi * (3001 - 199) / (81450 - 199)))
    assert first == pytest.approx(expected, rel=1e-12)
    assert first / 2e-5 == pytest.approx(0.9973, abs=1e-4)
    assert lr_at(81450, o, gbs) == pytest.approx(2e-6)
    assert lr_at(90000, o, gbs) == pytest.approx(2e-6)
    mid = (199 + 81450) / 2
    assert lr_at(int(mid), o, gbs) == pytest.approx(1.1e-5, rel=1e-3)
