"""The 90%-of-peak bound on fitted rates (sim/rate_bounds.py, `sim validate --rates`) and the catalog's measured or
derived ceilings (GPU.ceiling_basis), with the GB300 ceilings derived from B300's."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace

import pytest

from scaletrain.cli.main import main
from scaletrain.sim import compute
from scaletrain.sim.catalog import CEILINGS, GPU, CatalogError, load_catalog
from scaletrain.sim.efficiency import Efficiency, load_efficiencies
from scaletrain.sim.fit.layer_timings import catalog_toml
from scaletrain.sim.fit.rate_table import rate_table
from scaletrain.sim.rate_bounds import PEAK_FRACTION, effective_rates, max_gemm_eff, peaks

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.fixture(autouse=True)
def _no_user_files(monkeypatch):
    """Only the shipped catalog and fitted efficiencies."""
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


CAT = load_catalog()

# A made-up part with round numbers: peaks 1000 / 2000 / 4000, ceilings 800 / 1500 / 3000, attention 500.
TOY = GPU(
    key="toy",
    name="toy",
    bf16_tflops=1000.0,
    fp8_tflops=2000.0,
    fp4_tflops=4000.0,
    matmul_bf16_tflops=800.0,
    matmul_fp8_tflops=1500.0,
    matmul_fp4_tflops=3000.0,
    attn_tflops=500.0,
    hbm_gb=80.0,
    hbm_tbps=3.0,
    hbm_copy_tbps=2.5,
    nvlink_gbps=450.0,
    kernel_us=0.0,
    source="test",
    generation="hopper",
    default_node="hgx-h100",
)


def test_effective_rates_are_the_ceilings_times_the_fitted_efficiency():
    rates = effective_rates(Efficiency(gemm_eff=0.9, fp4_eff=0.5), TOY)
    assert rates == pytest.approx({"gemm_bf16": 720.0, "gemm_fp8": 1350.0, "gemm_fp4": 1350.0, "attention": 450.0})
    assert peaks(TOY) == {"gemm_bf16": 1000.0, "gemm_fp8": 2000.0, "gemm_fp4": 4000.0, "attention": 1000.0}


def test_effective_rates_mirror_how_compute_prices_a_large_gemm():
    # A GEMM large enough that the kernel_us roll-off vanishes runs at exactly the effective rate, in every
    # precision, with a measured curve (its fastest point) as without; a GPU without an FP8 ceiling prices FP8 at
    # the bf16 one, and one without FP4 has no FP4 rate.
    eff = Efficiency(gemm_eff=0.7, fp4_eff=0.8)
    flops = 1e18
    for gpu in (
        TOY,
        replace(TOY, kernel_us=5.0, gemm_curve_bf16=((1.0, 100.0), (1e9, 900.0)), gemm_curve_fp8=((1e9, 1700.0),)),
        replace(TOY, matmul_fp8_tflops=0.0, fp4_tflops=0.0, matmul_fp4_tflops=0.0),
    ):
        rates = effective_rates(eff, gpu)
        priced = {
            "gemm_bf16": flops / compute.gemm_time(gpu, flops, False, eff.gemm_eff) / 1e12,
            "gemm_fp8": flops / compute.gemm_time(gpu, flops, True, eff.gemm_eff) / 1e12,
        }
        if gpu.matmul_fp4_tflops:
            priced["gemm_fp4"] = flops / compute.gemm_time(gpu, flops, True, eff.gemm_eff, True, eff.fp4_eff) / 1e12
        else:
            assert "gemm_fp4" not in rates
        for kind, rate in priced.items():
            assert rates[kind] == pytest.approx(rate, rel=1e-6), (gpu.gemm_curve_bf16, kind)
    assert effective_rates(eff, replace(TOY, gemm_curve_bf16=((1e9, 900.0),)))["gemm_bf16"] == pytest.approx(630.0)


def test_attention_rate_is_priced_as_compute_prices_it():
    # layer_times' attention forward is its FLOPs over attn_tflops x gemm_eff (plus the kernel cost, 0 on TOY).
    from scaletrain.sim.workload import ClusterLayout, load_workload

    w = load_workload("llama2_70b_lora")
    lay = ClusterLayout(gpus=8, tp=1, pp=1, cp=1, mbs=1, gbs=8)
    eff = Efficiency(gemm_eff=0.6)
    t = compute.layer_times(w, lay, TOY, eff.gemm_eff)
    att = w.inventory.attention
    flops = w.seq_len * att.forward_flops(w.inventory.attention_tokens(w.seq_len)) * 0.5
    assert flops / t.attn_fwd / 1e12 == pytest.approx(effective_rates(eff, TOY)["attention"])


def test_max_gemm_eff_is_the_tightest_kind():
    # bf16 allows 0.9 x 1000/800 = 1.125, FP8 1.2, attention 1.8, FP4 0.9 x 4000/3000/fp4_eff.
    assert max_gemm_eff(TOY) == pytest.approx(1.125)
    assert max_gemm_eff(TOY, fp4_eff=1.5) == pytest.approx(0.8)
    assert max_gemm_eff(replace(TOY, attn_tflops=950.0)) == pytest.approx(0.9 * 1000 / 950)
    for gpu in CAT.gpus.values():
        top = max_gemm_eff(gpu)
        at = effective_rates(Efficiency(gemm_eff=top), gpu)
        pct = {k: 100 * v / peaks(gpu)[k] for k, v in at.items()}
        assert max(pct.values()) == pytest.approx(100 * PEAK_FRACTION), gpu.key
        above = effective_rates(Efficiency(gemm_eff=top * 1.001), gpu)
        assert any(v > PEAK_FRACTION * peaks(gpu)[k] for k, v in above.items()), gpu.key
    # A ceiling without a datasheet peak allows no rate at all.
    assert max_gemm_eff(replace(TOY, fp4_tflops=0.0)) == 0.0


def test_rate_table_covers_every_set_gpu_and_benchmark_with_fallbacks():
    doc = {
        "sets": {"v1.0/hopper": {"gemm_eff": 1.0}, "v2.0/blackwell": {"gemm_eff": 0.5, "fp4_eff": 0.5}},
        "sku_gemm": {"h200": 1.2},
        "benchmarks": {"gpt3": {"gemm_mult": 0.5}},
    }
    rows = rate_table(doc, CAT)
    by = {(r.set, r.gpu, r.benchmark, r.kind): r for r in rows}
    # The set's gemm_eff x the SKU multiplier x the benchmark's own multiplier.
    h200 = CAT.gpu("h200")
    assert by[("v1.0/hopper", "h200", None, "gemm_bf16")].tflops == pytest.approx(790 * 1.2)
    assert by[("v1.0/hopper", "h200", "gpt3", "gemm_bf16")].tflops == pytest.approx(790 * 0.6)
    assert by[("v1.0/hopper", "h200", None, "gemm_fp8")].pct == pytest.approx(100 * 1450 * 1.2 / h200.fp8_tflops)
    # Generations without their own set in a release get the nearest release's set, or the documented default.
    assert ("v2.0/blackwell (for v1.0)", "b200", None, "gemm_fp4") in by
    assert by[("v1.0/ampere (default)", "a100", None, "gemm_bf16")].tflops == pytest.approx(271 * 0.85)
    assert by[("v1.0/hopper (for v2.0)", "h100", "llama2_70b_lora", "attention")].tflops == pytest.approx(480.0)
    # Every catalog GPU, every benchmark but the CPU proxies, and models that are no benchmark.
    assert {r.gpu for r in rows} == set(CAT.gpus)
    assert {r.benchmark for r in rows} == {
        "gpt3",
        "llama2_70b_lora",
        "llama31_405b",
        "llama31_8b",
        "gpt_oss_20b",
        "deepseekv3_671b",
        None,
    }
    assert by[("v2.0/blackwell", "b300", None, "gemm_bf16")].basis == "measured"
    assert by[("v2.0/blackwell", "gb300", None, "gemm_bf16")].basis == "derived"


def test_shipped_sets_within_peak_bound():
    rows = rate_table(load_efficiencies(), CAT)
    over = sorted((r for r in rows if r.pct > 100 * PEAK_FRACTION), key=lambda r: -r.pct)
    assert not over, [(r.set, r.gpu, r.benchmark, r.kind, round(r.pct, 1)) for r in over[:5]]


def test_validate_rates_prints_the_largest_and_exits_1_above_the_bound(monkeypatch, capsys):
    within = {"sets": {"v1.0/hopper": {"gemm_eff": 1.0}}, "sku_gemm": {}, "benchmarks": {}}
    monkeypatch.setattr("scaletrain.cli.sim.load_efficiencies", lambda: within)
    assert main(["sim", "validate", "--rates", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["above_bound"] == 0 and doc["peak_fraction"] == PEAK_FRACTION
    # Hopper's set at gemm_eff 1: the largest FP8 rate is H200's 1450 of 1979 (73.27%; H200 NVL's, at the same ratio).
    assert doc["largest"]["gemm_fp8"]["gpu"] in ("h200", "h200nvl") and doc["largest"]["gemm_fp8"]["pct"] == 73.27
    over = {"sets": {"v1.0/hopper": {"gemm_eff": 1.3}}, "sku_gemm": {}, "benchmarks": {}}
    monkeypatch.setattr("scaletrain.cli.sim.load_efficiencies", lambda: over)
    assert main(["sim", "validate", "--rates"]) == 1
    out = capsys.readouterr().out
    # H100's measured 795 x 1.3 = 1,034 of 989 TFLOP/s, the same for every model (no benchmark multiplier).
    assert "gemm_bf16      104.5%    1,034 of     989 TFLOP/s  h100 under v1.0/hopper (measured ceiling)" in out
    assert re.search(r"\n[1-9][\d,]* of [\d,]+ rates above 90%", out) and "(measured)  every model" in out
    assert main(["sim", "validate", "--rates", "--cv", "loo"]) == 2
    assert "drop --cv" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Measured or derived ceilings


def test_every_shipped_ceiling_says_measured_or_derived():
    from importlib import resources

    raw = tomllib.loads((resources.files("scaletrain.sim") / "hardware" / "gpus.toml").read_text())
    for key, entry in raw.items():
        for c in CEILINGS:
            if entry.get(f"{c}_tflops", 0) > 0:
                assert entry["ceiling_basis"].get(c) in ("measured", "derived"), (key, c)
    # What docs/perf-model.md brackets as measured; every AMD, H200 NVL and GB300 ceiling is derived.
    assert [CAT.gpu("b300").basis(c) for c in CEILINGS] == ["measured", "derived", "derived", "derived"]
    assert CAT.gpu("gb200").basis("matmul_fp8") == "measured" and CAT.gpu("h100").basis("attn") == "measured"
    for key in ("gb300", "mi300x", "mi355x", "h200nvl"):
        assert {CAT.gpu(key).basis(c) for c in CEILINGS} == {"derived"}, key


def test_gb300_ceilings_are_b300s_ratios_at_its_own_peaks():
    # B300 silicon at a higher power limit: each ceiling is B300's ceiling/peak x GB300's peak; HBM is the usable
    # capacity, as GB200's 186 GB.
    b3, gb3, gb2 = CAT.gpu("b300"), CAT.gpu("gb300"), CAT.gpu("gb200")
    for ceiling, peak in (("matmul_bf16", "bf16"), ("matmul_fp8", "fp8"), ("matmul_fp4", "fp4")):
        want = getattr(b3, f"{ceiling}_tflops") / getattr(b3, f"{peak}_tflops") * getattr(gb3, f"{peak}_tflops")
        assert getattr(gb3, f"{ceiling}_tflops") == pytest.approx(want, abs=1.0), ceiling
    assert gb3.matmul_fp8_tflops > gb2.matmul_fp8_tflops and gb3.matmul_bf16_tflops > gb2.matmul_bf16_tflops
    assert gb3.matmul_fp4_tflops == pytest.approx(gb3.fp4_tflops * gb3.matmul_fp8_tflops / gb3.fp8_tflops, abs=1.0)
    assert (gb3.hbm_gb, gb2.hbm_gb) == (279.0, 186.0)


def _write(tmp_path, text: str):
    path = tmp_path / "extra.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ('ceiling_basis = {matmul_bf16 = "guessed"}', "ceiling_basis.matmul_bf16='guessed': must be 'measured' or"),
        ('ceiling_basis = {matmul_bf8 = "measured"}', "ceiling_basis.matmul_bf8: unknown ceiling (use matmul_bf16"),
        ('ceiling_basis = "measured"', "ceiling_basis='measured': must be a table"),
    ],
)
def test_a_bad_basis_is_one_clear_error(tmp_path, capsys, line, message):
    path = _write(tmp_path, f"[gpus.h100]\n{line}\n")
    with pytest.raises(CatalogError, match=r"extra\.toml: \[gpus\.h100\] ") as exc:
        load_catalog([path])
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert main(["predict", "--gpus", "8", "--catalog", path]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_an_override_that_changes_a_ceiling_without_a_basis_makes_it_derived(tmp_path):
    cat = load_catalog([_write(tmp_path, "[gpus.h100]\nmatmul_bf16_tflops = 700.0\n")])
    h100 = cat.gpu("h100")
    assert (h100.basis("matmul_bf16"), h100.basis("matmul_fp8"), h100.basis("attn")) == (
        "derived",
        "measured",
        "measured",
    )
    said = load_catalog([_write(tmp_path, '[gpus.h100]\nattn_tflops = 500.0\nceiling_basis = {attn = "measured"}\n')])
    assert said.gpu("h100").basis("attn") == "measured"
    # A measured GEMM curve is a measurement; `sim calibrate --layer-timings` writes the basis of what it measured.
    curve = load_catalog([_write(tmp_path, "[gpus.gb300]\ngemm_curve_fp8 = [[1.0, 900.0], [100.0, 3900.0]]\n")])
    assert curve.gpu("gb300").basis("matmul_fp8") == "measured"
    written = catalog_toml("gb300", {"matmul_bf16_tflops": 2000.0, "attn_tflops": 1300.0}, "t.json")
    got = load_catalog([_write(tmp_path, written)]).gpu("gb300")
    assert [got.basis(c) for c in CEILINGS] == ["measured", "derived", "derived", "measured"]
    assert not math.isnan(got.matmul_bf16_tflops)
