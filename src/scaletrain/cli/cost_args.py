"""The cost and energy flags (--price-per-gpu-hour, --pue, --grid-gco2-per-kwh) for predict and plan, the text lines
that show a run's cost, and `scaletrain sim prices`, the catalog's price table with its sources.

The arithmetic is `scaletrain.sim.cost`; this module only reads flags and prints.
"""

from __future__ import annotations

import argparse
import json

from scaletrain.config_bounds import float_flag
from scaletrain.sim.catalog import GPU, Catalog, Node, load_catalog
from scaletrain.sim.cost import DEFAULT_GRID_GCO2_PER_KWH, DEFAULT_PUE, RunCost, run_cost

PRICE_MAX = 1e4
"""Largest --price-per-gpu-hour: $10,000 per GPU-hour, a thousand times any list price in the catalog."""

PUE_MAX = 5.0
"""Largest --pue: above the worst facilities surveys report (Uptime Institute's 2007 average was 2.5)."""

GRID_MAX = 2000.0
"""Largest --grid-gco2-per-kwh: about twice the intensity of lignite-fired generation (~1,100 gCO2/kWh)."""


def cost_args(parser: argparse.ArgumentParser) -> None:
    """Add --price-per-gpu-hour, --pue and --grid-gco2-per-kwh to `parser` (each validated: a NaN, an infinity, a
    negative price, a PUE below 1 are one line, exit 2)."""
    parser.add_argument(
        "--price-per-gpu-hour",
        type=float_flag(0.0, PRICE_MAX),
        default=None,
        metavar="USD",
        help="price of one GPU-hour in US dollars for the run's cost (default: the catalog's list price for the GPU "
        "and node, named with its source and date; `scaletrain sim prices` lists them)",
    )
    parser.add_argument(
        "--pue",
        type=float_flag(1.0, PUE_MAX),
        default=None,
        metavar="X",
        help=f"power usage effectiveness of the facility, >= 1 (default {DEFAULT_PUE:g}, the Uptime Institute 2023 "
        "industry average; hyperscale facilities run about 1.1)",
    )
    parser.add_argument(
        "--grid-gco2-per-kwh",
        type=float_flag(0.0, GRID_MAX),
        default=None,
        metavar="G",
        help=f"carbon intensity of the electricity in gCO2e/kWh for the run's emissions (default "
        f"{DEFAULT_GRID_GCO2_PER_KWH:g}, the 2024 world average, IEA Electricity 2025)",
    )


def cost_from_args(
    args: argparse.Namespace,
    gpu: GPU,
    node: Node,
    gpus: int,
    hours: float,
    utilisation: float,
    catalog: Catalog | None = None,
) -> RunCost:
    """The run's cost and energy (`sim.cost.run_cost`) with the flags `cost_args` added: `gpus` GPUs of `gpu` on
    `node` nodes held `hours` wall-clock hours, busy `utilisation` (0-1) of the time. Flags not added read as not
    given."""
    return run_cost(
        gpu,
        node,
        gpus,
        hours,
        utilisation,
        price_per_gpu_hour=getattr(args, "price_per_gpu_hour", None),
        pue=getattr(args, "pue", None),
        grid_gco2_per_kwh=getattr(args, "grid_gco2_per_kwh", None),
        catalog=catalog,
    )


def cost_lines(rc: RunCost) -> list[str]:
    """The text lines that show `rc`: money with the price and its source, then power, energy and emissions."""
    if rc.usd is None:
        money = f"cost: no price listed for this GPU ({rc.gpu_hours:,.0f} GPU-hours; give --price-per-gpu-hour)"
    else:
        money = (
            f"cost ${rc.usd:,.0f} = {rc.gpu_hours:,.0f} GPU-hours x ${rc.usd_per_gpu_hour:,.2f}/GPU-hour "
            f"({rc.price_key or rc.price_source}{', read ' + rc.price_date if rc.price_date else ''})"
        )
    if rc.energy_mwh is None or rc.it_mw is None or rc.tco2e is None or rc.gpu_power_w is None:
        return [money, "energy: the catalog gives no power limit (tdp_w) for this GPU"]
    energy = (
        f"energy {rc.energy_mwh:,.0f} MWh = {rc.it_mw:,.2f} MW IT ({rc.gpu_power_w:,.0f} W/GPU at "
        f"{100 * rc.utilisation:.0f}% busy + {rc.node_overhead_w:,.0f} W/node x {rc.nodes:,} nodes) x PUE {rc.pue:g} "
        f"| {rc.tco2e:,.0f} tCO2e at {rc.grid_gco2_per_kwh:g} gCO2e/kWh"
    )
    return [money, energy]


def cmd_prices(args) -> int:
    """List the catalog's cloud prices per GPU-hour with their source and the date each was read (the shipped
    sim/hardware/prices.toml, then --catalog files)."""
    cat = load_catalog(args.catalog)
    rows = [p for p in cat.prices.values() if not args.gpu or p.gpu == args.gpu.lower()]
    if args.gpu and not rows:
        cat.gpu(args.gpu)  # an unknown GPU is an error naming the known ones; a known one may have no price
    if args.json:
        print(json.dumps([{"key": p.key, **{k: v for k, v in vars(p).items() if k != "key"}} for p in rows], indent=2))
        return 0
    if not rows:
        print(f"no price listed for {args.gpu}")
        return 0
    print(f"{'key':<20} {'gpu':<6} {'node':<12} {'$/GPU-h':>8}  {'read':<10}  note")
    for p in rows:
        print(f"{p.key:<20} {p.gpu:<6} {p.node or '-':<12} {p.usd_per_gpu_hour:>8.3f}  {p.date:<10}  {p.note}")
        print(f"{'':<20} source: {p.source}")
    return 0


def add_prices_parser(ssub) -> None:
    """Attach `sim prices` to the `scaletrain sim` subparsers."""
    p = ssub.add_parser("prices", help="the catalog's cloud prices per GPU-hour", description=cmd_prices.__doc__)
    p.add_argument("--gpu", metavar="GPU", help="only this GPU's prices")
    p.add_argument(
        "--catalog", action="append", default=[], metavar="TOML", help="an extra hardware catalog file (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(func=cmd_prices)
