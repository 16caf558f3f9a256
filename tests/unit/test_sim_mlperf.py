"""MLPerf convergence arithmetic: RCP means, evaluation cadence, skipped evaluations, scoring."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.sim import mlperf
from scaletrain.sim.fit.results import bundled_results
from scaletrain.sim.mlperf import (
    Convergence,
    convergence,
    eval_interval_steps,
    olympic_mean,
    rcp_mean,
    rcp_records,
    rcp_score_factor,
    score,
    skipped_evals,
)

# gpt3 4.1.0 RCP lists, copied from mlperf_logging/rcp_checker/training_4.1.0/rcps_gpt3.json.
GPT3_2048 = [1157627904, 1207959552, 1157627904, 1207959552, 1207959552, 1157627904, 1157627904]
GPT3_3072 = [1258291200, 1207959552, 1207959552, 1207959552, 1207959552, 1207959552, 13790871552]
LORA_8 = [
    3072,
    2688,
    3456,
    3072,
    3072,
    3072,
    3456,
    3456,
    3072,
    2688,
    3456,
    3072,
    3072,
    3072,
    3840,
    3456,
    2688,
    3072,
    3456,
    3456,
]


def _by_hand(values):
    s = sorted(values)
    return sum(s[1:-1]) / (len(s) - 2)


@pytest.fixture(params=[True, False], ids=["package", "bundled-copy"])
def rcp_source(request, monkeypatch):
    """Run a test against the installed mlperf-logging tables and against the carried copy."""
    if request.param:
        if mlperf._package_rcp_file("gpt3", "4.1.0") is None:
            pytest.skip("mlperf-logging not installed")
    else:
        monkeypatch.setattr(mlperf, "_package_rcp_file", lambda *a: None)
    for fn in (mlperf._rcp_records, mlperf._rcp_means, mlperf.rcp_version):
        fn.cache_clear()
    yield request.param
    for fn in (mlperf._rcp_records, mlperf._rcp_means, mlperf.rcp_version):
        fn.cache_clear()


def test_rcp_pins(rcp_source):
    assert rcp_mean("gpt3", 2048) == pytest.approx(_by_hand(GPT3_2048)) == pytest.approx(1177760563.2)
    # The 13.79e9 typo is dropped before the olympic mean: 4 x 1207959552 left after dropping min and max.
    assert 13790871552 not in rcp_records("gpt3")[3072]
    assert rcp_mean("gpt3", 3072) == pytest.approx(_by_hand([v for v in GPT3_3072 if v < 5e9])) == 1207959552
    assert rcp_mean("gpt3", 3072) != pytest.approx(_by_hand(GPT3_3072))
    m2048, m3072 = _by_hand(GPT3_2048), 1207959552
    assert rcp_mean("gpt3", 2304) == pytest.approx(m2048 + (m3072 - m2048) * 256 / 1024)
    assert rcp_mean("llama2_70b_lora", 8) == pytest.approx(_by_hand(LORA_8)) == pytest.approx(3178.6666667)
    assert sorted(rcp_records("llama2_70b_lora")) == [8, 16, 32, 128]


def test_rcp_ends_and_pruning(rcp_source):
    assert rcp_mean("gpt3", 512) == rcp_mean("gpt3", 1536)  # below the smallest BS: the smallest record
    assert rcp_mean("gpt3", 8192) == pytest.approx(1623195648)
    with pytest.raises(ValueError, match="above the largest RCP batch size 8192"):
        rcp_mean("gpt3", 8193)
    with pytest.raises(ValueError, match="above the largest RCP batch size 128"):
        rcp_mean("llama2_70b_lora", 256)
    # The checker's pruning: gpt3 drops 1536 (slower than 2048); lora drops 32 (above the 16..128 line).
    assert rcp_mean("gpt3", 1536, pruned=True) == rcp_mean("gpt3", 2048)
    assert rcp_mean("llama2_70b_lora", 32, pruned=True) == pytest.approx(4032 + (11264 - 4032) * 16 / 112)
    assert rcp_mean("llama2_70b_lora", 32) == pytest.approx(6037.3333333)


def test_bundled_copy_matches_package(monkeypatch):
    if mlperf._package_rcp_file("gpt3", "4.1.0") is None:
        pytest.skip("mlperf-logging not installed")
    for bench in mlperf.BENCHMARKS:
        if mlperf._package_rcp_file(bench, "4.1.0") is None:  # llama31_*: RCPs from 5.0.0 on, no bundled copy
            continue
        pkg, where = mlperf._load_rcp_raw(bench, "4.1.0")
        copy, copy_where = mlperf._load_rcp_raw(bench, "4.1.0", use_package=False)
        assert where.endswith(f"rcps_{bench}.json") and copy_where.endswith("rcps_4.1.0.csv")
        key = mlperf.BENCHMARKS[bench].rcp_key
        assert {k: (v["BS"], v[key]) for k, v in pkg.items()} == {k: (v["BS"], v[key]) for k, v in copy.items()}
    with pytest.raises(ValueError, match="no RCP table for gpt3 version 3.1.0"):
        mlperf._load_rcp_raw("gpt3", "3.1.0", use_package=False)


def test_package_files_found_without_importing_checker():
    path = mlperf._package_rcp_file("llama2_70b_lora", "4.1.0")
    if path is None:
        pytest.skip("mlperf-logging not installed")
    assert json.loads(path.read_text())["llama2_70b_lora_ref_8"]["BS"] == 8


def test_eval_cadence():
    assert eval_interval_steps("gpt3", 2048) == 12
    assert eval_interval_steps("gpt3", 2304) == 11  # ceil(24576/2304)
    assert eval_interval_steps("gpt3", 8192) == 3
    assert eval_interval_steps("llama2_70b_lora", 8) == 48
    assert eval_interval_steps("llama2_70b_lora", 40) == 10  # ceil(384/40)
    assert [skipped_evals("llama2_70b_lora", g) for g in (8, 16, 15, 128)] == [3, 4, 3, 18]
    assert skipped_evals("gpt3", 2048) == 0
    with pytest.raises(ValueError, match="gbs"):
        eval_interval_steps("gpt3", 0)
    with pytest.raises(ValueError, match="unknown benchmark"):
        eval_interval_steps("bert", 8)


def test_gpt3_convergence():
    c = convergence("gpt3", 2048, converge=1207959552)
    assert c == Convergence(
        steps=288, evals=24, eval_interval_steps=12, train_sequences=288 * 2048, eval_tokens=11_590_004
    )
    # RCP mean 1.1778e9 tokens = 280.8 steps: a run can only stop at an evaluation, so 24 intervals.
    d = convergence("gpt3", 2048)
    assert (d.steps, d.evals) == (288, 24)
    # One token past 23 intervals needs the 24th evaluation.
    assert convergence("gpt3", 2048, converge=23 * 12 * 2048 * 2048 + 1).evals == 24
    assert convergence("gpt3", 2048, converge=23 * 12 * 2048 * 2048).evals == 23
    # The v4.0 GBS-2304 calibration run logged 1193803776 tokens = 253 steps = 23 intervals of 11.
    assert convergence("gpt3", 2304, converge=1193803776).steps == 253


def test_lora_convergence_skip_rule():
    c = convergence("llama2_70b_lora", 8, converge=3072)
    # 384 steps = 8 intervals of 48; the first floor(0.125*8+2) = 3 evaluations are not run: 5 timed.
    assert (c.steps, c.eval_interval_steps, c.evals, c.train_sequences) == (384, 48, 5, 3072)
    assert c.eval_tokens == 173 * 8192
    # Converging inside the skipped region still has to wait for the first evaluation that runs.
    early = convergence("llama2_70b_lora", 8, converge=500)
    assert (early.steps, early.evals) == (4 * 48, 1)
    assert convergence("llama2_70b_lora", 8).steps == 9 * 48  # RCP mean 3178.7 samples -> 9th interval
    with pytest.raises(ValueError, match="positive"):
        convergence("llama2_70b_lora", 8, converge=0)


def test_calibration_runs_stop_on_evaluations():
    # llama31 submissions do not all stop on the rules' cadence (a GBS-16 8B run at 13.5 intervals of 12,288): the
    # simulator takes their counts as whole steps (rows._published_run).
    for r in bundled_results("gpt3") + bundled_results("llama2_70b_lora"):
        for n in r.run_converge:
            if n == 0:  # a run that did not converge
                continue
            if r.round == "v5.0" and 384 % r.gbs:
                # v5.0 evaluated every floor(384/GBS) steps (v5.1 and the rules: ceil): GBS 9 every 42 steps.
                assert n % (384 // r.gbs * r.gbs) == 0, (r.line, n)
                continue
            c = convergence(r.benchmark, r.gbs, converge=n)
            units = c.train_sequences * (2048 if r.benchmark == "gpt3" else 1)
            assert units == n, (r.line, n)


def test_olympic_mean_and_score():
    assert olympic_mean([3, 1, 2]) == 2
    assert olympic_mean([1, 2, 3, 4, 100]) == 3
    assert olympic_mean(range(1, 11)) == pytest.approx(5.5)
    with pytest.raises(ValueError, match="at least 3"):
        olympic_mean([1, 2])
    assert score("gpt3", [8.566, 8.588, 8.574]) == 8.574
    assert score("gpt3", [10.0, None, 9.0]) == 10.0  # a failed run counts as the slowest
    assert score("gpt3", [10.0, math.inf, 9.0]) == 10.0
    with pytest.raises(ValueError, match="at most one run"):
        score("gpt3", [10.0, None, None])
    with pytest.raises(ValueError, match="scored on 10 runs"):
        score("llama2_70b_lora", [1.0] * 9)
    lora = [27.151, 27.387, 30.824, 27.115, 27.077, 27.166, 27.141, 30.745, 23.541, 30.765]
    assert score("llama2_70b_lora", lora) == pytest.approx(28.068, abs=5e-4)


def test_calibration_scores(rcp_source):
    for r in bundled_results():
        s = score(r.benchmark, r.run_minutes)
        assert s == pytest.approx(r.olympic_minutes)
        converged = [c for c in r.run_converge if c > 0]
        if r.benchmark.startswith("llama31"):
            # Normalised by the round's own table (5.0.0's 405B one differs from 6.0.0's) and not always as
            # rcp_score_factor computes it (a v5.1 8B factor of 1.0038 where the runs converge slower than the RCP
            # mean): only the file's own arithmetic is checked.
            assert s * r.scaling_factor == pytest.approx(r.score_minutes, abs=6e-4), r.line
            continue
        factor = rcp_score_factor(r.benchmark, r.gbs, converged) if r.benchmark != "gpt3" else 1.0
        # The v5 file gives the factor to 6 decimals.
        assert factor == pytest.approx(r.scaling_factor, rel=1e-12 if not r.file else 1e-6), r.line
        assert s * factor == pytest.approx(r.score_minutes, abs=6e-4), r.line
