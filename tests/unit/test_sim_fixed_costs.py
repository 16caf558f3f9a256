"""The MLPerf v5.0/v5.1 calibration rows (parse, system mapping, use in the fit) and the fixed costs of a run (warm-up,
per-evaluation cost, per-step synchronisation and stragglers) as functions of the layout and the scale."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import replace
from importlib import resources

import pytest

from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.results import ResultsError, bundled_results, bundled_skipped, load_results
from scaletrain.sim.fit.validate import cross_validate
from scaletrain.sim.fixed_costs import (
    comm_init_units,
    domains,
    eval_fixed_s,
    expected_max_normal,
    process_groups,
    step_sync_s,
    warmup_s,
)
from scaletrain.sim.predict import predict
from scaletrain.sim.workload import ClusterLayout, load_workload

V5 = "mlperf_v5_llama2_70b_lora_calibration.csv"
LORA = load_workload("llama2_70b_lora")
CAT = load_catalog()


@pytest.fixture(autouse=True)
def _no_user_files(monkeypatch):
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


def _v5_text() -> str:
    return resources.files("scaletrain.sim").joinpath("data", V5).read_text("utf-8")


def _v5_rows():
    return [r for r in bundled_results("llama2_70b_lora") if r.file.endswith(V5)]


# ---------------------------------------------------------------------------------------------------------------
# Parse


def test_v5_file_parses_with_unknown_layouts_skipped_not_failed():
    raw = list(csv.DictReader(io.StringIO(_v5_text())))
    report = load_results(_v5_text(), strict=True)  # strict: only rows without a layout may be left out
    assert len(raw) == 102 and len(report.rows) == 91 and len(report.unknown_layout) == 11
    assert report.errors == report.unknown_layout
    for line, why in report.unknown_layout:
        assert not (raw[line - 2]["tp"] and raw[line - 2]["cp"]) and why.startswith("layout unknown")
    assert len(bundled_skipped("llama2_70b_lora")) == 11 and bundled_skipped("gpt3") == []
    by_line = {r.line: r for r in report.rows}
    for line, row in enumerate(raw, start=2):
        r = by_line.get(line)
        if r is None:
            continue
        # The fit target is what the machine did (the olympic mean); the score is the published one.
        assert r.olympic_minutes == pytest.approx(float(row["score_minutes"]), abs=6e-4), line
        assert r.score_minutes == float(row["official_score_minutes"])
        assert (r.round, r.gpus, r.gbs, r.tp, r.cp) == (
            row["round"],
            int(row["n_accel"]),
            int(row["gbs"]),
            int(row["tp"]),
            int(row["cp"]),
        )
        assert r.fp4 == (row["fp4"] == "True") and (r.fp8 or not r.fp4)


def test_v5_failed_run_fp4_and_defaults():
    rows = _v5_rows()
    failed = next(r for r in rows if r.system == "1xXE9780x8B200-SXM-180GB")
    assert failed.run_minutes[0] == math.inf and failed.run_converge[0] == 0
    assert failed.olympic_minutes == pytest.approx(10.09, abs=6e-4)  # the failed run is the dropped slowest
    fp4 = next(r for r in rows if r.system == "nebius_b300_n1")
    assert (fp4.gpu, fp4.fp8, fp4.fp4) == ("b300", True, True)  # the FP4 recipe is the FP8 one with FP4 GEMMs
    hpe = next(r for r in rows if r.system == "HPE-Cray-XD670-H200-SXM5-141GB_n1_24.09")
    assert (hpe.tp, hpe.pp, hpe.mbs, hpe.fp8, hpe.assumed) == (2, 1, 1, True, ("pp", "vp", "mbs", "fp8"))
    assert next(r for r in rows if r.system == "nyx_n1_ngc25.04_nemo").assumed == ()  # vp is moot without pp
    header, line = _v5_text().splitlines()[:2]
    bad = line.replace(",True,,10,", ",maybe,,10,")
    assert bad != line
    with pytest.raises(ResultsError, match="fp8 'maybe'"):
        load_results(header + "\n" + bad + "\n", strict=True)
    twice = line.replace("28.260;28.281", "(no_stop);(no_stop)")
    assert "more than one run" in load_results(header + "\n" + twice + "\n").errors[0][1]


# ---------------------------------------------------------------------------------------------------------------
# Systems


def test_every_v5_system_maps_to_a_catalog_node_of_its_gpu():
    rows = _v5_rows()
    assert {r.gpu for r in rows} == {"h100", "h200", "h200nvl", "b200", "b300", "gb200", "gb300", "mi300x", "mi325x"}
    for r in rows:
        node, fabric = cal.row_system(r)
        assert CAT.node(node).gpu == r.gpu, r.system
        assert fabric == "" or fabric in CAT.fabrics, (r.system, fabric)
    ready, bad = cal.prepare(rows)
    assert bad == [] and len(ready) == 91


@pytest.mark.parametrize(
    "system,node,fabric",
    [
        ("theia_ngpu72_ngc25.09_nemo", "gb300-nvl72", "ib-xdr"),  # host: 4x ConnectX-8 IB XDR 800 Gb/s
        ("nyx_n1_ngc25.04_nemo", "dgx-b200", "ib-ndr"),  # "NVLINK Gen5 1800 GB/s" is no XDR network
        ("XE7740x8H200-NVL-141GB", "h200nvl-pcie", ""),
        ("MI300X-LLMBoost-GPUBoost-2node", "mi300x-oam", "roce"),
        ("AS-8126GS-TNMR_8xMI325X", "mi325x-oam", "roce"),
        ("ESC_A8A_MI325X", "mi325x-oam", "roce"),
        ("SR680aV4-8xB300_SXM", "hgx-b300", ""),  # no host network given: the node's default
        ("hpf_n8", "hgx-h100", ""),  # only the compute network counts: "8x BF3 ConnectX-7 400Gb/s"
        ("Cray-XD670-H200-SXM5-141GB_n8_v5.0", "hgx-h200", "ib-ndr"),  # host: Infiniband, Ethernet
    ],
)
def test_v5_system_spot_checks(system, node, fabric):
    r = next(r for r in _v5_rows() if r.system == system)
    assert cal.row_system(r) == (node, fabric)


def test_h200_nvl_is_its_own_gpu_on_a_bridge_mesh():
    g, n = CAT.gpu("h200nvl"), CAT.node("h200nvl-pcie")
    assert g.bf16_tflops < CAT.gpu("h200").bf16_tflops and g.hbm_gb == 141.0 and "datasheet" in g.source
    assert (n.nvlink_domain, n.topology) == (4, "mesh")
    assert CAT.gpu_for_device("NVIDIA H200 NVL").key == "h200nvl"
    assert CAT.gpu_for_device("NVIDIA H200").key == "h200"


# ---------------------------------------------------------------------------------------------------------------
# Fixed costs


def test_expected_max_of_n_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi))
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=0.03)  # exact: 0.846
    values = [expected_max_normal(n) for n in (2, 8, 64, 512, 10752)]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values[-1] == pytest.approx(math.sqrt(2 * math.log(10752)), rel=0.15)


def test_fixed_costs_grow_with_the_number_of_ranks():
    eff = Efficiency(sync_log2_s=0.01, straggler_cv=0.02, comm_init_s=0.3, warmup_steps=2.0, eval_fixed_s=0.5)
    prev = None
    for gpus in (8, 16, 64, 512, 4096):
        lay = ClusterLayout(gpus=gpus, tp=4, cp=2, gbs=gpus // 8)
        d = domains(gpus, 8)
        now = (comm_init_units(lay), warmup_s(lay, 1.0, eff), *step_sync_s(gpus, d, 1.0, eff), eval_fixed_s(d, eff))
        if prev is not None:
            assert all(b > a for a, b in zip(prev, now)), (gpus, prev, now)
        prev = now
    assert process_groups(ClusterLayout(gpus=8, tp=8, gbs=8)) == {"tp": 8, "world": 8}
    assert process_groups(ClusterLayout(gpus=1, gbs=8)) == {}
    # The tree synchronisation counts NVLink domains: none inside one board or one NVL72 rack.
    assert step_sync_s(8, 1, 1.0, eff)[0] == 0.0 and step_sync_s(72, domains(72, 72), 1.0, eff)[0] == 0.0
    assert step_sync_s(72, domains(72, 8), 1.0, eff)[0] == pytest.approx(0.01 * math.log2(9))


def test_predict_prices_the_fixed_costs_and_keeps_its_keys():
    eff = Efficiency(sync_log2_s=0.01, straggler_cv=0.02, comm_init_s=0.3, warmup_steps=2.0, eval_fixed_s=0.5)
    off = replace(eff, sync_log2_s=0.0, straggler_cv=0.0, comm_init_s=0.0, warmup_steps=0.0, eval_fixed_s=0.0)
    small, big = (ClusterLayout(gpus=n, tp=4, cp=2, gbs=n // 8, fp8=True, bf16_grads=True) for n in (64, 512))
    ps, pb = (predict(LORA, lay, "h200", "nd-h200-v5", eff=eff) for lay in (small, big))
    assert 0 < ps.breakdown["sync"] < pb.breakdown["sync"] and 0 < ps.breakdown["straggler"] < pb.breakdown["straggler"]
    assert 0 < ps.warmup_s < pb.warmup_s
    p0 = predict(LORA, big, "h200", "nd-h200-v5", eff=off)
    assert p0.breakdown["sync"] == p0.breakdown["straggler"] == p0.warmup_s == 0.0
    assert pb.time_to_train_min > p0.time_to_train_min and pb.eval_time_s == pytest.approx(
        p0.eval_time_s + 0.5 + 0.01 * math.log2(64)
    )
    d = pb.to_dict()
    for key in (
        "step_time_s",
        "time_to_train_min",
        "tokens_per_s_per_gpu",
        "mfu",
        "memory_gib_per_gpu",
        "steps",
        "feasible",
        "breakdown",
        "phases_min",
        "warmup_s",
    ):
        assert key in d
    assert d["phases_min"]["warmup"] == pytest.approx(d["warmup_s"] / 60)
    assert sum(d["phases_min"].values()) == pytest.approx(d["time_to_train_min"], rel=1e-12)


def test_the_fast_row_model_is_the_predict_model():
    """calibrate prices rows with cached cores plus arithmetic; it must give exactly what predict says."""
    eff = Efficiency(sync_log2_s=0.01, straggler_cv=0.02, comm_init_s=0.3, warmup_steps=2.0, eval_fixed_s=0.5)
    picks = ("eos_n8", "tyche_ngpu72_ngc25.09_nemo", "MI300X-LLMBoost-GPUBoost-2node")
    ready, _ = cal.prepare([r for r in bundled_results("llama2_70b_lora") if r.system in picks])
    assert len(ready) == 5  # eos_n8 and the MI300X 2-node system were submitted in two rounds each
    for r in ready:
        node, fabric = cal.row_system(r.row)
        p = predict(LORA, r.layout, r.row.gpu, node, fabric or None, eff=eff)
        step, ev, warm = r.timing(eff, True)
        assert step == pytest.approx(p.step_time_s, rel=1e-12) and warm == pytest.approx(p.warmup_s, rel=1e-12)
        assert ev == pytest.approx(p.eval_time_s, rel=1e-12)
        assert r.minutes(eff, r.rcp, True) == pytest.approx(p.time_to_train_min, rel=1e-12)


def test_loo_on_v5_rows_with_amd_blackwell_and_a_failed_run():
    picks = ("1xXE9780x8B200-SXM-180GB", "nebius_b200_n2", "MI325X-LLMBoost-GPUBoost-1node", "AS-8126GS-TNMR")
    ready, bad = cal.prepare([r for r in _v5_rows() if r.system in picks])
    assert not bad and len(ready) == 4 and {r.set for r in ready} == {"v5.1/blackwell", "v5.1/cdna3"}
    cv = cross_validate(ready, "loo")
    assert [used for _, used, _ in cv["scores"]] == [r.set for r in ready]
    assert all(s.perf_error is not None and abs(s.perf_error) < 0.5 for _, _, s in cv["scores"])
    amd = [s for r, _, s in cv["scores"] if r.gpu == "mi325x"]
    ins = [s for s in cv["in_sample"] if s.row.gpu == "mi325x"]
    assert sum(abs(s.perf_error) for s in amd) >= sum(abs(s.perf_error) for s in ins)
