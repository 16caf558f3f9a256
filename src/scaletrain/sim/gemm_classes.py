"""GEMM efficiency per shape class: what a measured run says about GEMMs of its size, applied to runs of other sizes.

A device reaches a smaller fraction of its GEMM ceiling on small GEMMs (kernel launch, tile quantisation, on a CPU
the cache blocking), and a parallel layout changes the GEMM sizes: tensor parallelism splits every weight, a smaller
micro-batch shortens every GEMM. So `sim calibrate RUN_DIR...` fits one gemm_eff per *shape class* of the runs it
reads rather than one for all: a run's class is the FLOP-weighted geometric mean of its GEMMs' sizes (one
micro-batch on one rank, transformer layers and output layer; a routed-expert GEMM counts one expert's rows),
bucketed in factors of CLASS_RATIO around its powers. A run of another size is priced at the efficiency interpolated between the
fitted classes (linear in log size), and at the nearest class's outside their range, which `eff_at` flags as
extrapolated. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import replace

from scaletrain.sim.compute import layer_gemms
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.workload import ClusterLayout, Workload

CLASS_RATIO = 2.0
"""A shape class spans this factor in FLOPs per GEMM, centred on a power of it: TP2, or half the micro-batch, moves a
run by a factor of 2, so each such change lands in the next class."""


def run_gemm_gflop(w: Workload, layout: ClusterLayout) -> float:
    """FLOP-weighted geometric mean of the GFLOP per GEMM of one micro-batch on one rank of `w` in `layout`."""
    sizes: list[tuple[float, float]] = []  # (GFLOP per GEMM, weight = FLOPs it accounts for)
    for g, (m, n, k) in zip(w.inventory.layer, layer_gemms(w, layout)):
        groups = max(1, g.experts // max(1, layout.ep)) if g.experts > 1 else 1
        one = 2.0 * m / groups * n * k / 1e9
        sizes.append((one, one * groups * w.shape.layers))
    tokens = layout.mbs * w.seq_len // layout.cp
    head = 2.0 * tokens * w.inventory.logits.k * w.inventory.logits.n / layout.tp / 1e9
    sizes.append((head, head))
    total = sum(weight for _, weight in sizes)
    return math.exp(sum(weight * math.log(size) for size, weight in sizes if size > 0) / total)


def class_index(gflop: float) -> int:
    """The shape class of a run whose GEMMs average `gflop` GFLOP: round(log_CLASS_RATIO(gflop))."""
    return round(math.log(gflop) / math.log(CLASS_RATIO))


def class_label(index: int) -> str:
    """ "0.707-1.41 GFLOP" for class 0 (CLASS_RATIO 2)."""
    lo, hi = CLASS_RATIO ** (index - 0.5), CLASS_RATIO ** (index + 0.5)
    return f"{lo:.3g}-{hi:.3g} GFLOP"


def eff_at(classes: list[dict], gflop: float) -> tuple[float, bool]:
    """(gemm_eff, extrapolated) at `gflop` from fitted classes [{"gflop", "gemm_eff"}, ...]: linear in log size
    between the classes' sizes; the nearest class's value outside them (extrapolated=True)."""
    pts = sorted((float(c["gflop"]), float(c["gemm_eff"])) for c in classes)
    if not pts:
        raise ValueError("no fitted GEMM shape class")
    if gflop <= pts[0][0] or gflop >= pts[-1][0]:
        near = pts[0] if gflop <= pts[0][0] else pts[-1]
        return near[1], not math.isclose(gflop, near[0], rel_tol=1e-6) and class_index(gflop) != class_index(near[0])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if gflop <= x1:
            f = math.log(gflop / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0), False
    return pts[-1][1], False  # unreachable: gflop < pts[-1][0]


def apply(eff: Efficiency, classes: list[dict] | None, gflop: float) -> tuple[Efficiency, bool]:
    """(eff with the gemm_eff of a run whose GEMMs average `gflop` (`run_gemm_gflop`), extrapolated); `eff` itself
    without classes."""
    if not classes:
        return eff, False
    value, extrapolated = eff_at(classes, gflop)
    return replace(eff, gemm_eff=value), extrapolated
