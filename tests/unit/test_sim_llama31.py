"""Prediction for llama31_405b and llama31_8b: RCPs of their own rulesets (package or carried copy), the uneven
pipeline split of 126 blocks, the published layouts through `predict`, their calibration rows and own-scalar fit."""

from __future__ import annotations

import pytest

from scaletrain import benchmarks
from scaletrain.sim import mlperf
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import OWN_FIT, Efficiency, efficiency_for, load_efficiencies
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.results import bundled_results
from scaletrain.sim.fit.rows import _published_run
from scaletrain.sim.predict import predict
from scaletrain.sim.step import stage_costs, step_time
from scaletrain.sim.workload import ClusterLayout, chunk_layers, load_workload, rank_layers

W405 = load_workload("llama31-405b")
W8 = load_workload("llama31-8b")
# The 6.0.0 405B RCP olympic means (rcps_llama31_405b.json): 313,344 / 368,640 / 488,448 samples at 1152 / 2304 /
# 4608 (the 4608 list 460800, 479232, 497664 x4 drops one low and one high).
RCP405 = {1152: 313344.0, 2304: 368640.0, 4608: (479232 + 3 * 497664) / 4}


@pytest.fixture(autouse=True)
def _shipped_only(monkeypatch):
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


@pytest.fixture(params=[True, False], ids=["package", "carried"])
def rcp_source(request, monkeypatch):
    """The installed mlperf-logging's tables, or none at all (the carried rcps_<version>.csv copies)."""
    if request.param:
        if mlperf._package_rcp_file("llama31_8b", "6.1.0") is None:
            pytest.skip("mlperf-logging 4.1.68 not installed")
    else:
        monkeypatch.setattr(mlperf, "_package_rcp_file", lambda *a: None)

        def no_package(name, requested=""):
            raise ValueError("no package")

        monkeypatch.setattr(benchmarks, "resolve_ruleset", no_package)
    for fn in (mlperf._rcp_records, mlperf._rcp_means, mlperf.rcp_version):
        fn.cache_clear()
    yield request.param
    for fn in (mlperf._rcp_records, mlperf._rcp_means, mlperf.rcp_version):
        fn.cache_clear()


def test_rcp_versions_and_interpolation(rcp_source):
    assert [mlperf.rcp_version(b) for b in ("gpt3", "llama2_70b_lora", "llama31_405b", "llama31_8b")] == [
        "4.1.0",
        "4.1.0",
        "6.0.0",
        "6.1.0",
    ]
    assert sorted(mlperf.rcp_records("llama31_405b")) == [1152, 2304, 4608]
    assert sorted(mlperf.rcp_records("llama31_8b")) == [16, 32, 64, 96, 128]
    for gbs, mean in RCP405.items():
        assert mlperf.rcp_mean("llama31_405b", gbs) == pytest.approx(mean)
    # Linear between RCP batch sizes, the smallest record's below them (the v5.0 GBS-448 row), none above.
    assert mlperf.rcp_mean("llama31_405b", 1728) == pytest.approx((RCP405[1152] + RCP405[2304]) / 2)
    assert mlperf.rcp_mean("llama31_405b", 1536) == pytest.approx(RCP405[1152] + (RCP405[2304] - RCP405[1152]) / 3)
    assert mlperf.rcp_mean("llama31_405b", 448) == RCP405[1152]
    with pytest.raises(ValueError, match="above the largest RCP batch size 4608"):
        mlperf.rcp_mean("llama31_405b", 9216)
    # 8B: GBS 48 halfway between 32 and 64 (olympic means of 20 runs each).
    m32, m64 = mlperf.rcp_mean("llama31_8b", 32), mlperf.rcp_mean("llama31_8b", 64)
    assert m32 == pytest.approx(178858.6666667) and m64 == pytest.approx(226645.3333333)
    assert mlperf.rcp_mean("llama31_8b", 48) == pytest.approx((m32 + m64) / 2)
    # 405B is scored on 3 runs: the RCP mean rounded up to an evaluation (every 18,432 samples, 16 steps at 1152).
    c = mlperf.convergence("llama31_405b", 1152)
    assert (c.steps, c.evals, c.eval_interval_steps, c.eval_tokens) == (272, 17, 16, 5760 * 8192)


def test_carried_rcp_copies_equal_the_package():
    if mlperf._package_rcp_file("llama31_405b", "6.0.0") is None:
        pytest.skip("mlperf-logging not installed")
    for bench, version in (("llama31_405b", "6.0.0"), ("llama31_8b", "6.1.0")):
        pkg, _ = mlperf._load_rcp_raw(bench, version)
        copy, where = mlperf._load_rcp_raw(bench, version, use_package=False)
        assert where.endswith(f"rcps_{version}.csv")
        key = mlperf.bench(bench).rcp_key
        assert {k: (v["BS"], v[key]) for k, v in pkg.items()} == {k: (v["BS"], v[key]) for k, v in copy.items()}
    with pytest.raises(ValueError, match=r"carries only 6\.0\.0"):
        mlperf._load_rcp_raw("llama31_405b", "5.0.0", use_package=False)


def test_uneven_split_counts_the_embedding_and_the_loss_as_layers():
    table = chunk_layers(126, 8, 8)
    assert table is not None and sum(map(sum, table)) == 126
    assert table[0][0] == table[7][7] == 1 and {n for row in table for n in row} == {1, 2}
    assert sum(n == 1 for row in table for n in row) == 2
    assert rank_layers(126, 8, 8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert chunk_layers(96, 8, 12) == ((1,) * 12,) * 8  # even splits stay even
    assert rank_layers(126, 4, 16) == [31, 32, 32, 31] and chunk_layers(126, 5, 1) is None
    assert chunk_layers(96, 5, 1) is None
    assert chunk_layers(126, 128, 1) is None  # one block per chunk leaves none for the first and last
    lay = ClusterLayout(gpus=512, tp=8, pp=8, vp=8, cp=2, gbs=1152, fp8=True, bf16_grads=True)
    assert lay.problems(W405) == []
    assert "divides neither" in lay.__class__(gpus=320, tp=8, pp=5, cp=2, gbs=1120).problems(W405)[0]


def test_uneven_stages_are_priced_per_chunk_and_the_slowest_sets_the_step():
    lay = ClusterLayout(gpus=512, tp=8, pp=8, vp=8, cp=2, gbs=1152, fp8=True, bf16_grads=True)
    cl = Cluster(*load_catalog().system("h100", None, None), 512)
    fwd, bwd, _ = stage_costs(W405, lay, cl, Efficiency())
    block = fwd[0][1] / 2  # an inner chunk holds two blocks
    assert fwd[3][4] == pytest.approx(2 * block)
    assert block < fwd[0][0] < 1.2 * block  # one block plus the embedding lookup
    assert block < fwd[7][7] < 2 * block  # one block plus the 128,256-wide output layer and loss
    st = step_time(W405, lay, cl, Efficiency())
    m = lay.microbatches
    middle = sum(fwd[3]) + sum(bwd[3])  # 16 blocks: a middle rank is the busiest
    assert middle == max(sum(fwd[r]) + sum(bwd[r]) for r in range(8))
    assert st.details["makespan_s"] >= m * middle
    # Averaging 126 / 64 blocks over the chunks would put 15.75 blocks on the busiest rank.
    assert m * middle > m * 15.75 * (fwd[3][4] + bwd[3][4]) / 2 * 1.01


@pytest.mark.parametrize(
    "gpu, gpus, tp, gbs, fp4",
    [("h100", 512, 8, 1152, False), ("gb200", 256, 4, 448, False), ("gb300", 512, 2, 1152, True)],
)
def test_predict_405b_at_published_layouts(gpu, gpus, tp, gbs, fp4):
    lay = ClusterLayout(gpus=gpus, tp=tp, pp=8, vp=8, cp=2, gbs=gbs, fp8=True, fp4=fp4, bf16_grads=True)
    p = predict(W405, lay, gpu)
    assert p.feasible, p.reasons
    conv = mlperf.convergence("llama31_405b", gbs)
    assert (p.steps, p.evals) == (conv.steps, conv.evals)
    parts = p.phases_min
    assert p.time_to_train_min == pytest.approx(parts["warmup"] + parts["steps"] + parts["evaluations"])
    assert 10 < p.time_to_train_min < 600 and p.eval_time_s > 0


def test_predict_8b_uses_the_fractional_rcp_mean_of_its_10_run_score():
    lay = ClusterLayout(gpus=8, mbs=2, gbs=16, fp8=True, bf16_grads=True)
    p = predict(W8, lay, "b200")
    assert p.feasible and p.time_to_train_min is not None
    assert p.steps == pytest.approx(mlperf.rcp_mean("llama31_8b", 16, pruned=True) / 16)
    assert p.evals == pytest.approx(p.steps / 768)  # every 12,288 samples = 768 steps at GBS 16


def test_calibration_rows_load_with_their_layouts():
    r405 = {(r.gpu, r.gpus): r for r in bundled_results("llama31_405b")}
    assert {("gb200", 256), ("h100", 512), ("gb300", 512), ("b200", 256), ("h100", 8192), ("h200", 1024)} <= set(r405)
    assert len(bundled_results("llama31_405b")) == 16 and max(r.gpus for r in r405.values()) == 8192
    h100 = r405[("h100", 512)]
    assert (h100.tp, h100.pp, h100.vp, h100.cp, h100.mbs, h100.gbs, h100.fp8, h100.round) == (
        8, 8, 8, 2, 1, 1152, True, "v5.0",
    )  # fmt: skip
    assert h100.run_converge == (276480,) * 3 and h100.scaling_factor == pytest.approx(1.166667)
    # The GB300 row's two candidate configs disagree on FP4: FP8 assumed, FP4 off.
    assert (r405[("gb300", 512)].fp8, r405[("gb300", 512)].fp4, r405[("gb300", 512)].tp) == (True, False, 2)
    r8 = bundled_results("llama31_8b")
    assert len(r8) == 24 and {r.gpus for r in r8} == {8, 16, 32, 64}
    # "null" vp of unpipelined configs reads as unknown (1), not as an error.
    assert all(r.pp == r.vp == 1 for r in r8) and sum(r.fp4 for r in r8) == 12
    # v5.0 evaluated every 46,080 samples: a 276,480-sample run is 240 steps and 6 evaluations, not 15.
    run = _published_run("llama31_405b", 1152, 276480, "v5.0")
    assert (run.steps, run.evals) == (240, 6)
    assert _published_run("llama31_405b", 1152, 313344, "v5.1").evals == 17


def test_own_fit_moves_only_the_benchmarks_scalars():
    doc = load_efficiencies()
    shipped = cal.FittedSets(
        {k: Efficiency.from_dict(v) for k, v in doc["sets"].items()},
        doc["sku_gemm"],
        {k: v for k, v in doc["benchmarks"].items() if k in cal.SHARED_FIT},
    )
    ready, bad = cal.prepare(bundled_results("llama31_405b"))
    assert not bad and len(ready) == 16
    effs = cal.fit_own(ready, shipped)
    assert dict(effs) == dict(shipped) and effs.sku_gemm == shipped.sku_gemm
    assert {k: effs.bench[k] for k in cal.SHARED_FIT} == {k: shipped.bench[k] for k in cal.SHARED_FIT}
    # Its own scalar (gemm_mult) is the one the shipped file holds; llama31_8b's rows fit the same.
    assert set(effs.bench["llama31_405b"]) == {"gemm_mult"}
    assert effs.bench["llama31_405b"]["gemm_mult"] == pytest.approx(doc["benchmarks"]["llama31_405b"]["gemm_mult"])
    assert set(doc["benchmarks"]["llama31_8b"]) == set(OWN_FIT)
    # Predictions (predict and plan) use the benchmark's multiplier on its set's GEMM efficiency.
    mult = doc["benchmarks"]["llama31_405b"]["gemm_mult"]
    assert efficiency_for(None, "h100", "llama31_405b")[1].gemm_eff == pytest.approx(
        efficiency_for(None, "h100")[1].gemm_eff * mult
    )


def test_plan_searches_the_uneven_depths_and_prices_both_models():
    from scaletrain.sim import plan as planner

    assert {1, 2, 3, 8, 16, 64} <= set(planner._depths(126)) and 5 not in planner._depths(126)
    assert planner._depths(96) == [d for d in range(1, 97) if 96 % d == 0 or (98 % d == 0 and 98 // d >= 2)]
    for w, gpu, gpus in ((W8, "b200", 8), (W405, "gb200", 256)):
        res = planner.plan(w, gpu, gpus, top=1)
        best = res.best[0]
        assert best.feasible and best.time_to_train_min is not None
        lay = best.layout
        assert chunk_layers(w.shape.layers, lay["pp"], lay["vp"]) is not None
        bench = "llama31_8b" if w is W8 else "llama31_405b"
        assert min(mlperf.rcp_records(bench)) <= lay["gbs"] <= max(mlperf.rcp_records(bench))


@pytest.mark.parametrize("bench", ["llama31_405b", "llama31_8b"])
def test_carried_rows_are_the_shared_files_unchanged(bench):
    # The rows' own content is pinned above; this only catches drift from the project's source files where a
    # checkout has them (CI may not).
    from importlib import resources
    from pathlib import Path

    shared = Path(__file__).resolve().parents[3] / "shared" / "data" / "mlperf_v5" / f"{bench}_calibration.csv"
    if not shared.is_file():
        pytest.skip("no ../shared/data/mlperf_v5 next to this checkout")
    carried = resources.files("scaletrain.sim").joinpath("data", f"mlperf_v5_{bench}_calibration.csv")
    # Every carried row as published there, byte for byte. shared/ has since gained the v5.0 rows at 512-8,192 GPUs;
    # carrying them changes the fit, and that belongs with the scale terms fitted on them (issue 28), not here.
    shared_rows = set(shared.read_bytes().splitlines())
    missing = [row for row in carried.read_bytes().splitlines() if row not in shared_rows]
    assert not missing, missing[:3]
