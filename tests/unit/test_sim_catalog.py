"""Hardware catalog: the shipped GPUs, nodes and fabrics, user TOML files that add or replace entries, and the
errors malformed files raise (CatalogError naming the file and the entry)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scaletrain.sim import step
from scaletrain.sim.catalog import IDLE_FRACTION, CatalogError, load_catalog, mfu_peak
from scaletrain.sim.comm import Cluster
from scaletrain.sim.predict import predict
from scaletrain.sim.workload import ClusterLayout, load_workload

GPUS = (
    "a100",
    "h100",
    "h200",
    "h200nvl",
    "h800",
    "b200",
    "b300",
    "gb200",
    "gb300",
    "mi300x",
    "mi325x",
    "mi350x",
    "mi355x",
)
NODES = (
    "hgx-h100",
    "nd-h100-v5",
    "hgx-h200",
    "nd-h200-v5",
    "hgx-h800",
    "dgx-a100",
    "dgx-b200",
    "nd-gb200-v6",
    "gb200-nvl72",
    "gb300-nvl72",
    "hgx-b300",
    "mi300x-oam",
    "mi325x-oam",
    "mi350x-oam",
    "mi355x-oam",
)
FABRICS = ("ib-ndr", "ib-ndr-sharp", "ib-xdr", "ib-hdr", "roce", "roce-800")

# A complete GPU entry (every required field) for user files; its default node is NEW_NODE.
NEW_GPU = """
[gpus.mi999]
name = "Made-up accelerator"
bf16_tflops = 1000.0
fp8_tflops = 2000.0
matmul_bf16_tflops = 800.0
matmul_fp8_tflops = 1500.0
attn_tflops = 500.0
hbm_gb = 192.0
hbm_tbps = 5.3
hbm_copy_tbps = 4.5
nvlink_gbps = 400.0
kernel_us = 5.0
source = "test"
generation = "cdna3"
default_node = "mi999-box"
"""

NEW_NODE = """
[nodes.mi999-box]
name = "Eight made-up accelerators"
gpu = "mi999"
gpus_per_node = 8
nvlink_domain = 8
nvlink_busbw_gbps = 300.0
nvls_busbw_gbps = 0.0
nics = 8
fabric = "roce"
source = "test"
"""

# The shipped h100 entry with one field changed: replacing an entry means giving all its fields.
H100_OVERRIDE = """
[gpus.h100]
name = "NVIDIA H100 SXM5 80GB (user override)"
bf16_tflops = 989.0
fp8_tflops = 1979.0
matmul_bf16_tflops = 700.0
matmul_fp8_tflops = 1400.0
attn_tflops = 480.0
hbm_gb = 80.0
hbm_tbps = 3.35
hbm_copy_tbps = 2.95
nvlink_gbps = 450.0
kernel_us = 5.0
source = "user measurement"
"""

FABRIC = """
[fabrics.tiny]
name = "tiny"
link_gbit = 100.0
busbw_gbps = 11.0
alpha_us = 5.0
hop_us = 1.0
radix = {radix}
sharp = false
source = "test"
"""


@pytest.fixture(autouse=True)
def _no_user_catalog(monkeypatch):
    """The tests see only the shipped catalog unless they set $SCALETRAIN_CATALOG themselves."""
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)


def _write(tmp_path: Path, text: str, name: str = "user.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_catalog_has_every_gpu_node_and_fabric():
    cat = load_catalog()
    assert set(cat.gpus) == set(GPUS)
    assert set(NODES) <= set(cat.nodes)
    assert set(FABRICS) <= set(cat.fabrics)
    for table in (cat.gpus, cat.nodes, cat.fabrics):
        for key, entry in table.items():
            assert entry.key == key
            assert entry.source.strip(), f"{key} has no source"
            assert entry.name.strip(), f"{key} has no name"
    for node in cat.nodes.values():
        assert node.gpu in cat.gpus and node.fabric in cat.fabrics
        assert node.nvlink_domain % node.gpus_per_node == 0
    # Every GPU has a default node that holds it.
    for gpu in GPUS:
        assert cat.node(cat.gpu(gpu).default_node).gpu == gpu


def test_gpu_figures_match_the_reference_table():
    """docs/perf-model.md "Hardware": dense peaks, measured matmul ceilings, HBM, NVLink per direction, domain size."""
    cat = load_catalog()
    table = {  # bf16, fp8, matmul bf16, HBM GB, HBM TB/s, NVLink GB/s
        "a100": (312, 0, 271, 80, 2.04, 300),
        "h100": (989, 1979, 795, 80, 3.35, 450),
        "h200": (989, 1979, 790, 141, 4.8, 450),
        "b200": (2250, 4500, 1745, 180, 8.0, 900),
        "gb200": (2500, 5000, 1820, 186, 8.0, 900),
        "gb300": (2500, 5000, 1967, 279, 8.0, 900),
    }
    for key, (bf16, fp8, mm, hbm, tbps, nvl) in table.items():
        g = cat.gpu(key)
        assert (g.bf16_tflops, g.fp8_tflops, g.matmul_bf16_tflops, g.hbm_gb, g.hbm_tbps, g.nvlink_gbps) == (
            bf16,
            fp8,
            mm,
            hbm,
            tbps,
            nvl,
        ), key
        # Measured ceilings sit under the dense peaks.
        assert g.matmul_bf16_tflops < g.bf16_tflops
        assert g.matmul_fp8_tflops <= g.fp8_tflops
        assert g.hbm_copy_tbps <= g.hbm_tbps
        # The trainer's MFU denominator is this catalog's dense bf16 peak (one table).
        assert mfu_peak(g.name) == (key, g.bf16_tflops)
    assert cat.gpu("h200").hbm_copy_tbps == 4.3  # "[~4.3 copy]"
    assert cat.gpu("h100").matmul_fp8_tflops == 1400 and cat.gpu("h200").matmul_fp8_tflops == 1450
    # NVLink domains: 8 in HGX boards, 72 in NVL72 racks; measured busbw figures.
    assert cat.node("hgx-h100").nvlink_domain == 8 and cat.node("gb200-nvl72").nvlink_domain == 72
    assert cat.node("hgx-h100").nvlink_busbw_gbps == 365 and cat.node("hgx-h100").nvls_busbw_gbps == 470
    assert cat.node("gb200-nvl72").nvlink_busbw_gbps == 680
    assert 46 <= cat.fabric("ib-ndr").busbw_gbps <= 48
    assert cat.fabric("ib-ndr-sharp").sharp and not cat.fabric("ib-ndr").sharp
    # ND GB200 v6: 4 GPUs per VM, 18 VMs per NVL72 rack, 4 NICs per VM; GB300: 4x 800 Gb/s XDR per node.
    nd = cat.node("nd-gb200-v6")
    assert (nd.gpus_per_node, nd.nvlink_domain // nd.gpus_per_node, nd.nics) == (4, 18, 4)
    gb3 = cat.node("gb300-nvl72")
    assert (gb3.nics, cat.fabric(gb3.fabric).link_gbit) == (4, 800.0)


def test_fat_tree_tiers():
    ndr = load_catalog().fabric("ib-ndr")
    assert ndr.radix == 64
    assert [ndr.tiers(n) for n in (1, 64, 65, 2048, 2049, 10752, 65536, 65537)] == [1, 1, 2, 2, 3, 3, 3, 4]


def test_lookup_is_case_insensitive_and_unknown_keys_list_the_known_ones():
    cat = load_catalog()
    assert cat.gpu("H100") is cat.gpu("h100")
    with pytest.raises(CatalogError) as exc:
        cat.gpu("h300")
    msg = str(exc.value)
    assert "'h300'" in msg
    for key in GPUS:
        assert key in msg
    with pytest.raises(CatalogError, match="hgx-h100"):
        cat.node("no-such-node")
    with pytest.raises(CatalogError, match="ib-ndr"):
        cat.fabric("token-ring")


def test_system_picks_default_node_and_fabric_and_checks_the_node_holds_the_gpu():
    cat = load_catalog()
    g, n, f = cat.system("gb200")
    assert (g.key, n.key, f.key) == ("gb200", "gb200-nvl72", "ib-ndr")
    assert n.nvlink_domain == 72
    g, n, f = cat.system("h100", "nd-h100-v5")
    assert (g.key, n.key, f.key) == ("h100", "nd-h100-v5", "ib-ndr")
    assert cat.system("a100")[2].key == "ib-hdr"
    assert cat.system("h100", fabric="roce")[2].key == "roce"
    with pytest.raises(CatalogError, match="hgx-h200.*h200.*h100"):
        cat.system("h100", "hgx-h200")
    with pytest.raises(CatalogError, match="gb200"):
        cat.system("b200", "gb200-nvl72")


def test_user_file_adds_entries_and_overrides_shipped_ones(tmp_path):
    path = _write(tmp_path, NEW_GPU + NEW_NODE + H100_OVERRIDE)
    cat = load_catalog(extra=[str(path)])
    new = cat.gpu("mi999")
    assert (new.bf16_tflops, new.hbm_gb, new.source) == (1000.0, 192.0, "test")
    assert cat.gpu("h100").matmul_bf16_tflops == 700.0  # overridden
    assert cat.gpu("h100").source == "user measurement"
    assert cat.gpu("h200").matmul_bf16_tflops == 790.0  # untouched
    g, n, f = cat.system("mi999", "mi999-box")
    assert (g.key, n.key, f.key) == ("mi999", "mi999-box", "roce")
    # The shipped catalog is not modified by loading a user file.
    assert load_catalog().gpu("h100").matmul_bf16_tflops == 795.0
    assert "mi999" not in load_catalog().gpus


def test_env_var_files_load_before_extra_files(tmp_path, monkeypatch):
    env_file = _write(tmp_path, NEW_GPU + NEW_NODE, "env.toml")
    override = _write(tmp_path, NEW_GPU.replace("hbm_gb = 192.0", "hbm_gb = 256.0"), "extra.toml")
    second = _write(tmp_path, H100_OVERRIDE, "second.toml")
    monkeypatch.setenv("SCALETRAIN_CATALOG", os.pathsep.join([str(env_file), str(second)]))
    cat = load_catalog()
    assert cat.gpu("mi999").hbm_gb == 192.0
    assert cat.gpu("h100").matmul_bf16_tflops == 700.0
    # Later files win: `extra` after the environment.
    assert load_catalog(extra=[str(override)]).gpu("mi999").hbm_gb == 256.0
    monkeypatch.setenv("SCALETRAIN_CATALOG", str(tmp_path / "missing.toml"))
    with pytest.raises(CatalogError, match="missing.toml"):
        load_catalog()


@pytest.mark.parametrize(
    "text, entry, what",
    [
        (NEW_GPU + "tflops_typo = 3.0\n", "[gpus.mi999]", "unknown fields ['tflops_typo']"),
        (NEW_GPU.replace("hbm_gb = 192.0\n", ""), "[gpus.mi999]", "missing fields ['hbm_gb']"),
        (NEW_GPU.replace("hbm_tbps = 5.3", "hbm_tbps = -5.3"), "[gpus.mi999]", "hbm_tbps"),
        (NEW_GPU.replace("bf16_tflops = 1000.0", 'bf16_tflops = "fast"'), "[gpus.mi999]", "bf16_tflops"),
        (NEW_GPU + NEW_NODE.replace("gpus_per_node = 8", "gpus_per_node = 0"), "[nodes.mi999-box]", "gpus_per_node"),
        (NEW_GPU + NEW_NODE.replace("gpus_per_node = 8", "gpus_per_node = 2.5"), "[nodes.mi999-box]", "gpus_per_node"),
        (FABRIC.format(radix=64).replace("sharp = false", 'sharp = "yes"'), "[fabrics.tiny]", "sharp"),
    ],
    ids=["unknown-field", "missing-field", "negative", "not-a-number", "zero-int", "fractional-int", "bad-bool"],
)
def test_malformed_entries_name_the_file_and_entry(tmp_path, text, entry, what):
    path = _write(tmp_path, text)
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    msg = str(exc.value)
    assert str(path) in msg
    assert entry in msg
    assert what in msg


def test_bad_toml_and_unknown_table_name_the_file(tmp_path):
    path = _write(tmp_path, "[gpus.mi999\nname = 1\n")
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    assert str(path) in str(exc.value) and "not valid TOML" in str(exc.value)
    path = _write(tmp_path, "[switches.x]\nname = 'x'\n", "table.toml")
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    assert str(path) in str(exc.value) and "[switches]" in str(exc.value)


def test_node_naming_unknown_gpu_or_fabric_is_rejected(tmp_path):
    path = _write(tmp_path, NEW_NODE)  # no [gpus.mi999] anywhere
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    assert "mi999-box" in str(exc.value) and "'mi999'" in str(exc.value)
    path = _write(tmp_path, NEW_GPU + NEW_NODE.replace('fabric = "roce"', 'fabric = "carrier-pigeon"'), "f.toml")
    with pytest.raises(CatalogError, match="carrier-pigeon"):
        load_catalog(extra=[str(path)])
    path = _write(tmp_path, NEW_GPU + NEW_NODE.replace("nvlink_domain = 8", "nvlink_domain = 12"), "d.toml")
    with pytest.raises(CatalogError, match="mi999-box.*nvlink_domain"):
        load_catalog(extra=[str(path)])


def test_node_naming_unknown_gpu_names_the_file(tmp_path):
    path = _write(tmp_path, NEW_NODE)
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("text", ["[gpus]\nh100 = 5\n", "gpus = 3\n"], ids=["entry-not-table", "kind-not-table"])
def test_entry_that_is_not_a_table_raises_catalog_error(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    assert str(path) in str(exc.value)


def test_nan_number_is_rejected(tmp_path):
    path = _write(tmp_path, NEW_GPU.replace("hbm_tbps = 5.3", "hbm_tbps = nan"))
    with pytest.raises(CatalogError, match="hbm_tbps"):
        load_catalog(extra=[str(path)])


def test_fabric_radix_reaches_further_with_more_ports(tmp_path):
    path = _write(tmp_path, FABRIC.format(radix=4))
    f = load_catalog(extra=[str(path)]).fabric("tiny")
    # radix 4: 4 endpoints on one switch, 8 with two levels, 16 with three.
    assert [f.tiers(n) for n in (4, 5, 8, 9, 16, 17)] == [1, 2, 2, 3, 3, 4]


def test_partial_override_of_a_known_entry(tmp_path):
    path = _write(tmp_path, "[gpus.h100]\nhbm_gb = 96.0\n", "partial.toml")
    g = load_catalog(extra=[str(path)]).gpu("h100")
    assert g.hbm_gb == 96.0 and g.bf16_tflops == 989.0


@pytest.mark.parametrize("radix", [1, 2])
def test_fabric_radix_below_three_is_rejected(tmp_path, radix):
    path = _write(tmp_path, FABRIC.format(radix=radix))
    with pytest.raises(CatalogError, match="radix"):
        load_catalog(extra=[str(path)])


@pytest.mark.parametrize(
    "name,key,peak",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 989.0),
        ("NVIDIA H200", "h200", 989.0),
        ("NVIDIA A100-SXM4-80GB", "a100", 312.0),
        ("NVIDIA GB200", "gb200", 2500.0),
        ("NVIDIA B200", "b200", 2250.0),
        ("NVIDIA H800", "h800", 989.0),
        ("NVIDIA H800 80GB HBM3", "h800", 989.0),
        ("NVIDIA H800-SXM5-80GB", "h800", 989.0),
        ("Some Other GPU", None, None),
    ],
)
def test_mfu_peak_is_the_catalogs_dense_bf16_peak_by_device_name(name, key, peak):
    assert mfu_peak(name) == (None if key is None else (key, peak))
    if key:
        assert load_catalog().gpu_for_device(name).bf16_tflops == peak


def test_published_system_text_picks_a_cloud_node_of_the_rows_gpu_by_its_system_patterns():
    cat = load_catalog()
    pick = {
        (g, text): cat.node_for_system(cat.gpu(g), text).key
        for g in ("h100", "h200", "gb200", "b200")
        for text in ("Azure ND96isr", "Dell XE9680", "nd_h100_v5")
    }
    assert pick[("h100", "Azure ND96isr")] == "nd-h100-v5" and pick[("h100", "nd_h100_v5")] == "nd-h100-v5"
    assert pick[("h200", "Azure ND96isr")] == "nd-h200-v5" and pick[("gb200", "Azure ND96isr")] == "nd-gb200-v6"
    # No Azure node type of B200, and another GPU's node type is not this row's: the GPU's default node.
    assert pick[("b200", "Azure ND96isr")] == "dgx-b200" and pick[("h200", "nd_h100_v5")] == "hgx-h200"
    assert {pick[(g, "Dell XE9680")] for g in ("h100", "h200", "gb200")} == {"hgx-h100", "hgx-h200", "gb200-nvl72"}


def test_a_bad_name_pattern_is_rejected(tmp_path):
    path = _write(tmp_path, "[gpus.h100]\nname_patterns = ['h100(']\n")
    with pytest.raises(CatalogError, match=r"\[gpus.h100\] name_patterns.*not a regular expression"):
        load_catalog(extra=[str(path)])


def test_h800_is_the_h100_die_with_nvlink_cut_to_200_gbps_each_way():
    cat = load_catalog()
    h800, h100 = cat.gpu("h800"), cat.gpu("h100")
    same = ("bf16_tflops", "fp8_tflops", "matmul_bf16_tflops", "matmul_fp8_tflops", "attn_tflops", "hbm_gb", "tdp_w")
    assert [getattr(h800, f) for f in same] == [getattr(h100, f) for f in same]
    assert (h800.nvlink_gbps, h100.nvlink_gbps) == (200.0, 450.0)  # 400 GB/s vs 900 GB/s, both directions
    assert h800.generation == "hopper" and "2412.19437" in h800.source
    # No H800 kernel was measured: every ceiling is H100's, said to be derived.
    assert {h800.basis(c) for c in ("matmul_bf16", "matmul_fp8", "attn")} == {"derived"}
    node = cat.node(h800.default_node)
    assert (node.key, node.gpus_per_node, node.nvlink_domain, node.nics, node.fabric) == ("hgx-h800", 8, 8, 8, "ib-ndr")
    # The ring figure is H100's measured one scaled by the NVLink ratio; no NVLS without a source.
    assert node.nvlink_busbw_gbps == pytest.approx(cat.node("hgx-h100").nvlink_busbw_gbps * 200 / 450, abs=0.5)
    assert node.nvls_busbw_gbps == 0.0
    # "h800" steals neither its neighbours nor they it.
    assert cat.gpu_for_device("NVIDIA H100 80GB HBM3").key == "h100"
    assert cat.gpu_for_device("NVIDIA H200").key == "h200"


def test_predict_h800_prices_a_tp8_step_slower_than_h100_by_its_nvlink_alone(capsys):
    gpt3 = load_workload("gpt3")
    lay = ClusterLayout(gpus=64, tp=8, pp=8, mbs=1, gbs=64)
    h100, h800 = predict(gpt3, lay, "h100"), predict(gpt3, lay, "h800")
    assert h800.node == "hgx-h800" and h800.feasible
    # Same die: the same compute; the TP8 ring inside the node is what slows.
    assert h800.breakdown["compute"] == pytest.approx(h100.breakdown["compute"], rel=1e-12)
    assert h800.breakdown["tp_exposed"] > 2 * h100.breakdown["tp_exposed"]
    assert h800.step_time_s > h100.step_time_s
    cat = load_catalog()
    slow = step._tp_comm(gpt3, lay, Cluster(*cat.system("h800"), 64))
    fast = step._tp_comm(gpt3, lay, Cluster(*cat.system("h100"), 64))
    assert slow / fast == pytest.approx(365 / 162, rel=0.1)  # bandwidth-bound: the busbw ratio, less latency
    from scaletrain.cli.main import main

    assert main(["predict", "--model", "gpt3-175b", "--gpu", "h800", "--gpus", "64", "--tp", "8", "--pp", "8"]) == 0
    assert "x h800 (hgx-h800, ib-ndr)" in capsys.readouterr().out


def test_every_shipped_gpu_and_node_carries_its_power():
    cat = load_catalog()
    for gpu in cat.gpus.values():
        assert gpu.tdp_w >= 400, gpu.key
        assert gpu.idle_power_w() == pytest.approx(IDLE_FRACTION * gpu.tdp_w), gpu.key
    assert cat.gpu("h100").tdp_w == 700 and cat.gpu("b200").tdp_w == 1000 and cat.gpu("mi300x").tdp_w == 750
    for node in cat.nodes.values():
        assert node.node_overhead_w > 0, node.key
    # DGX H100: 10.2 kW maximum less 8 x 700 W; DGX B200: 14.3 kW less 8 x 1,000 W.
    assert cat.node("hgx-h100").node_overhead_w == 10200 - 8 * 700
    assert cat.node("dgx-b200").node_overhead_w == 14300 - 8 * 1000


@pytest.mark.parametrize(
    "text, what",
    [
        ("[gpus.h100]\nidle_w = 800.0\n", "[gpus.h100] idle_w=800: above tdp_w=700"),
        ("[gpus.h100]\ntdp_w = -700.0\n", "[gpus.h100] tdp_w=-700.0"),
        ("[nodes.hgx-h100]\nnode_overhead_w = nan\n", "[nodes.hgx-h100] node_overhead_w=nan"),
        (NEW_GPU + "idle_w = 50.0\n" + NEW_NODE, "[gpus.mi999] idle_w=50: above tdp_w=0"),
    ],
    ids=["idle-above-tdp", "negative-tdp", "nan-overhead", "idle-without-tdp"],
)
def test_bad_power_fields_are_one_line_naming_the_file_and_entry(tmp_path, text, what):
    path = _write(tmp_path, text)
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    msg = str(exc.value)
    assert str(path) in msg and what in msg and "\n" not in msg


def test_a_user_gpu_without_power_fields_loads_with_the_defaults(tmp_path):
    cat = load_catalog(extra=[str(_write(tmp_path, NEW_GPU + NEW_NODE))])
    assert (cat.gpu("mi999").tdp_w, cat.gpu("mi999").idle_power_w(), cat.node("mi999-box").node_overhead_w) == (0, 0, 0)
