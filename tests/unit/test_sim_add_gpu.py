"""Adding a GPU is one catalog entry (and its node): a --catalog file prices a made-up GPU through `predict` and
`plan` with no Python edit, its generation picking the fitted efficiency set, and a bad entry is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli.main import main

# A copy of the shipped h100 and hgx-h100 under new keys, except a peak of its own: the generation (hopper) and
# the node come from the entry, so it must price exactly as h100 but for the MFU denominator.
FAKE = """
[gpus.zz9]
name = "Made-up ZZ9 SXM"
bf16_tflops = 1234.0
fp8_tflops = 1979.0
matmul_bf16_tflops = 795.0
matmul_fp8_tflops = 1400.0
attn_tflops = 480.0
hbm_gb = 80.0
hbm_tbps = 3.35
hbm_copy_tbps = 2.95
nvlink_gbps = 450.0
kernel_us = 5.0
source = "test"
generation = "{generation}"
default_node = "zz9-box"

[nodes.zz9-box]
name = "Eight ZZ9"
gpu = "zz9"
gpus_per_node = 8
nvlink_domain = 8
nvlink_busbw_gbps = 365.0
nvls_busbw_gbps = 470.0
nics = 8
fabric = "ib-ndr"
source = "test"
"""

PREDICT = ["predict", "--model", "llama31-8b", "--gpus", "64", "--tp", "2", "--json"]
PLAN = ["plan", "--model", "llama31-8b", "--gpus", "16", "--top", "1", "--json"]


@pytest.fixture(autouse=True)
def _no_user_catalog(monkeypatch):
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)


def _run(capsys, argv: list[str]):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def _catalog(tmp_path, generation: str = "hopper", text: str = FAKE) -> str:
    path = tmp_path / "zz9.toml"
    path.write_text(text.format(generation=generation))
    return str(path)


def test_a_catalog_entry_is_priced_by_predict_and_plan(tmp_path, capsys):
    cat = _catalog(tmp_path)
    code, fake = _run(capsys, [*PREDICT, "--gpu", "zz9", "--catalog", cat])
    _, h100 = _run(capsys, [*PREDICT, "--gpu", "h100"])
    assert code == 0 and (fake["gpu"], fake["node"]) == ("zz9", "zz9-box")
    assert fake["mfu_peak_tflops"] == 1234.0
    assert fake["mfu"] == pytest.approx(h100["mfu"] * 989.0 / 1234.0, rel=1e-12)
    # Its generation's set, as h100 (hopper's reference SKU, no multiplier) gets it: the same step to the bit.
    assert fake["calibration"] == h100["calibration"] and "hopper" in fake["calibration"]
    assert fake["step_time_s"] == h100["step_time_s"]
    code, plans = _run(capsys, [*PLAN, "--gpu", "zz9", "--catalog", cat])
    _, h100_plans = _run(capsys, [*PLAN, "--gpu", "h100"])
    assert code == 0 and plans[0]["gpu"] == "zz9" and plans[0]["mfu_peak_tflops"] == 1234.0
    assert plans[0]["layout"] == h100_plans[0]["layout"]
    assert plans[0]["step_time_s"] == h100_plans[0]["step_time_s"]


def test_the_generation_in_the_entry_picks_the_fitted_set(tmp_path, capsys):
    _, fake = _run(capsys, [*PREDICT, "--gpu", "zz9", "--catalog", _catalog(tmp_path, "blackwell")])
    _, b200 = _run(capsys, [*PREDICT, "--gpu", "b200"])
    assert fake["calibration"] == b200["calibration"] and "blackwell" in fake["calibration"]


@pytest.mark.parametrize(
    "generation, text, message",
    [
        ("tpu9", FAKE, "gpu 'zz9' names unknown generation 'tpu9'; known: ampere, blackwell"),
        ("hopper", FAKE.replace("hbm_gb = 80.0\n", ""), "[gpus.zz9] missing fields ['hbm_gb']"),
        ("hopper", FAKE.replace('generation = "{generation}"\n', ""), "[gpus.zz9] missing fields ['generation']"),
        ("hopper", FAKE.replace('default_node = "zz9-box"', 'default_node = "hgx-h100"'), "a node of 'h100' GPUs"),
    ],
    ids=["unknown-generation", "missing-field", "no-generation", "foreign-node"],
)
@pytest.mark.parametrize("command", [PREDICT, PLAN], ids=["predict", "plan"])
def test_a_bad_entry_is_one_line_and_exit_2(tmp_path, capsys, command, generation, text, message):
    cat = _catalog(tmp_path, generation, text)
    assert main([*command, "--gpu", "zz9", "--catalog", cat]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and cat in err and message in err, err


@pytest.mark.parametrize("command", [PREDICT, PLAN], ids=["predict", "plan"])
def test_an_unknown_gpu_key_is_one_line_and_exit_2(capsys, command):
    assert main([*command, "--gpu", "zz9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown gpu 'zz9'; known: a100" in err, err
