"""What a run costs in money and energy: GPU-hours times a price, GPU and node power times hours times PUE.

Power model. A GPU draws its idle power plus the rest of its board limit in proportion to how much of the time it is
busy: P = idle_w + (tdp_w - idle_w) x utilisation. The two ends are the catalog's (`GPU.tdp_w` from the datasheets,
`GPU.idle_power_w()`); the straight line between them is a first-order model, not a fit: power rises with the
share of time the SMs run kernels, and large GEMM-bound kernels on these boards run at the power limit (the clocks
drop to hold it), so a GPU busy all the time is priced at tdp_w. Memory-bound kernels draw less than that and
communication kernels more than idle, so the model errs high on the busy side and low on the waiting side.
`utilisation` is the busy share of the step, the part spent in the math kernels
(`busy_share`: compute, its slowdown under overlapped communication, and the optimizer, over the step time); the
pipeline bubble, exposed communication and synchronisation are counted as idle. The other measure,
`ceiling_share` (the model FLOP rate over the GEMM ceiling), counts a kernel below the ceiling as partly idle and so
prices lower; a caller with a measured figure passes it directly.

The rest of each node (`Node.node_overhead_w`: CPUs, memory, NICs, switches, fans, PSU losses, from the system's
maximum input less its GPUs' limits) is charged in full for every hour, an upper bound on that term. The facility
multiplies the IT power by its PUE (default DEFAULT_PUE); the grid's carbon intensity turns energy into emissions
(default DEFAULT_GRID_GCO2_PER_KWH). Money is GPU-hours times a price per GPU-hour: the caller's, or the catalog's
list price for the GPU and node (`list_price`), named with its source and date.

Torch-free: the simulator's layer (docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scaletrain.sim.catalog import GPU, Catalog, Node, PriceEntry, default_catalog

DEFAULT_PUE = 1.58
"""Power usage effectiveness (facility power over IT power) when --pue is not given: the industry average of the
Uptime Institute Global Data Center Survey 2023 (1.58; 1.55-1.59 every year since 2020). Hyperscale facilities run
lower: Google's published fleet-wide trailing-twelve-month PUE is 1.10 (2021), so a run in one is --pue 1.1."""

DEFAULT_GRID_GCO2_PER_KWH = 445.0
"""Carbon intensity of the electricity when --grid-gco2-per-kwh is not given: the world average of power generation
in 2024, 445 gCO2/kWh (IEA, Electricity 2025, "Emissions"). Local grids range from ~30 (Norway) to ~700 (India);
a run on contracted clean power passes its own figure."""

BUSY_TERMS = ("compute", "overlap_slowdown", "optimizer")
"""The step-breakdown terms (`Prediction.breakdown`) during which the GPU runs its math kernels: what `busy_share`
counts as utilisation. The other terms (pipeline bubble, exposed communication, synchronisation, overhead,
stragglers) leave the SMs waiting."""


@dataclass(frozen=True)
class RunCost:
    """The money and energy of one run (`run_cost`); `to_dict()` is what --json prints."""

    gpu_hours: float
    """GPUs x wall-clock hours the cluster is held."""
    usd: float | None
    """gpu_hours x usd_per_gpu_hour; None when no price is given or listed for the GPU."""
    usd_per_gpu_hour: float | None
    """The price used: --price-per-gpu-hour, else the catalog's list price (`price_source` names it)."""
    price_source: str | None
    """Where the price came from: "--price-per-gpu-hour", or "<key>: <source> (read <date>; <note>)"."""
    gpu_power_w: float | None
    """Mean power per GPU, W (idle + (tdp - idle) x utilisation); None when the GPU's tdp_w is not known."""
    node_overhead_w: float
    """Power of each node besides its GPUs, W (the catalog's; 0 = not known)."""
    it_mw: float | None
    """IT power of the cluster, MW: GPUs x gpu_power_w + nodes x node_overhead_w."""
    pue: float
    """Facility power over IT power."""
    energy_mwh: float | None
    """Facility energy of the run, MWh: it_mw x hours x pue."""
    grid_gco2_per_kwh: float
    """Carbon intensity of the electricity, gCO2e/kWh."""
    tco2e: float | None
    """Emissions, tonnes CO2e: energy_mwh x grid_gco2_per_kwh / 1000."""
    utilisation: float = 1.0
    """The busy share the GPU power was priced at (0-1)."""
    nodes: int = 1
    """Nodes the GPUs occupy (ceil(gpus / gpus_per_node))."""
    price_key: str | None = None
    """Key of the catalog price used; None for --price-per-gpu-hour or no price."""
    price_date: str | None = None
    """When the catalog price was read (YYYY-MM-DD); None otherwise."""

    def to_dict(self) -> dict:
        """Every field, for --json."""
        return asdict(self)


def _check(name: str, value: float, lo: float, hi: float = math.inf) -> float:
    # One line naming the value, so a bad --pue or a bad caller argument reads the same (exit 2 in the CLI).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        bound = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be {bound}, got {value:g}")
    return float(value)


def busy_share(breakdown: dict, step_time_s: float) -> float:
    """The share of a step the GPU runs its math kernels: the BUSY_TERMS of a step breakdown (seconds by cause, as
    `Prediction.breakdown`) over the step time, in [0, 1]. 0 for an empty step."""
    if step_time_s <= 0:
        return 0.0
    busy = sum(float(breakdown.get(term, 0.0)) for term in BUSY_TERMS)
    return min(1.0, max(0.0, busy / step_time_s))


def ceiling_share(model_tflops_per_gpu: float, gpu: GPU, fp8: bool = False) -> float:
    """The other measure of utilisation: the model FLOP rate a GPU sustains over its large-GEMM ceiling (bf16, or FP8
    with `fp8`), in [0, 1] (MFU x dense peak / ceiling). Lower than `busy_share` for the same step, since attention,
    element-wise kernels and small GEMMs run below the ceiling while still drawing power; the model's default is
    `busy_share`. 0 for a GPU without that ceiling."""
    ceiling = gpu.matmul_fp8_tflops if fp8 else gpu.matmul_bf16_tflops
    if ceiling <= 0:
        return 0.0
    return min(1.0, max(0.0, model_tflops_per_gpu / ceiling))


def gpu_power_w(gpu: GPU, utilisation: float) -> float | None:
    """Mean board power of `gpu` busy `utilisation` (0-1) of the time: idle + (tdp - idle) x utilisation, W; None
    when the catalog gives no tdp_w for it."""
    u = _check("utilisation", utilisation, 0.0, 1.0)
    if gpu.tdp_w <= 0:
        return None
    idle = gpu.idle_power_w()
    return idle + (gpu.tdp_w - idle) * u


def energy_mwh(it_w: float, hours: float, pue: float) -> float:
    """Facility energy in MWh of an IT load of `it_w` watts held `hours`, at power usage effectiveness `pue`."""
    return it_w / 1e6 * hours * pue


def tco2e(energy: float, grid_gco2_per_kwh: float) -> float:
    """Tonnes CO2e of `energy` MWh at `grid_gco2_per_kwh` (MWh x 1,000 kWh x g/kWh / 1e6 g per tonne)."""
    return energy * grid_gco2_per_kwh / 1000.0


def list_price(gpu_key: str, node_key: str | None, catalog: Catalog | None = None) -> PriceEntry | None:
    """The catalog price for a run of `gpu_key` GPUs on `node_key` nodes: the first price entry (file order) for
    exactly that node, else the first entry of the GPU; None when the catalog lists no price for the GPU."""
    cat = catalog or default_catalog()
    gpu = gpu_key.lower()
    of_gpu = [p for p in cat.prices.values() if p.gpu == gpu]
    for price in of_gpu:
        if node_key and price.node == node_key.lower():
            return price
    return of_gpu[0] if of_gpu else None


def run_cost(
    gpu: GPU,
    node: Node,
    gpus: int,
    hours: float,
    utilisation: float,
    price_per_gpu_hour: float | None = None,
    pue: float | None = None,
    grid_gco2_per_kwh: float | None = None,
    catalog: Catalog | None = None,
) -> RunCost:
    """Money and energy of `gpus` GPUs of `gpu` on `node` nodes held `hours` wall-clock hours, busy `utilisation`
    (0-1, e.g. `busy_share`) of the time.

    price_per_gpu_hour overrides the catalog's list price (`list_price`); pue defaults to DEFAULT_PUE,
    grid_gco2_per_kwh to DEFAULT_GRID_GCO2_PER_KWH. A bad value raises ValueError with one line naming it."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    hours = _check("hours", hours, 0.0)
    u = _check("utilisation", utilisation, 0.0, 1.0)
    pue = DEFAULT_PUE if pue is None else _check("pue", pue, 1.0)
    grid = DEFAULT_GRID_GCO2_PER_KWH if grid_gco2_per_kwh is None else _check("grid_gco2_per_kwh", grid_gco2_per_kwh, 0)
    gpu_hours = gpus * hours
    price_key = price_date = source = None
    if price_per_gpu_hour is not None:
        rate: float | None = _check("price_per_gpu_hour", price_per_gpu_hour, 0.0)
        source = "--price-per-gpu-hour"
    else:
        entry = list_price(gpu.key, node.key, catalog)
        rate = None if entry is None else entry.usd_per_gpu_hour
        if entry is not None:
            price_key, price_date = entry.key, entry.date
            source = f"{entry.key}: {entry.source} (read {entry.date}; {entry.note})"
    nodes = math.ceil(gpus / node.gpus_per_node)
    per_gpu = gpu_power_w(gpu, u)
    it_w = None if per_gpu is None else gpus * per_gpu + nodes * node.node_overhead_w
    energy = None if it_w is None else energy_mwh(it_w, hours, pue)
    return RunCost(
        gpu_hours=gpu_hours,
        usd=None if rate is None else gpu_hours * rate,
        usd_per_gpu_hour=rate,
        price_source=source,
        gpu_power_w=per_gpu,
        node_overhead_w=node.node_overhead_w,
        it_mw=None if it_w is None else it_w / 1e6,
        pue=pue,
        energy_mwh=energy,
        grid_gco2_per_kwh=grid,
        tco2e=None if energy is None else tco2e(energy, grid),
        utilisation=u,
        nodes=nodes,
        price_key=price_key,
        price_date=price_date,
    )
