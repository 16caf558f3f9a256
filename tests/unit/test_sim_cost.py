"""Cost and energy of a run (sim/cost.py): GPU power at a busy share, node overhead, PUE, emissions, the catalog's
cloud prices (sim/hardware/prices.toml) and the override, the flags of cli/cost_args.py and `scaletrain sim prices`."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from scaletrain.cli.cost_args import cost_args, cost_from_args, cost_lines
from scaletrain.cli.main import main
from scaletrain.sim.catalog import CatalogError, load_catalog
from scaletrain.sim.cost import (
    DEFAULT_GRID_GCO2_PER_KWH,
    DEFAULT_PUE,
    busy_share,
    ceiling_share,
    gpu_power_w,
    list_price,
    run_cost,
)


@pytest.fixture(autouse=True)
def _no_user_catalog(monkeypatch):
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)


CAT = load_catalog()


def test_gpu_power_is_idle_plus_the_busy_share_of_the_rest_of_the_board_limit():
    h100 = CAT.gpu("h100")
    idle = 0.115 * 700  # 80.5 W: the documented idle fraction of the 700 W limit
    assert gpu_power_w(h100, 0.0) == pytest.approx(idle)
    assert gpu_power_w(h100, 1.0) == pytest.approx(700.0)
    assert gpu_power_w(h100, 0.5) == pytest.approx(idle + (700 - idle) / 2)  # 390.25 W
    assert busy_share({"compute": 6.0, "overlap_slowdown": 0.5, "optimizer": 0.5, "pp_bubble": 3.0}, 10.0) == 0.7
    assert busy_share({"compute": 1.0}, 0.0) == 0.0
    # The FLOP-rate measure: 466 model TFLOP/s of H100's 795 bf16 GEMM ceiling (1,400 FP8).
    assert ceiling_share(466.0, h100) == pytest.approx(466 / 795)
    assert ceiling_share(700.0, h100, fp8=True) == pytest.approx(0.5)
    assert ceiling_share(900.0, h100) == 1.0 and ceiling_share(100.0, CAT.gpu("a100"), fp8=True) == 0.0


def test_run_cost_against_hand_computed_numbers():
    g, n, _ = CAT.system("h100")  # hgx-h100: 8 GPUs and 4,600 W besides them per node
    rc = run_cost(g, n, 16, 10.0, 1.0, price_per_gpu_hour=2.5, pue=1.2, grid_gco2_per_kwh=400.0)
    assert rc.gpu_hours == 160 and rc.usd == pytest.approx(400.0) and rc.nodes == 2
    # IT: 16 x 700 W + 2 x 4,600 W = 20,400 W; x 10 h x 1.2 = 0.2448 MWh; x 400 g/kWh = 0.09792 t.
    assert rc.it_mw == pytest.approx(0.0204)
    assert rc.energy_mwh == pytest.approx(0.2448)
    assert rc.tco2e == pytest.approx(0.09792)
    assert rc.price_source == "--price-per-gpu-hour" and rc.price_key is None
    # A part-filled node still runs its CPUs and switches: 9 GPUs hold 2 nodes.
    assert run_cost(g, n, 9, 1.0, 1.0).nodes == 2
    d = rc.to_dict()
    for key in ("gpu_hours", "usd", "usd_per_gpu_hour", "price_source", "gpu_power_w", "node_overhead_w", "it_mw"):
        assert key in d
    for key in ("pue", "energy_mwh", "grid_gco2_per_kwh", "tco2e"):
        assert key in d
    assert json.loads(json.dumps(d)) == d


def test_defaults_are_the_documented_pue_and_grid_and_the_catalog_list_price():
    g, n, _ = CAT.system("h100")
    rc = run_cost(g, n, 8, 1.0, 0.0)
    assert (rc.pue, rc.grid_gco2_per_kwh) == (DEFAULT_PUE, DEFAULT_GRID_GCO2_PER_KWH) == (1.58, 445.0)
    assert rc.price_key == "azure-nd-h100-v5" and rc.usd_per_gpu_hour == 12.29 and rc.usd == pytest.approx(8 * 12.29)
    assert "98.32" in rc.price_source and "2026-09-27" in rc.price_source and rc.price_date == "2026-09-27"
    # Idle GPUs: 8 x 80.5 W + 4,600 W, for an hour, x 1.58.
    assert rc.energy_mwh == pytest.approx((8 * 80.5 + 4600) / 1e6 * 1.58)


@pytest.mark.parametrize(
    "gpu, node, key",
    [
        ("h100", "hgx-h100", "azure-nd-h100-v5"),
        ("h100", "nd-h100-v5", "azure-nd-h100-v5"),
        ("h200", "hgx-h200", "azure-nd-h200-v5"),
        ("b200", "dgx-b200", "aws-p6-b200"),
        ("h800", "hgx-h800", "deepseek-v3-h800"),
        ("gb200", "gb200-nvl72", None),
        ("mi300x", "mi300x-oam", None),
    ],
)
def test_list_price_picks_the_nodes_entry_else_the_gpus_first(gpu, node, key):
    found = list_price(gpu, node, CAT)
    assert (found.key if found else None) == key


def test_a_gpu_without_a_price_has_energy_but_no_cost_and_the_override_prices_it():
    g, n, _ = CAT.system("gb200")
    rc = run_cost(g, n, 72, 2.0, 0.5)
    assert rc.usd is None and rc.usd_per_gpu_hour is None and rc.price_source is None
    assert rc.energy_mwh is not None and rc.nodes == 18
    assert "no price listed" in cost_lines(rc)[0]
    assert run_cost(g, n, 72, 2.0, 0.5, price_per_gpu_hour=3.0).usd == pytest.approx(432.0)


def test_h800_is_priced_at_deepseeks_assumed_rental_price():
    g, n, _ = CAT.system("h800")
    rc = run_cost(g, n, 2048, 1000.0, 0.8)
    assert rc.usd_per_gpu_hour == 2.0 and rc.usd == pytest.approx(2048 * 1000 * 2.0)
    assert "2412.19437" in rc.price_source
    assert "deepseek-v3-h800" in cost_lines(rc)[0] and "MWh" in cost_lines(rc)[1]


def test_a_user_price_file_adds_entries_and_a_node_match_wins(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text(
        '[prices.own-cluster]\ngpu = "h100"\nnode = "hgx-h100"\nusd_per_gpu_hour = 1.5\nsource = "our contract"\n'
        'date = 2026-11-01\nnote = "reserved, 3 years"\n'
    )
    cat = load_catalog(extra=[str(path)])
    assert list_price("h100", "hgx-h100", cat).key == "own-cluster"
    assert list_price("h100", "nd-h100-v5", cat).key == "azure-nd-h100-v5"
    assert cat.prices["own-cluster"].date == "2026-11-01"  # a TOML date reads as its ISO text


@pytest.mark.parametrize(
    "fields, what",
    [
        ({"usd_per_gpu_hour": "-2.0"}, "usd_per_gpu_hour=-2.0"),
        ({"usd_per_gpu_hour": "0.0"}, "usd_per_gpu_hour=0: must be a price above 0"),
        ({"usd_per_gpu_hour": "nan"}, "usd_per_gpu_hour=nan"),
        ({"date": '"last week"'}, "date='last week': must be a date YYYY-MM-DD"),
        ({"gpu": '"h300"'}, "price 'bad' names unknown gpu 'h300'"),
        ({"node": '"hgx-h200"'}, "price 'bad': node 'hgx-h200' holds 'h200' GPUs, not 'h100'"),
        ({"node": '"rack-9"'}, "price 'bad' names unknown node 'rack-9'"),
        ({"currency": '"EUR"'}, "[prices.bad] unknown fields ['currency']"),
    ],
    ids=["negative", "zero", "nan", "date", "gpu", "node-of-other-gpu", "unknown-node", "unknown-field"],
)
def test_bad_price_entries_are_one_line_naming_the_file(tmp_path, fields, what):
    entry = {"gpu": '"h100"', "usd_per_gpu_hour": "2.0", "source": '"x"', "date": '"2026-01-01"', "note": '"x"'}
    entry.update(fields)
    path = tmp_path / "bad.toml"
    path.write_text("[prices.bad]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    with pytest.raises(CatalogError) as exc:
        load_catalog(extra=[str(path)])
    msg = str(exc.value)
    assert str(path) in msg and what in msg and "\n" not in msg


def test_every_shipped_price_names_its_source_and_date():
    assert len(CAT.prices) >= 10
    for p in CAT.prices.values():
        assert p.usd_per_gpu_hour > 0 and p.source.strip() and p.note.strip(), p.key
        assert p.date[:2] == "20" and len(p.date) == 10, p.key
    # The multi-GPU VM prices are the VM's price over its 8 GPUs, as their notes say.
    assert CAT.prices["azure-nd-h100-v5"].usd_per_gpu_hour == pytest.approx(98.32 / 8, abs=0.005)
    assert CAT.prices["aws-p5"].usd_per_gpu_hour == pytest.approx(55.04 / 8)


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"pue": 0.9}, "pue must be >= 1"),
        ({"pue": math.nan}, "pue must be a finite number"),
        ({"price_per_gpu_hour": -1.0}, "price_per_gpu_hour must be >= 0"),
        ({"grid_gco2_per_kwh": math.inf}, "grid_gco2_per_kwh must be a finite number"),
        ({"utilisation": 1.5}, "utilisation must be in [0, 1]"),
        ({"hours": -1.0}, "hours must be >= 0"),
        ({"gpus": 0}, "gpus must be a positive integer"),
    ],
)
def test_run_cost_refuses_bad_values_in_one_line(kwargs, what):
    g, n, _ = CAT.system("h100")
    args = {"gpu": g, "node": n, "gpus": 8, "hours": 1.0, "utilisation": 0.5, **kwargs}
    with pytest.raises(ValueError, match=re.escape(what)):
        run_cost(**args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    cost_args(p)
    return p


@pytest.mark.parametrize(
    "argv", [["--pue", "0.95"], ["--pue", "nan"], ["--price-per-gpu-hour", "-1"], ["--grid-gco2-per-kwh", "inf"]]
)
def test_cost_flags_refuse_bad_values_with_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert argv[0] in err[-1]


def test_cost_from_args_applies_the_flags():
    g, n, _ = CAT.system("h200")
    args = _parser().parse_args(["--price-per-gpu-hour", "3", "--pue", "1.1", "--grid-gco2-per-kwh", "100"])
    rc = cost_from_args(args, g, n, 8, 2.0, 1.0, CAT)
    assert (rc.usd, rc.pue, rc.grid_gco2_per_kwh) == (48.0, 1.1, 100.0)
    plain = cost_from_args(_parser().parse_args([]), g, n, 8, 2.0, 1.0, CAT)
    assert plain.price_key == "azure-nd-h200-v5" and plain.pue == DEFAULT_PUE
    # A parser without the flags reads as none given.
    assert cost_from_args(argparse.Namespace(), g, n, 8, 2.0, 1.0, CAT).price_key == "azure-nd-h200-v5"


def test_sim_prices_lists_the_table_with_sources(capsys):
    assert main(["sim", "prices"]) == 0
    out = capsys.readouterr().out
    for key in ("azure-nd-h100-v5", "azure-nd-h200-v5", "aws-p5", "gcp-a3-highgpu-8g", "deepseek-v3-h800"):
        assert key in out
    assert "prices.azure.com" in out and "2026-09-27" in out
    assert main(["sim", "prices", "--gpu", "h200", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["gpu"] for r in rows} == {"h200"} and {"key", "source", "date", "note"} <= set(rows[0])
    assert main(["sim", "prices", "--gpu", "h300"]) == 2
    assert "unknown gpu 'h300'" in capsys.readouterr().err
