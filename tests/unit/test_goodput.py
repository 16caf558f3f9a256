"""Goodput under failures (sim/goodput.py): the closed form by hand, the optimum interval, the Monte-Carlo against
the closed form, checkpoint bytes, counts on the command line, `sim goodput` and `sim plot --goodput`."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.cli.main import main
from scaletrain.sim.catalog import CatalogError, load_catalog
from scaletrain.sim.goodput import (
    INTERRUPTIONS_PER_GPU_HOUR,
    MEGATRON_BYTES_PER_PARAM,
    TRAINER_BYTES_PER_PARAM,
    auto_interval,
    checkpoint_bytes,
    daly_interval,
    first_order_overhead,
    monte_carlo,
    plan_goodput,
    segment_wall_s,
    young_interval,
)
from scaletrain.sim.units import format_count, parse_count
from scaletrain.sim.workload import ClusterLayout, load_workload

# 100 h of training on 1,000 GPUs in 125 nodes, 1.25 TB checkpoints at 1 GB/s per node (10 GB per node: 10 s),
# 1e-4 interruptions per GPU-hour (M = 10 h), relaunch 600 s, steps of 10 s.
HAND = dict(
    train_s=360_000.0,
    step_time_s=10.0,
    gpus=1000,
    nodes=125,
    ckpt_bytes=1.25e12,
    storage_gbps=1.0,
    interruptions_per_gpu_hour=1e-4,
)


def test_default_rate_is_llama3_unexpected_interruptions_per_gpu_hour():
    assert INTERRUPTIONS_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    g = plan_goodput(86400.0, 1.0, 16384, 2048, 1e12, 1.0)
    assert g.mtbf_h == pytest.approx(54 * 24 / 419)  # 3.09 h: the job saw 419 in 54 days


def test_closed_form_against_hand_computed_numbers():
    g = plan_goodput(**HAND, relaunch_s=600.0, warmup_s=0.0)
    m = 36_000.0
    assert g.mtbf_h == pytest.approx(10.0)
    assert (g.save_s, g.write_s, g.restore_s, g.restart_s) == pytest.approx((10.0, 10.0, 10.0, 610.0))
    assert g.interval_young_s == pytest.approx(math.sqrt(2 * 10 * m))  # 848.53 s
    # Daly: 848.528 x (1 + sqrt(1/7200)/3 + (1/7200)/9) - 10 = 841.87 s -> 84 steps of 10 s.
    assert g.interval_daly_s == pytest.approx(841.8746, abs=1e-3)
    assert (g.interval_steps, g.interval_s, g.interval_chosen) == (84, 840.0, "daly")
    assert g.save_fraction == pytest.approx(10 / 840)
    assert g.rework_fraction == pytest.approx(420 / m)
    assert g.restart_fraction == pytest.approx(610 / m)
    assert g.goodput_first_order == pytest.approx((1 - 420 / m - 610 / m) / (1 + 10 / 840))

    # 428 segments of 840 s + 10 s save, then 480 s + 10 s; each M e^{R/M} (e^{L/M} - 1).
    def seg(length):
        return m * math.exp(610 / m) * (math.exp(length / m) - 1)

    wall = 428 * seg(850) + seg(490)
    assert g.expected_days == pytest.approx(wall / 86400, rel=1e-12)
    assert g.goodput == pytest.approx(360_000 / wall) and g.lost_fraction == pytest.approx(1 - 360_000 / wall)
    assert g.ideal_days == pytest.approx(360_000 / 86400)
    assert set(g.to_dict()) >= {
        "interruptions_per_gpu_hour",
        "mtbf_h",
        "save_s",
        "restore_s",
        "restart_s",
        "interval_s",
        "interval_steps",
        "goodput",
        "ideal_days",
        "expected_days",
        "lost_fraction",
    }


def test_a_given_interval_and_async_saves():
    g = plan_goodput(**{**HAND, "interval_s": 1234.0})
    assert (g.interval_steps, g.interval_chosen) == (123, "given")
    a = plan_goodput(**HAND, async_save=True, host_copy_gbps=25.0)
    # Only the device-to-host copy of each GPU's 1.25 GB blocks: 0.05 s; the 10 s write goes on behind.
    assert a.save_s == pytest.approx(1.25e9 / 25e9) and a.write_s == pytest.approx(10.0)
    assert a.interval_s >= a.write_s and a.goodput > plan_goodput(**HAND).goodput
    assert a.rework_fraction == pytest.approx((a.interval_s / 2 + 10.0) / 36_000)


def test_young_interval_minimises_the_first_order_overhead_and_daly_the_complete_model():
    save, restart, m = 30.0, 900.0, 4 * 3600.0

    def first_order(tau):
        return sum(first_order_overhead(tau, save, restart, m))

    def wall_per_work(tau):
        return segment_wall_s(tau + save, restart, m) / tau

    grid = [10 * 1.001**k for k in range(8000)]  # 10 s .. 30 h, 0.1% apart
    best = min(grid, key=first_order)
    assert best == pytest.approx(young_interval(save, m), rel=2e-3)
    exact = min(grid, key=wall_per_work)
    assert daly_interval(save, m) == pytest.approx(exact, rel=5e-3)
    assert young_interval(save, m) != pytest.approx(exact, rel=5e-3)  # Daly's correction matters here
    assert daly_interval(3 * m, m) == m  # delta >= 2M: checkpoint once per MTBF


def _big():
    # Llama 3.1 405B's checkpoint on 16,384 GPUs, 50 days of training at 10 s a step.
    w = load_workload("llama31-405b")
    return plan_goodput(50 * 86400.0, 10.0, 16384, 2048, checkpoint_bytes(w, ClusterLayout(gpus=16384)), 0.9765625)


def test_monte_carlo_mean_matches_the_closed_form_within_its_sampling_error():
    runs = 1000
    for g in (_big(), plan_goodput(**HAND), plan_goodput(**HAND, async_save=True)):
        mc = monte_carlo(g, runs, seed=3)
        band = 4 * mc["std_days"] / math.sqrt(runs)  # 4 standard errors of the mean
        assert abs(mc["mean_days"] - g.expected_days) < band, (mc, g.expected_days)
        assert mc["p50_days"] <= mc["p90_days"] and mc["mean_failures"] > 5
        assert abs(mc["mean_failures"] - g.expected_failures) < 4 * math.sqrt(g.expected_failures / runs) + 0.1
    # A wrong closed form fails the same test: the first-order goodput, or one without the restart term.
    g = _big()
    mc = monte_carlo(g, runs, seed=3)
    band = 4 * mc["std_days"] / math.sqrt(runs)
    assert abs(mc["mean_days"] - g.ideal_days / g.goodput_first_order) > band
    no_restart = plan_goodput(50 * 86400.0, 10.0, 16384, 2048, g.ckpt_bytes, 0.9765625, relaunch_s=0.0)
    assert abs(mc["mean_days"] - no_restart.expected_days) > band
    assert monte_carlo(g, 50, seed=3) == monte_carlo(g, 50, seed=3)  # seeded


def test_checkpoint_bytes_from_the_parameter_count():
    w = load_workload("llama31-405b")
    layout = ClusterLayout(gpus=16384, tp=8, pp=16)
    assert checkpoint_bytes(w, layout) == w.inventory.params * MEGATRON_BYTES_PER_PARAM  # ~5.7 TB
    assert 5.5e12 < checkpoint_bytes(w, layout) < 5.9e12
    assert checkpoint_bytes(w, ClusterLayout(gpus=8)) == checkpoint_bytes(w, layout)  # any layout, same bytes
    lora = load_workload("llama2-70b-lora")
    assert lora.inventory.adapter_params > 0
    assert checkpoint_bytes(lora, layout) == lora.inventory.adapter_params * MEGATRON_BYTES_PER_PARAM  # no base
    gpt = load_workload("gpt3-175b")  # tied head: scaletrain's own checkpoints file the embedding twice
    assert gpt.shape.facts.tied_head
    extra = gpt.shape.vocab * gpt.shape.hidden * TRAINER_BYTES_PER_PARAM
    assert checkpoint_bytes(gpt, layout, trainer=True) == gpt.inventory.params * TRAINER_BYTES_PER_PARAM + extra


@pytest.mark.parametrize(
    "text,want",
    [
        ("15.6T", 15_600_000_000_000),
        ("300B", 300 * 10**9),
        ("2.5e12", 2_500_000_000_000),
        ("1,000", 1000),
        ("4k", 4000),
    ],
)
def test_parse_count(text, want):
    assert parse_count(text) == want
    assert parse_count(format_count(want)) == want


@pytest.mark.parametrize("text", ["15.6X", "", "T", "-3B", "nan", "inf", "0"])
def test_parse_count_refuses_with_one_line(text):
    with pytest.raises(ValueError) as info:
        parse_count(text, "--tokens")
    assert "--tokens" in str(info.value) and "\n" not in str(info.value)


def test_auto_interval_in_steps_and_without_a_step_time():
    steps, seconds, line = auto_interval(1.25e12, 1000, 125, 1.0, 10.0, interruptions_per_gpu_hour=1e-4)
    assert (steps, seconds) == (84, 0.0) and "84 steps" in line
    steps, seconds, line = auto_interval(1.25e12, 1000, 125, 1.0, None, interruptions_per_gpu_hour=1e-4)
    assert steps == 0 and seconds == pytest.approx(daly_interval(10.0, 36_000.0)) and "min" in line


def test_catalog_storage_field_default_and_refusal(tmp_path):
    cat = load_catalog()
    assert cat.node("hgx-h100").storage_gbps == pytest.approx(2000 / 2048)
    assert cat.node("dgx-a100").host_copy_gbps == 25.0
    bad = tmp_path / "bad.toml"
    bad.write_text("[nodes.hgx-h100]\nstorage_gbps = 0\n")
    with pytest.raises(CatalogError) as info:
        load_catalog([str(bad)])
    assert "storage_gbps" in str(info.value) and "\n" not in str(info.value)
    good = tmp_path / "good.toml"
    good.write_text("[nodes.hgx-h100]\nstorage_gbps = 12.5\n")
    assert load_catalog([str(good)]).node("hgx-h100").storage_gbps == 12.5


GPT3 = ["--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8", "--gbs", "2048", "--fp8"]


def test_sim_goodput_json_and_text(capsys):
    code = main(["sim", "goodput", *GPT3, "--tokens", "300B", "--runs", "200", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    g, p = doc["goodput"], doc["prediction"]
    assert doc["steps"] == math.ceil(300e9 / (2048 * 2048))
    assert g["ideal_days"] == pytest.approx(doc["steps"] * p["step_time_s"] / 86400)
    assert g["mtbf_h"] == pytest.approx(1 / (INTERRUPTIONS_PER_GPU_HOUR * 1024))
    assert 0.5 < g["goodput"] < 1 and g["expected_days"] > g["ideal_days"]
    assert doc["monte_carlo"]["runs"] == 200 and doc["monte_carlo"]["p90_days"] >= doc["monte_carlo"]["p50_days"]
    assert main(["sim", "goodput", *GPT3, "--tokens", "300B", "--runs", "20", "--async-checkpoint"]) == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "p90" in text and "Young" in text and "background" in text


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--tokens", "15.6X"], "--tokens"),
        (["--tokens", "300B", "--storage-gbps", "0"], "--storage-gbps"),
        (["--tokens", "300B", "--interruptions-per-gpu-hour", "-1"], "--interruptions-per-gpu-hour"),
        (["--tokens", "300B", "--runs", "0"], "--runs"),
        ([], "--tokens"),
    ],
)
def test_sim_goodput_bad_flags_are_one_line(capsys, extra, needle):
    # argparse refuses a bad value (SystemExit 2); a missing --tokens is the command's own one-line error (2).
    try:
        code = main(["sim", "goodput", *GPT3, *extra])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and len([line for line in err if "error" in line]) == 1


def test_sim_goodput_layout_that_cannot_run_is_one_line(capsys):
    code = main(["sim", "goodput", "--gpus", "512", "--tp", "4", "--pp", "7", "--gbs", "2048", "--tokens", "1T"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot run in this layout" in err[0]


def test_sim_plot_goodput_writes_a_png(tmp_path, capsys):
    out = tmp_path / "goodput.png"
    code = main(["sim", "plot", "--goodput", *GPT3, "--tokens", "300B", "--runs", "20", "--out", str(out)])
    assert code == 0 and out.stat().st_size > 20_000 and str(out) in capsys.readouterr().out
    two = ["sim", "plot", "--goodput", "--gpus", "8", "--gpu", "h100", "--gpu", "a100", "--tokens", "1T"]
    assert main(two) == 2
    assert main(["sim", "plot", "--goodput", "--gpus", "8", "--gbs", "8"]) == 2  # no --tokens: one line, exit 2
