"""The few free scalars of the model, one set per hardware/software release, fitted by `calibrate`.

Everything else (kernel ceilings, link bandwidths, formulas) comes from measurements and the workload; these
scalars absorb what a framework release does with them (docs/perf-model.md: "software efficiency is an input").
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from importlib import resources


@dataclass(frozen=True)
class Efficiency:
    """Software-release efficiencies; defaults are priors before any fit."""

    gemm_eff: float = 0.85
    """Fraction of the measured GEMM/attention ceiling reached inside a training step."""
    tp_exposed: float = 0.5
    """Fraction of tensor-parallel communication not hidden under GEMMs."""
    dp_overlap: float = 0.8
    """Fraction of the DP overlap window (backward of the last micro-batches, forward of the first) usable."""
    overlap_slowdown: float = 0.1
    """Compute slowdown while DP communication runs underneath it, as a fraction of the hidden comm time."""
    step_overhead_s: float = 0.05
    """Fixed cost per step (optimizer launch, synchronisation, host work not hidden by CUDA graphs)."""
    eval_eff: float = 0.8
    """Evaluation forward throughput relative to the training forward."""

    def to_dict(self) -> dict:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Efficiency:
        """From a dict, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in data.items() if k in names})


def load_efficiencies() -> dict:
    """Fitted sets: {"sets": {"v4.1/hopper": {...}, ...}, "fit": {...}}.

    The shipped sim/data/efficiency.json (fitted on the published calibration rows), then the file named by
    $SCALETRAIN_EFFICIENCY (what `scaletrain sim calibrate --out` writes), whose sets win.
    """
    path = resources.files("scaletrain.sim") / "data" / "efficiency.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"sets": {}}
    user = os.environ.get("SCALETRAIN_EFFICIENCY", "")
    if user and os.path.isfile(user):
        try:
            doc["sets"].update(json.loads(open(user).read()).get("sets", {}))
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"$SCALETRAIN_EFFICIENCY={user}: not an efficiency file ({exc})") from None
    return doc


# GPU -> architecture generation: software efficiency is fitted per release and generation.
GENERATION = {
    "a100": "ampere",
    "h100": "hopper",
    "h200": "hopper",
    "b200": "blackwell",
    "gb200": "blackwell",
    "gb300": "blackwell",
}


def releases() -> list[str]:
    """Releases with a fitted set, oldest first."""
    sets = load_efficiencies()["sets"]
    return sorted({k.split("/")[0] for k in sets}, key=_release_key)


def efficiency_for(release: str | None, gpu: str) -> tuple[str, Efficiency]:
    """(set name, Efficiency) for a release ("v3.0" ... "v4.1"; None/"latest" = newest) on `gpu`.

    Uses the set fitted on the GPU's own generation in that release, else the nearest generation fitted in it
    (Hopper for Ampere, Blackwell falls back to Hopper): the software release is the larger effect.
    """
    sets = load_efficiencies()["sets"]
    if not sets:
        return "prior", Efficiency()
    known = releases()
    if release in (None, "", "latest"):
        release = known[-1]
    if not release.startswith("v") and release[:1].isdigit():
        release = "v" + release
    if release not in known and release.lstrip("v") in known:
        release = release.lstrip("v")
    if release not in known:
        raise ValueError(f"--calibration {release}: no fitted set; known: {', '.join(known)}")
    gen = GENERATION.get(gpu, "hopper")
    for candidate in (gen, "hopper", "blackwell", "ampere"):
        key = f"{release}/{candidate}"
        if key in sets:
            return key, Efficiency.from_dict(sets[key])
    raise ValueError(f"--calibration {release}: no set for {gpu}")  # pragma: no cover


def _release_key(name: str) -> tuple:
    try:
        return tuple(int(x) for x in name.lstrip("v").split("."))
    except ValueError:
        return (0,)
