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
    """Constant host cost per step (optimizer launch, Python and data loading not hidden by CUDA graphs)."""
    eval_eff: float = 0.8
    """Evaluation forward throughput relative to the training forward."""
    sync_log2_s: float = 0.002
    """Per-step synchronisation latency per doubling of the ranks (tree-like collectives and barriers), seconds."""
    straggler_cv: float = 0.01
    """Relative per-rank jitter of the busy time: each step waits for the slowest of N (`fixed_costs`)."""
    warmup_steps: float = 3.0
    """Extra step-times the first steps of a run take (allocator growth, autotuning, CUDA graph capture)."""
    comm_init_s: float = 0.3
    """Communicator creation, seconds per process group and per doubling of its members (timed warm-up)."""
    eval_fixed_s: float = 0.5
    """Fixed seconds per evaluation besides its forward passes (mode switch, data loader, metric reduction)."""

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
    "h200nvl": "hopper",
    "b200": "blackwell",
    "b300": "blackwell",
    "gb200": "blackwell",
    "gb300": "blackwell",
    "mi300x": "cdna3",
    "mi325x": "cdna3",
    "mi350x": "cdna4",
    "mi355x": "cdna4",
}

DEFAULT_GEMM_EFF = Efficiency().gemm_eff
"""gemm_eff of a generation no release has a fitted set for (Ampere and CDNA 4 in the shipped file): the
model's prior for a mature kernel library. The kernels' own distance from the datasheet peak is already in the
catalog's matmul ceilings (measured, or for AMD the peak x H100's measured ceiling/peak), so this only covers how
much of that ceiling a training step keeps."""


def releases() -> list[str]:
    """Releases with a fitted set, oldest first."""
    sets = load_efficiencies()["sets"]
    return sorted({k.split("/")[0] for k in sets}, key=_release_key)


def generation(gpu: str) -> str:
    """The architecture generation of catalog GPU `gpu` ("hopper" for a key this table does not know)."""
    return GENERATION.get(gpu, "hopper")


def efficiency_for(release: str | None, gpu: str) -> tuple[str, Efficiency]:
    """(set name, Efficiency) for a release ("v3.0" ... "v5.1"; None/"latest" = newest) on `gpu`.

    The lookup, most specific first:
    1. the set fitted on the GPU's generation in that release ("v4.1/hopper");
    2. the generation's set from the nearest release that has one (the newest older one, else the oldest newer
       one): a generation's kernels matter more than the release ("v4.1/blackwell for v4.0");
    3. a generation no release was fitted on (Ampere and CDNA 4 in the shipped file) gets the documented
       default "<release>/<generation> (default)": the release's fitted scalars, which the calibration shares
       across generations (TP exposure, DP overlap and slowdown, evaluation efficiency, the fixed costs: taken
       from the release's Hopper set, else its first), with gemm_eff = DEFAULT_GEMM_EFF.
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
    gen = generation(gpu)
    key = f"{release}/{gen}"
    if key in sets:
        return key, Efficiency.from_dict(sets[key])
    fitted = [r for r in known if f"{r}/{gen}" in sets]
    if fitted:
        older = [r for r in fitted if _release_key(r) <= _release_key(release)]
        near = older[-1] if older else fitted[0]
        return f"{near}/{gen} (for {release})", Efficiency.from_dict(sets[f"{near}/{gen}"])
    base = sets.get(f"{release}/hopper") or next(v for k, v in sorted(sets.items()) if k.split("/")[0] == release)
    return f"{key} (default)", Efficiency.from_dict({**base, "gemm_eff": DEFAULT_GEMM_EFF})


def _release_key(name: str) -> tuple:
    try:
        return tuple(int(x) for x in name.lstrip("v").split("."))
    except ValueError:
        return (0,)
