"""Every effective GEMM and attention rate of a fitted efficiency document, set x GPU x benchmark, against the 90% of
peak bound (`sim.rate_bounds`): what `scaletrain sim validate --rates` prints and the bound test checks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scaletrain import benchmarks
from scaletrain.sim.catalog import Catalog
from scaletrain.sim.efficiency import _release_key, _set_for, specialise
from scaletrain.sim.rate_bounds import KINDS, _ceilings, effective_rates


@dataclass(frozen=True)
class RateRow:
    """One effective rate of one fitted set on one GPU for one benchmark."""

    set: str
    """The set that prices it, as `efficiency_for` names it ("v5.1/blackwell", "v4.1/blackwell (for v4.0)")."""
    gpu: str
    """Catalog GPU key."""
    benchmark: str | None
    """MLPerf benchmark whose fitted scalars specialise the set; None for a model that is no benchmark."""
    kind: str
    """One of KINDS."""
    tflops: float
    """Effective TFLOP/s (`effective_rates`)."""
    peak_tflops: float
    """The datasheet dense peak it is bounded by (`peaks`)."""
    pct: float
    """tflops as a percentage of peak_tflops (infinite for a rate without a peak)."""
    basis: str
    """Whether the ceiling under the rate is "measured" or "derived" (`GPU.ceiling_basis`)."""

    def to_dict(self) -> dict:
        """Plain dict (pct rounded to 0.01; a rate without a peak has pct None)."""
        d = asdict(self)
        d["pct"] = round(self.pct, 2) if math.isfinite(self.pct) else None
        return d


def rate_table(doc: dict, catalog: Catalog) -> list[RateRow]:
    """Every effective rate of efficiency document `doc` (`efficiency.load_efficiencies()`'s form): for every
    release it has sets for, every catalog GPU (each priced by its generation's set, or the set that stands in for
    it: `efficiency_for`'s lookup), and every MLPerf benchmark (proxies aside) plus None, the rates of
    `effective_rates` with their peaks. A release whose sets cannot price a GPU (a "measured" set fitted on other
    hardware) has no rows for it."""
    sets = doc.get("sets", {})
    releases = sorted({k.split("/")[0] for k in sets}, key=_release_key)
    names: list[str | None] = [b for b in benchmarks.names() if not benchmarks.is_proxy(b)]
    names.append(None)
    rows = []
    for release in releases:
        for gpu in catalog.gpus.values():
            try:
                name, base = _set_for(sets, release, gpu.key, gpu.generation)
            except ValueError:
                continue
            for bench in names:
                eff = specialise(base, gpu.key, bench, doc.get("sku_gemm", {}), doc.get("benchmarks", {}))
                rates = effective_rates(eff, gpu)
                for kind, (_, peak, basis) in _ceilings(gpu).items():
                    pct = 100 * rates[kind] / peak if peak > 0 else math.inf
                    rows.append(RateRow(name, gpu.key, bench, kind, rates[kind], peak, pct, basis))
    return rows


def largest_by_kind(rows: list[RateRow]) -> dict[str, RateRow]:
    """The row with the largest pct of each kind present in `rows`, in KINDS order."""
    best: dict[str, RateRow] = {}
    for r in rows:
        if r.kind not in best or r.pct > best[r.kind].pct:
            best[r.kind] = r
    return {k: best[k] for k in KINDS if k in best}
