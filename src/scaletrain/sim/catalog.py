"""Hardware catalog: GPUs, their generations, nodes (NVLink domains), scale-out fabrics and cloud prices, loaded from
TOML data files.

The shipped files live in `sim/hardware/*.toml`, each entry with its source. They hold every hardware fact the
simulator uses, names included: a GPU's generation (which fitted efficiency set prices it), its default node, the
patterns that find it in a device name or a published result's accelerator text, and a generation's reference SKU.
Users add or override entries with their own TOML (same tables: [gpus.<key>], [generations.<key>], [nodes.<key>],
[fabrics.<key>], [prices.<key>]) through `--catalog FILE` or $SCALETRAIN_CATALOG (colon-separated files), so adding a GPU is one
entry (and its node). A new entry needs every field; an entry that overrides a known key may give only the fields
it changes.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import re
import sys
from dataclasses import MISSING, dataclass, field, fields
from importlib import resources

from scaletrain.config_io import read_text_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class CatalogError(ValueError):
    """A catalog entry is missing, unknown or malformed; the message names the file and entry."""


CEILINGS = ("matmul_bf16", "matmul_fp8", "matmul_fp4", "attn")
"""A GPU's kernel ceilings, each the `<name>_tflops` field: the large-GEMM rate per precision and the flash-attention
forward rate the compute model prices against (`sim/compute.py`)."""

MEASURED, DERIVED = "measured", "derived"
"""A ceiling's basis (`GPU.ceiling_basis`): a public measurement, or derived from other figures. Derived is the
default: a value nobody says was measured is not counted as one."""

IDLE_FRACTION = 0.115
"""A GPU's idle draw over its board power limit where its entry gives no idle_w: 80.3 W of 700 W, one public
measurement of an H200 SXM with no kernel running (ALICE GPU energy benchmark, TDX-attested nvidia-smi samples, June
2026). No vendor publishes an idle figure, so this one ratio is applied to every GPU (gpus.toml header)."""


@dataclass(frozen=True)
class GPU:
    """One accelerator: dense peaks, measured ceilings, memory."""

    key: str
    name: str
    bf16_tflops: float
    fp8_tflops: float
    matmul_bf16_tflops: float
    matmul_fp8_tflops: float
    attn_tflops: float
    hbm_gb: float
    hbm_tbps: float
    hbm_copy_tbps: float
    nvlink_gbps: float
    kernel_us: float
    source: str
    generation: str
    """Key of its architecture generation (generations.toml): the fitted efficiency sets it is priced with."""
    default_node: str
    """The node `predict --gpu KEY` uses when --node is not given."""
    gemm_curve_bf16: tuple = ()
    """Optional measured [(GFLOP, TFLOP/s), ...] for bf16 GEMMs; replaces the kernel_us roll-off."""
    gemm_curve_fp8: tuple = ()
    """Optional measured curve for FP8 GEMMs."""
    fp4_tflops: float = 0.0
    """Dense FP4 peak (NVFP4 on Blackwell, MXFP4 on CDNA 4); 0 = no FP4 tensor cores."""
    matmul_fp4_tflops: float = 0.0
    """Large-GEMM FP4 ceiling (what `predict --fp4` prices the FP4 GEMMs at); 0 = none."""
    attn_fp8_tflops: float = 0.0
    """Flash-attention forward rate in FP8 (what `predict --fp8-attention` prices the attention core at); 0 = no FP8
    attention kernel known for this GPU, which then runs attention at attn_tflops (bf16)."""
    name_patterns: tuple[str, ...] = ()
    """Regular expressions that find this GPU in a device name or accelerator text (`Catalog.gpu_for_device`);
    empty = the key itself."""
    tdp_w: float = 0.0
    """Board power limit in W (the datasheet's max TDP / total board power); 0 = not known, and then no energy is
    priced for this GPU."""
    idle_w: float = 0.0
    """Board draw with no kernel running, in W; 0 = not given: IDLE_FRACTION x tdp_w (`idle_power_w`)."""
    ceiling_basis: tuple[tuple[str, str], ...] = tuple((c, DERIVED) for c in CEILINGS)
    """(ceiling, "measured" | "derived") for each of CEILINGS, in that order: whether the ceiling is a public
    measurement or derived from other figures (a peak times a measured part's ceiling/peak, an assumed speed-up).
    In TOML an inline table, `ceiling_basis = {matmul_bf16 = "measured", ...}`; a ceiling it leaves out is
    "derived", and so is one that an override entry changes without saying its basis, unless a measured GEMM
    curve (gemm_curve_<dtype>) replaces it."""

    def basis(self, ceiling: str) -> str:
        """The basis of the `<ceiling>_tflops` field, "measured" or "derived"; `ceiling` is one of CEILINGS
        ("matmul_bf16", "matmul_fp8", "matmul_fp4", "attn")."""
        return dict(self.ceiling_basis)[ceiling]

    def idle_power_w(self) -> float:
        """The board's idle draw in W: idle_w where the entry gives one, else IDLE_FRACTION x tdp_w."""
        return self.idle_w or IDLE_FRACTION * self.tdp_w


@dataclass(frozen=True)
class Generation:
    """A GPU architecture generation: software efficiency is fitted per release and generation."""

    key: str
    name: str
    reference_gpu: str
    """The SKU whose GEMM efficiency the generation's fitted set is; the generation's other SKUs carry a fitted
    multiplier on it (`sku_gemm`)."""


DEFAULT_STORAGE_GBPS = 2000.0 / 2048
"""A node's checkpoint storage bandwidth when no public figure exists for it, GB/s: Llama 3's storage (Dubey et al.
2024, arXiv:2407.21783, §3.3.1: Tectonic, "a sustainable throughput of 2 TB/s") shared by the 2,048 eight-GPU nodes
of its 16,384-H100 job: 2000 / 2048 = 0.98 GB/s per node, conservative for a smaller job on the same storage."""
DEFAULT_HOST_COPY_GBPS = 50.0
"""A GPU's device-to-host copy rate when the node gives none, GB/s: PCIe Gen5 x16 is 64 GB/s per direction raw;
pinned-memory copies measure about 50 GB/s on H100 hosts (nvbandwidth / bandwidthTest)."""


@dataclass(frozen=True)
class Node:
    """A node: GPUs sharing NICs, and the NVLink domain they sit in."""

    key: str
    name: str
    gpu: str
    gpus_per_node: int
    nvlink_domain: int
    nvlink_busbw_gbps: float
    nvls_busbw_gbps: float
    nics: int
    fabric: str
    source: str
    nvlink_alpha_us: float = 2.0
    """Latency of one ring step over NVLink (NCCL's intra-node base latency is a few microseconds)."""
    topology: str = "switch"
    """"switch" (NVSwitch: every group in the domain gets the full bandwidth) or "mesh" (a direct link to each of
    the domain-1 peers, AMD Infinity Fabric: a g-member group uses g-1 of them)."""
    system_patterns: tuple[str, ...] = ()
    """Regular expressions that pick this node instead of its GPU's default node for a published result whose
    submitter and system text matches one (`Catalog.node_for_system`)."""
    node_overhead_w: float = 0.0
    """Power of the node besides its GPUs (CPUs, memory, NICs, NVSwitches, fans, PSU losses) in W: the system's
    maximum input power less its GPUs' board limits; 0 = not known (energy then counts the GPUs only)."""
    storage_gbps: float = DEFAULT_STORAGE_GBPS
    """Sustained write (and read) bandwidth of the node to the shared file system checkpoints go to, GB/s
    (`sim/goodput.py`); default `DEFAULT_STORAGE_GBPS`."""
    host_copy_gbps: float = DEFAULT_HOST_COPY_GBPS
    """Device-to-host copy rate per GPU, GB/s: the blocking part of an asynchronous checkpoint (the GPU's state is
    staged in host memory, then written in the background); default `DEFAULT_HOST_COPY_GBPS`."""


@dataclass(frozen=True)
class Fabric:
    """A scale-out network: per-NIC bus bandwidth, latency, switch radix, in-network reduction."""

    key: str
    name: str
    link_gbit: float
    busbw_gbps: float
    alpha_us: float
    hop_us: float
    radix: int
    sharp: bool
    source: str

    def tiers(self, endpoints: int) -> int:
        """Switch levels of a non-blocking fat tree reaching `endpoints` NICs (1 leaf, 2 to radix^2/2, ...)."""
        level, reach = 1, self.radix
        while reach < endpoints:
            level += 1
            reach = reach * self.radix // 2
        return level


@dataclass(frozen=True)
class PriceEntry:
    """A published price of one GPU-hour: a cloud's list price for a node type, with where and when it was read."""

    key: str
    gpu: str
    """Key of the GPU the price is for."""
    usd_per_gpu_hour: float
    """US dollars per GPU-hour (a multi-GPU VM's price over its GPUs); > 0."""
    source: str
    """The price list or API it was read from, and what that listed."""
    date: str
    """When the figure was read (for an assumed price, when its source was published), YYYY-MM-DD."""
    note: str
    """On-demand, reserved or assumed; region; the per-GPU arithmetic."""
    node: str = ""
    """Key of the node type the price is for; empty = any node of the GPU."""


_KINDS = {"gpus": GPU, "generations": Generation, "nodes": Node, "fabrics": Fabric, "prices": PriceEntry}

DEFAULT_GPU = "h100"
"""The GPU the commands price when --gpu is not given."""


def _name_regex(pattern: str) -> re.Pattern:
    # No letter or digit before ("gb200" holds no "b200"), no digit after ("h1000" is no "h100").
    return re.compile(rf"(?<![a-z0-9])(?:{pattern})(?![0-9])")


@dataclass
class Catalog:
    """All known hardware, by key."""

    gpus: dict
    nodes: dict
    fabrics: dict
    generations: dict = field(default_factory=dict)
    prices: dict = field(default_factory=dict)
    """Key -> PriceEntry, in file order (`sim/cost.py` `list_price` picks the first that fits)."""
    origin: dict = field(default_factory=dict)
    """(kind, key) -> the file that last defined the entry, for error messages."""

    def gpu(self, key: str) -> GPU:
        """The GPU `key` (case-insensitive), or a CatalogError listing the known ones."""
        return self._get("gpus", key)

    def gpu_for_device(self, device_name: str) -> GPU | None:
        """The GPU a torch device name or a published accelerator text names ('NVIDIA H100 80GB HBM3' -> h100,
        'NVIDIA GB200' -> gb200, 'NVIDIA H200-NVL-141GB' -> h200nvl), or None.

        Each GPU's `name_patterns` (default: its key) are searched in the lower-cased text; the longest match wins.
        """
        text = device_name.lower()
        best: tuple[int, str] | None = None
        for key, gpu in self.gpus.items():
            for pattern in gpu.name_patterns or (re.escape(key),):
                m = _name_regex(pattern).search(text)
                if m and (best is None or len(m.group(0)) > best[0]):
                    best = (len(m.group(0)), key)
        return None if best is None else self.gpus[best[1]]

    def node_for_system(self, gpu: GPU, system: str) -> Node:
        """The node of a published result on `gpu` whose submitter and system text is `system`: the first node of
        that GPU with a matching `system_patterns` entry (a cloud node type), else the GPU's default node."""
        text = system.lower()
        for node in self.nodes.values():
            if node.gpu == gpu.key and any(re.search(p, text) for p in node.system_patterns):
                return node
        return self.node(gpu.default_node)

    def generation(self, key: str) -> Generation:
        """The generation `key`."""
        return self._get("generations", key)

    def is_reference(self, gpu: GPU) -> bool:
        """Whether `gpu` is its generation's reference SKU (its fitted set's gemm_eff applies unscaled)."""
        return self.generation(gpu.generation).reference_gpu == gpu.key

    def node(self, key: str) -> Node:
        """The node `key`."""
        return self._get("nodes", key)

    def fabric(self, key: str) -> Fabric:
        """The fabric `key`."""
        return self._get("fabrics", key)

    def _get(self, kind: str, key: str):
        table = getattr(self, kind)
        found = table.get(str(key).lower())
        if found is None:
            raise CatalogError(f"unknown {kind[:-1]} {key!r}; known: {', '.join(sorted(table))}")
        return found

    def system(self, gpu: str, node: str | None = None, fabric: str | None = None) -> tuple[GPU, Node, Fabric]:
        """Resolve a (gpu, node, fabric) triple, checking the node holds that GPU."""
        g = self.gpu(gpu)
        n = self.node(node or g.default_node)
        if n.gpu != g.key:
            raise CatalogError(f"node {n.key!r} holds {n.gpu!r} GPUs, not {g.key!r}")
        return g, n, self.fabric(fabric or n.fabric)


def _build(kind: str, key: str, table: dict, where: str, base=None):
    cls = _KINDS[kind]
    if not isinstance(table, dict):
        raise CatalogError(f"{where}: [{kind}.{key}] must be a table of fields, got {table!r}")
    if kind == "gpus":
        table = _with_basis(table, key, where, base)
    if base is not None:
        # Overriding a known entry: only the fields given change.
        table = {**{f.name: getattr(base, f.name) for f in fields(cls) if f.name != "key"}, **table}
    names = {f.name for f in fields(cls)} - {"key"}
    required = {f.name for f in fields(cls) if f.name != "key" and f.default is MISSING}
    unknown = set(table) - names
    missing = required - set(table)
    if unknown or missing:
        raise CatalogError(
            f"{where}: [{kind}.{key}] "
            + "; ".join(
                ([f"unknown fields {sorted(unknown)}"] if unknown else [])
                + ([f"missing fields {sorted(missing)}"] if missing else [])
            )
        )
    values = {}
    for f in fields(cls):
        if f.name == "key" or f.name not in table:
            continue
        value = table[f.name]
        try:
            if f.type in ("float",):
                value = float(value)
                if not math.isfinite(value) or value < 0:
                    raise ValueError("must be a finite number >= 0")
            elif f.type in ("int",):
                if isinstance(value, bool) or int(value) != value or value < 1:
                    raise ValueError("must be a positive integer")
                value = int(value)
            elif f.type in ("bool",):
                if not isinstance(value, bool):
                    raise ValueError("must be true or false")
            elif f.type in ("tuple",):
                value = tuple((float(a), float(b)) for a, b in value)
            elif f.name == "ceiling_basis":
                pass  # already checked and normalised by _with_basis
            elif f.type == "tuple[str, ...]":
                if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p for p in value):
                    raise ValueError("must be a list of regular expressions")
                for pattern in value:
                    try:
                        re.compile(pattern)
                    except re.error as exc:
                        raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
                value = tuple(value)
            else:
                value = str(value)
        except (TypeError, ValueError) as exc:
            raise CatalogError(f"{where}: [{kind}.{key}] {f.name}={table[f.name]!r}: {exc}") from None
        values[f.name] = value
    for name in ("storage_gbps", "host_copy_gbps"):
        if kind == "nodes" and name in values and values[name] <= 0:
            # A checkpoint's time divides by it: 0 would be an infinite save, not a missing figure.
            raise CatalogError(f"{where}: [{kind}.{key}] {name}={values[name]}: must be a rate above 0 GB/s")
    if kind == "nodes" and values.get("topology", "switch") not in ("switch", "mesh"):
        raise CatalogError(f"{where}: [{kind}.{key}] topology={values['topology']!r}: must be switch or mesh")
    if kind == "gpus" and values.get("idle_w", 0.0) > values.get("tdp_w", 0.0):
        raise CatalogError(
            f"{where}: [{kind}.{key}] idle_w={values['idle_w']:g}: above tdp_w={values.get('tdp_w', 0.0):g} "
            "(give tdp_w, the board power limit, with it)"
        )
    if kind == "prices":
        _check_price(values, key, where)
    if kind == "fabrics" and values.get("radix", 3) < 3:
        raise CatalogError(f"{where}: [{kind}.{key}] radix={values['radix']}: a switch needs at least 3 ports")
    return cls(key=key.lower(), **values)


def _check_price(values: dict, key: str, where: str) -> None:
    """A price entry's own values: a positive price and a real date (its gpu and node are checked with the rest)."""
    if values["usd_per_gpu_hour"] <= 0:
        raise CatalogError(
            f"{where}: [prices.{key}] usd_per_gpu_hour={values['usd_per_gpu_hour']:g}: must be a price above 0"
        )
    try:
        datetime.date.fromisoformat(values["date"])
    except ValueError:
        raise CatalogError(f"{where}: [prices.{key}] date={values['date']!r}: must be a date YYYY-MM-DD") from None


def _with_basis(table: dict, key: str, where: str, base: GPU | None) -> dict:
    """`table` with its ceiling_basis checked and normalised to GPU.ceiling_basis's form: the base entry's basis
    (all derived for a new entry), each ceiling the table changes reset to derived, then the table's own mapping."""
    given = table.get("ceiling_basis", {})
    if not isinstance(given, dict):
        raise CatalogError(
            f'{where}: [gpus.{key}] ceiling_basis={given!r}: must be a table such as {{matmul_bf16 = "measured"}}'
        )
    for name, value in given.items():
        if name not in CEILINGS:
            raise CatalogError(
                f"{where}: [gpus.{key}] ceiling_basis.{name}: unknown ceiling (use {', '.join(CEILINGS)})"
            )
        if value not in (MEASURED, DERIVED):
            raise CatalogError(
                f"{where}: [gpus.{key}] ceiling_basis.{name}={value!r}: must be {MEASURED!r} or {DERIVED!r}"
            )
    basis = dict(base.ceiling_basis) if base is not None else {c: DERIVED for c in CEILINGS}
    # A ceiling the file replaces without saying how it was obtained is not the shipped measurement any more; one a
    # GEMM curve replaces is measured, as every curve is (`sim calibrate --layer-timings` writes them).
    basis.update({c: DERIVED for c in CEILINGS if f"{c}_tflops" in table})
    basis.update({f"matmul_{d}": MEASURED for d in ("bf16", "fp8") if table.get(f"gemm_curve_{d}")})
    basis.update(given)
    return {**table, "ceiling_basis": tuple((c, basis[c]) for c in CEILINGS)}


def _merge_file(cat: Catalog, text: str, where: str, nested: str | None) -> None:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise CatalogError(f"{where}: not valid TOML: nested too deeply") from None
    tables = {nested: data} if nested else data
    for kind, entries in tables.items():
        if kind not in _KINDS:
            raise CatalogError(f"{where}: unknown table [{kind}] (use gpus, generations, nodes, fabrics or prices)")
        if not isinstance(entries, dict):
            raise CatalogError(f"{where}: [{kind}] must be a table of entries, got {entries!r}")
        for key, table in entries.items():
            known = getattr(cat, kind)
            known[key.lower()] = _build(kind, key, table, where, known.get(key.lower()))
            cat.origin[(kind, key.lower())] = where


def load_catalog(extra: list[str] | tuple[str, ...] = ()) -> Catalog:
    """The shipped catalog, then $SCALETRAIN_CATALOG files, then `extra` files (later entries win)."""
    cat = Catalog({}, {}, {})
    root = resources.files("scaletrain.sim") / "hardware"
    for kind in _KINDS:
        _merge_file(cat, (root / f"{kind}.toml").read_text(), f"hardware/{kind}.toml", kind)
    env = [p for p in os.environ.get("SCALETRAIN_CATALOG", "").split(os.pathsep) if p]
    for path in [*env, *extra]:
        _merge_file(cat, read_text_file(path, f"catalog file {path}", error=CatalogError), str(path), None)
    _check_references(cat)
    return cat


def _check_references(cat: Catalog) -> None:
    """Every key an entry names exists, so a lookup never finds a dangling one later (one line naming the file)."""
    for gpu in cat.gpus.values():
        where = cat.origin.get(("gpus", gpu.key), "catalog")
        if gpu.generation not in cat.generations:
            raise CatalogError(
                f"{where}: gpu {gpu.key!r} names unknown generation {gpu.generation!r}; "
                f"known: {', '.join(sorted(cat.generations))}"
            )
        node = cat.nodes.get(gpu.default_node)
        if node is None or node.gpu != gpu.key:
            what = "no known node" if node is None else f"a node of {node.gpu!r} GPUs"
            raise CatalogError(f"{where}: gpu {gpu.key!r} default_node {gpu.default_node!r} is {what}")
    for gen in cat.generations.values():
        ref = cat.gpus.get(gen.reference_gpu)
        if ref is None or ref.generation != gen.key:
            where = cat.origin.get(("generations", gen.key), "catalog")
            raise CatalogError(
                f"{where}: generation {gen.key!r} reference_gpu {gen.reference_gpu!r} is no gpu of that generation"
            )
    for node in cat.nodes.values():
        where = cat.origin.get(("nodes", node.key), "catalog")
        if node.gpu not in cat.gpus:
            raise CatalogError(f"{where}: node {node.key!r} names unknown gpu {node.gpu!r}")
        if node.fabric not in cat.fabrics:
            raise CatalogError(f"{where}: node {node.key!r} names unknown fabric {node.fabric!r}")
        if node.nvlink_domain % node.gpus_per_node:
            raise CatalogError(f"{where}: node {node.key!r}: nvlink_domain must be a multiple of gpus_per_node")
    for price in cat.prices.values():
        where = cat.origin.get(("prices", price.key), "catalog")
        if price.gpu not in cat.gpus:
            raise CatalogError(f"{where}: price {price.key!r} names unknown gpu {price.gpu!r}")
        if price.node and cat.nodes.get(price.node) is None:
            raise CatalogError(f"{where}: price {price.key!r} names unknown node {price.node!r}")
        if price.node and cat.nodes[price.node].gpu != price.gpu:
            raise CatalogError(
                f"{where}: price {price.key!r}: node {price.node!r} holds {cat.nodes[price.node].gpu!r} GPUs, "
                f"not {price.gpu!r}"
            )


def shipped_keys(kind: str) -> list[str]:
    """Keys of the shipped `kind` ("gpus", "nodes", ...) entries, in file order: for help texts, which no user
    catalog file should be able to break."""
    return list(tomllib.loads((resources.files("scaletrain.sim") / "hardware" / f"{kind}.toml").read_text()))


@functools.lru_cache(maxsize=4)
def _catalog_for(env: str) -> Catalog:
    # `env` is only the cache key: load_catalog reads the variable itself.
    return load_catalog()


def default_catalog() -> Catalog:
    """The shipped catalog with the $SCALETRAIN_CATALOG files (`load_catalog()`), read once per value of the
    variable: for lookups repeated per row or per call, where no --catalog file is in play."""
    return _catalog_for(os.environ.get("SCALETRAIN_CATALOG", ""))


def mfu_peak(device_name: str) -> tuple[str, float] | None:
    """(GPU key, dense bf16 TFLOP/s) for the trainer's MFU denominator, from a torch device name; None when the
    catalog does not know the device (then no MFU is reported)."""
    gpu = load_catalog().gpu_for_device(device_name)
    return None if gpu is None else (gpu.key, gpu.bf16_tflops)
