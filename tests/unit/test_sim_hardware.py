"""Blackwell, NVL72 and AMD in the simulator: the catalog entries and their sources, NVLink domains larger than a node
(and Infinity Fabric meshes), FP4 GEMM rates behind `--fp4`, the efficiency defaults of generations without a fitted
set, and golden numbers showing the hardware that was already there predicts exactly what it did before."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest

from scaletrain.cli.main import main
from scaletrain.cli.sim import print_prediction
from scaletrain.sim import step
from scaletrain.sim.catalog import CatalogError, load_catalog
from scaletrain.sim.comm import Cluster, ring_all_reduce, ring_reduce_scatter
from scaletrain.sim.efficiency import DEFAULT_GEMM_EFF, Efficiency, efficiency_for, load_efficiencies
from scaletrain.sim.plan import plan
from scaletrain.sim.predict import predict
from scaletrain.sim.workload import ClusterLayout, load_workload

BLACKWELL = ("b200", "b300", "gb200", "gb300")
AMD = ("mi300x", "mi325x", "mi350x", "mi355x")
NVL72 = ("gb200-nvl72", "gb300-nvl72", "nd-gb200-v6")
LORA = load_workload("llama2_70b_lora")
EFF = Efficiency()


@pytest.fixture(autouse=True)
def _no_user_files(monkeypatch):
    """Only the shipped catalog and fitted efficiencies."""
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


CAT = load_catalog()


def _cluster(gpus: int, gpu: str, node: str | None = None) -> Cluster:
    return Cluster(*CAT.system(gpu, node), gpus)


# ---------------------------------------------------------------------------------------------------------------
# Catalog


@pytest.mark.parametrize("key", BLACKWELL + AMD + ("h200nvl",))
def test_new_gpus_load_with_a_datasheet_source_and_ordered_peaks(key):
    g = CAT.gpu(key)
    vendor = "AMD" if key.startswith("mi") else "NVIDIA"
    assert vendor in g.source and ("datasheet" in g.source or "data sheet" in g.source), g.source
    assert g.bf16_tflops > 0 and g.fp8_tflops >= 2 * g.bf16_tflops - 1  # dense FP8 is twice dense bf16
    if g.fp4_tflops:
        assert g.fp4_tflops >= 2 * g.fp8_tflops - 1
        assert 0 < g.matmul_fp4_tflops <= g.fp4_tflops
    for peak, ceiling in ((g.bf16_tflops, g.matmul_bf16_tflops), (g.fp8_tflops, g.matmul_fp8_tflops)):
        assert 0 < ceiling < peak
    assert g.hbm_copy_tbps < g.hbm_tbps
    # The default node holds it, and the trainer's MFU denominator finds it by its torch device name.
    assert CAT.node(g.default_node).gpu == key
    assert CAT.gpu_for_device(g.name).key == key


def test_datasheet_figures():
    """Dense (no sparsity) peaks, HBM and per-direction fabric bandwidth of the new entries."""
    table = {  # bf16, fp8, fp4, HBM GB, HBM TB/s, NVLink / Infinity Fabric GB/s per direction
        "b200": (2250, 4500, 9000, 180, 8.0, 900),
        "b300": (2250, 4500, 13500, 270, 8.0, 900),
        "gb200": (2500, 5000, 10000, 186, 8.0, 900),
        "gb300": (2500, 5000, 15000, 279, 8.0, 900),
        "mi300x": (1307.4, 2614.9, 0, 192, 5.3, 448),
        "mi325x": (1307.4, 2614.9, 0, 256, 6.0, 448),
        "mi350x": (2306.9, 4613.7, 9227.5, 288, 8.0, 537.6),
        "mi355x": (2516.6, 5033.2, 10066.4, 288, 8.0, 537.6),
    }
    for key, want in table.items():
        g = CAT.gpu(key)
        assert (g.bf16_tflops, g.fp8_tflops, g.fp4_tflops, g.hbm_gb, g.hbm_tbps, g.nvlink_gbps) == want, key
    # GPUs without FP4 tensor cores have none in the catalog.
    for key in ("a100", "h100", "h200", "mi300x", "mi325x"):
        assert CAT.gpu(key).fp4_tflops == 0 and CAT.gpu(key).matmul_fp4_tflops == 0


def test_nodes_nvl72_hgx_and_amd_platforms():
    for key in NVL72:
        n = CAT.node(key)
        assert n.nvlink_domain == 72 and n.nics == n.gpus_per_node == 4 and n.topology == "switch"
        # NVLS on the NVL72 switch: the ring figure x the 8xH100 NVLS/ring ratio.
        assert n.nvls_busbw_gbps == pytest.approx(1.30 * n.nvlink_busbw_gbps, abs=1)
    b3 = CAT.node("hgx-b300")
    assert (b3.gpu, b3.gpus_per_node, b3.nvlink_domain, b3.nics, b3.fabric) == ("b300", 8, 8, 8, "ib-xdr")
    for gpu in AMD:
        n = CAT.node(f"{gpu}-oam")
        assert (n.gpu, n.gpus_per_node, n.nvlink_domain, n.nics, n.nvls_busbw_gbps) == (gpu, 8, 8, 8, 0.0)
        assert n.topology == "mesh" and CAT.fabric(n.fabric).link_gbit == 400
        assert n.nvlink_busbw_gbps == pytest.approx(0.81 * CAT.gpu(gpu).nvlink_gbps, abs=1)
        assert "AMD" in n.source
    assert CAT.fabric("roce-800").link_gbit == 800


def test_a_node_topology_must_be_switch_or_mesh(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[nodes.hgx-h100]\ntopology = "torus"\n')
    with pytest.raises(CatalogError, match=r"bad.toml.*hgx-h100.*topology"):
        load_catalog([str(path)])


# ---------------------------------------------------------------------------------------------------------------
# NVLink domains larger than a node, meshes, NICs per GPU


def test_tp16_inside_the_nvl72_domain_is_an_nvlink_ring_and_on_hgx_crosses_the_nic():
    lay = ClusterLayout(gpus=144, tp=16, mbs=1, gbs=9, fp8=True, bf16_grads=True)
    assert not lay.problems(LORA)
    size = 1 * 8192 * 8192 * 2  # b * s * h bf16
    nvl = _cluster(144, "gb200")
    # Trays of 4 GPUs, but the 16 TP ranks sit in one 72-GPU NVLink domain: ring all-gather + reduce-scatter.
    assert nvl.placement(16, 1) == (16, 1)
    one = ring_reduce_scatter(16, size, 680.0, 2.0)
    assert step._tp_comm(LORA, lay, nvl) == pytest.approx(4 * one, rel=1e-12)
    # And that is what the prediction's TP line is made of: 80 layers, forward and backward, the exposed fraction.
    eff, p = efficiency_for(None, "gb200", "llama2_70b_lora")[1], predict(LORA, lay, "gb200")
    assert p.breakdown["tp_exposed"] == pytest.approx(80 * 2 * 4 * one * eff.tp_exposed, rel=1e-9)
    # The same TP16 on 8-GPU HGX B200 nodes: 8 ranks over NVLink, then 2 nodes over one 400G NIC per GPU.
    hgx = _cluster(144, "b200")
    assert hgx.placement(16, 1) == (8, 2)
    intra = ring_reduce_scatter(8, size, 680.0, 2.0)
    inter = ring_reduce_scatter(2, size / 8, 47.0, hgx.net_alpha_us(2))
    assert step._tp_comm(LORA, lay, hgx) == pytest.approx(4 * (intra + inter), rel=1e-12)
    assert step._tp_comm(LORA, lay, hgx) > 1.5 * step._tp_comm(LORA, lay, nvl)  # the NIC hop dominates


def test_nvls_all_reduce_inside_nvl72_and_not_for_reduce_scatter():
    cl, S = _cluster(144, "gb300"), 1e9
    assert cl.collective("all_reduce", 72, S) == pytest.approx(ring_all_reduce(72, S, 884.0, 2.0), rel=1e-12)
    assert cl.collective("reduce_scatter", 36, S, stride=2) == pytest.approx(ring_reduce_scatter(36, S, 680.0, 2.0))
    # Across two racks: NVLink inside each, the XDR fabric (one 800G NIC per GPU) between them.
    assert cl.placement(144, 1) == (72, 2)
    fabric = cl.fabric.busbw_gbps
    assert fabric == 94.0
    assert cl.collective("reduce_scatter", 144, S) == pytest.approx(
        ring_reduce_scatter(72, S, 680.0, 2.0) + ring_reduce_scatter(2, S / 72, fabric, cl.net_alpha_us(36))
    )


def test_infinity_fabric_mesh_gives_a_small_group_only_its_own_links():
    cl, S = _cluster(64, "mi300x"), 256e6
    # All 8: the full ring figure; TP2: one of the 7 links; TP4: three.
    assert cl.collective("reduce_scatter", 8, S) == pytest.approx(ring_reduce_scatter(8, S, 363.0, 2.0))
    assert cl.collective("reduce_scatter", 2, S) == pytest.approx(ring_reduce_scatter(2, S, 363.0 / 7, 2.0))
    assert cl.collective("all_gather", 4, S) == pytest.approx(ring_reduce_scatter(4, S, 363.0 * 3 / 7, 2.0))
    # A pipeline neighbour is one direct link away.
    assert cl.p2p(S, same_domain=True) == pytest.approx(2e-6 + S / (448e9 / 7))
    # NVSwitch nodes are unaffected by the group size.
    h = _cluster(64, "h100")
    assert h.collective("reduce_scatter", 2, S) == pytest.approx(ring_reduce_scatter(2, S, 365.0, 2.0))


def test_gpus_sharing_a_nic_share_its_bandwidth(tmp_path):
    path = tmp_path / "half.toml"
    path.write_text(
        '[nodes.half-nic]\nname = "HGX H100 with 4 NICs"\ngpu = "h100"\ngpus_per_node = 8\n'
        "nvlink_domain = 8\nnvlink_busbw_gbps = 365.0\nnvls_busbw_gbps = 470.0\nnics = 4\n"
        'fabric = "ib-ndr"\nsource = "test"\n'
    )
    cat = load_catalog([str(path)])
    full, half = Cluster(*cat.system("h100"), 1024), Cluster(*cat.system("h100", "half-nic"), 1024)
    S = 512e6
    assert half.nic_share == 0.5 and full.nic_share == 1.0
    alpha = half.net_alpha_us()
    assert half.collective("reduce_scatter", 128, S, stride=8) == pytest.approx(
        ring_reduce_scatter(128, S, 23.5, alpha), rel=1e-12
    )
    assert half.p2p(S, same_domain=False) == pytest.approx(alpha * 1e-6 + S / 23.5e9)


# ---------------------------------------------------------------------------------------------------------------
# FP4


def test_fp4_gemms_run_at_the_fp4_ceiling_and_beat_fp8():
    lay8 = ClusterLayout(gpus=72, tp=1, cp=8, gbs=9, fp8=True, bf16_grads=True)
    # No healing step: every step at the FP4 rate (the switch to FP8 is priced in test_sim_recipe).
    lay4 = ClusterLayout(gpus=72, tp=1, cp=8, gbs=9, fp8=True, fp4=True, bf16_grads=True, fp4_healing_step=0)
    p8, p4 = predict(LORA, lay8, "gb200"), predict(LORA, lay4, "gb200")
    assert p8.feasible and p4.feasible
    assert p4.step_time_s < p8.step_time_s and p4.time_to_train_min < p8.time_to_train_min
    # Only the GEMMs FP8 covers change: compute drops, the fixed overhead and the memory do not.
    assert p4.breakdown["compute"] < p8.breakdown["compute"]
    # At the FP4 ceiling's full fraction (fp4_eff 1, the prior) the layers' GEMMs take half their FP8 time; the
    # fitted fp4_eff keeps less of that.
    ideal_eff = replace(efficiency_for(None, "gb200", "llama2_70b_lora")[1], fp4_eff=1.0)
    assert predict(LORA, lay4, "gb200", eff=ideal_eff).breakdown["compute"] < 0.85 * p8.breakdown["compute"]
    assert p4.breakdown["overhead"] == p8.breakdown["overhead"]
    assert p4.memory_gib_per_gpu == p8.memory_gib_per_gpu
    assert p4.layout["fp4"] is True and "fp4" not in p8.layout
    from scaletrain.sim.compute import gemm_time

    g = CAT.gpu("gb200")
    assert gemm_time(g, 1e12, True, 0.5, fp4=True) == pytest.approx(1e12 / (7200e12 * 0.5) + 5e-6)
    assert gemm_time(g, 1e12, False, 0.5, fp4=True) == gemm_time(g, 1e12, False, 0.5)  # bf16 GEMMs stay bf16


def test_fp4_needs_fp8_and_fp4_tensor_cores():
    assert any("fp4 needs fp8" in r for r in ClusterLayout(gpus=8, gbs=8, fp4=True).problems(LORA))
    p = predict(LORA, ClusterLayout(gpus=8, tp=8, gbs=8, fp8=True, fp4=True), "h100")
    assert not p.feasible and any("no FP4 tensor cores" in r for r in p.reasons)
    with pytest.raises(ValueError, match="FP4"):
        plan(LORA, "mi300x", 8, fp4=True)


def test_predict_and_plan_fp4_flags(capsys):
    base = ["predict", "--model", "llama2_70b_lora", "--gpu", "gb200", "--gpus", "72", "--gbs", "9", "--cp", "8"]
    assert main([*base, "--fp8", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main([*base, "--fp4", "--json"]) == 0  # --fp4 implies the FP8 recipe
    fp4 = json.loads(capsys.readouterr().out)
    assert fp4["layout"]["fp8"] and fp4["layout"]["fp4"] and fp4["layout"]["bf16_grads"]
    assert fp4["step_time_s"] < fp8["step_time_s"]
    text = io.StringIO()  # print_prediction's default stream is the sys.stdout of its import time
    print_prediction(predict(LORA, ClusterLayout(gpus=72, cp=8, gbs=9, fp8=True, fp4=True), "gb200"), out=text)
    assert ", fp4, recompute" in text.getvalue()
    assert (
        main(["plan", "--model", "llama2_70b_lora", "--gpu", "gb200", "--gpus", "72", "--fp4", "--top", "2", "--json"])
        == 0
    )
    best = json.loads(capsys.readouterr().out)
    assert best and all(p["layout"]["fp4"] and p["layout"]["fp8"] for p in best)


# ---------------------------------------------------------------------------------------------------------------
# AMD


def test_mi355x_predicts_with_its_own_peaks():
    lay = ClusterLayout(gpus=64, tp=8, gbs=64, fp8=True, bf16_grads=True)
    mi = predict(LORA, lay, "mi355x")
    assert (mi.node, mi.fabric, mi.mfu_peak_tflops) == ("mi355x-oam", "roce", 2516.6)
    assert mi.feasible and mi.calibration == "v5.1/cdna4 (default)"
    # With the same efficiency set, the compute line scales with the GPU's own FP8 ceiling (MI355X 3574 vs
    # MI300X 1857 TFLOP/s): CDNA 4 is well over 1.5x faster per step on GEMM-bound work.
    eff = efficiency_for(None, "mi355x")[1]
    old = predict(LORA, lay, "mi300x", eff=eff)
    assert mi.breakdown["compute"] < old.breakdown["compute"] / 1.5
    mi4 = predict(LORA, ClusterLayout(gpus=64, tp=8, gbs=64, fp8=True, fp4=True, bf16_grads=True), "mi355x")
    assert mi4.feasible and mi4.step_time_s < mi.step_time_s


# ---------------------------------------------------------------------------------------------------------------
# Efficiency defaults


def test_generations_without_a_fitted_set_get_documented_defaults():
    sets = load_efficiencies()["sets"]
    hopper = Efficiency.from_dict(sets["v5.1/hopper"])
    for gpu, gen in (("a100", "ampere"), ("mi355x", "cdna4"), ("mi350x", "cdna4")):
        name, eff = efficiency_for(None, gpu)
        assert name == f"v5.1/{gen} (default)"
        # The release's shared scalars, with the documented default kernel efficiency (not Hopper's fitted one).
        assert eff.gemm_eff == DEFAULT_GEMM_EFF != hopper.gemm_eff
        assert (eff.tp_exposed, eff.dp_overlap, eff.step_overhead_s, eff.eval_eff, eff.sync_log2_s) == (
            hopper.tp_exposed,
            hopper.dp_overlap,
            hopper.step_overhead_s,
            hopper.eval_eff,
            hopper.sync_log2_s,
        )
    # A100 in an old release gets Ampere's default too, never the release's Hopper set.
    assert efficiency_for("v3.0", "a100")[0] == "v3.0/ampere (default)"
    # CDNA 3 has its own sets, fitted on the AMD rows of v5.0 and v5.1; a release before them takes the nearest.
    for gpu in ("mi300x", "mi325x"):
        assert efficiency_for(None, gpu)[0] == "v5.1/cdna3"
        assert efficiency_for("v5.0", gpu)[0] == "v5.0/cdna3"
        assert efficiency_for("v4.1", gpu)[0] == "v5.0/cdna3 (for v4.1)"
    assert efficiency_for(None, "mi300x")[1].gemm_eff != hopper.gemm_eff
    # A fitted generation in another release: its nearest release's set (Blackwell was first fitted in v4.1).
    assert efficiency_for("v4.0", "b300")[0] == "v4.1/blackwell (for v4.0)"
    assert efficiency_for(None, "gb300")[0] == "v5.1/blackwell"
    assert efficiency_for("v4.0", "h100")[0] == "v4.0/hopper"
    assert efficiency_for(None, "h200nvl")[0] == "v5.1/hopper"


def test_sets_are_specialised_per_gpu_sku_and_benchmark():
    doc = load_efficiencies()
    sku, bench = doc["sku_gemm"], doc["benchmarks"]
    # Each generation's reference SKU is its set; SKUs of it with calibration rows carry a fitted multiplier.
    assert {"mi325x", "b300", "gb200", "gb300", "h200"} <= set(sku) and not {"h100", "b200", "mi300x"} & set(sku)
    cdna3 = Efficiency.from_dict(doc["sets"]["v5.1/cdna3"])
    assert efficiency_for(None, "mi300x")[1].gemm_eff == cdna3.gemm_eff
    assert efficiency_for(None, "mi325x")[1].gemm_eff == pytest.approx(cdna3.gemm_eff * sku["mi325x"], rel=1e-12)
    assert sku["mi325x"] > 1.1  # the 1000 W MI325X sustains higher clocks than the 750 W MI300X at equal peaks
    # The benchmark's own TP exposure and its release's evaluation and one-off seconds; a model that is no MLPerf
    # benchmark gets the set's TP exposure, which is the pretraining benchmark's, and no run terms.
    lora = efficiency_for(None, "h100", "llama2_70b_lora")[1]
    plain = efficiency_for(None, "h100")[1]
    assert lora.tp_exposed == bench["llama2_70b_lora"]["tp_exposed"]
    assert plain.tp_exposed == efficiency_for(None, "h100", "gpt3")[1].tp_exposed == bench["gpt3"]["tp_exposed"]
    assert lora.one_off_s != plain.one_off_s and lora.eval_eff == plain.eval_eff == 1.0
    # predict picks the benchmark from the model: the LoRA preset is priced with LoRA's scalars.
    lay = ClusterLayout(gpus=8, tp=4, gbs=8, fp8=True, bf16_grads=True)
    ttt = predict(LORA, lay, "h100").time_to_train_min
    assert ttt == predict(LORA, lay, "h100", eff=lora).time_to_train_min
    assert ttt != predict(LORA, lay, "h100", eff=plain).time_to_train_min


def test_fp4_efficiency_scales_only_the_fp4_gemms():
    from scaletrain.sim import compute

    g = load_catalog().gpu("b200")
    flops, us = 2.0 * 8192**3, g.kernel_us * 1e-6
    full = compute.gemm_time(g, flops, True, 0.8, fp4=True)
    half = compute.gemm_time(g, flops, True, 0.8, fp4=True, fp4_eff=0.5)
    assert half - us == pytest.approx(2 * (full - us), rel=1e-12)
    assert compute.gemm_time(g, flops, True, 0.8, fp4_eff=0.5) == compute.gemm_time(g, flops, True, 0.8)
    fitted = load_efficiencies()["sets"]["v5.1/blackwell"]["fp4_eff"]
    assert 0.4 <= fitted < 1.0  # fitted on the FP4 rows: below FP8's fraction of its ceiling


# ---------------------------------------------------------------------------------------------------------------
# The hardware that was already there predicts what it did before this change (golden numbers from that code), at
# the efficiencies that code shipped, with the fixed-cost terms added since (fixed_costs) switched off.

OLD_SHARED = dict(
    tp_exposed=0.43763167830428634,
    dp_overlap=0.827973727837905,
    overlap_slowdown=0.08189610008753184,
    step_overhead_s=0.20239713710552923,
    eval_eff=0.6927855816986237,
    sync_log2_s=0.0,
    straggler_cv=0.0,
    warmup_steps=0.0,
    comm_init_s=0.0,
    eval_fixed_s=0.0,
)
GOLDEN = [  # model, gpu, node, layout, calibration, step_time_s, time_to_train_min
    (
        "llama2_70b_lora",
        "h200",
        "nd-h200-v5",
        dict(gpus=512, tp=4, cp=2, gbs=64, fp8=True, bf16_grads=True),
        None,
        0.6193013392155814,
        1.2597462106359198,
    ),
    (
        "gpt3",
        "h100",
        "nd-h100-v5",
        dict(gpus=10752, tp=4, pp=8, vp=12, gbs=2688, fp8=True, bf16_grads=True),
        "v3.1",
        1.0315135656688306,
        4.045065003299287,
    ),
    (
        "gpt3",
        "h100",
        "hgx-h100",
        dict(gpus=512, tp=8, pp=8, gbs=512, sp=False, zero=0),
        None,
        5.1858922645629795,
        108.55281955996307,
    ),
    (
        "llama2_70b_lora",
        "b200",
        "dgx-b200",
        dict(gpus=8, tp=2, gbs=8, fp8=True, bf16_grads=True),
        None,
        1.7567832065159317,
        13.472714318263769,
    ),
    (
        "gpt3",
        "b200",
        "dgx-b200",
        dict(gpus=1024, tp=4, pp=8, vp=4, gbs=1024, fp8=True, bf16_grads=True),
        None,
        1.5640144514905014,
        16.30050449968592,
    ),
]


@pytest.mark.parametrize("model,gpu,node,layout,calibration,step_s,ttt_min", GOLDEN)
def test_existing_hardware_predicts_what_it_did(model, gpu, node, layout, calibration, step_s, ttt_min):
    gemm = {
        "v3.1": 0.7474158945208146,
        None: {"h100": 0.8826661284240264, "h200": 0.8826661284240264, "b200": 0.7325522666396367},
    }
    eff = Efficiency(gemm_eff=gemm["v3.1"] if calibration else gemm[None][gpu], **OLD_SHARED)
    p = predict(load_workload(model), ClusterLayout(**layout), gpu, node, eff=eff)
    assert p.step_time_s == pytest.approx(step_s, rel=1e-12)
    assert p.time_to_train_min == pytest.approx(ttt_min, rel=1e-12)
