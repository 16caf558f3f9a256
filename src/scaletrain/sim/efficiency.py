"""The few free scalars of the model, one set per hardware/software release, fitted by `calibrate`.

Everything else (kernel ceilings, link bandwidths, formulas) comes from measurements and the workload; these
scalars absorb what a framework release does with them (docs/perf-model.md: "software efficiency is an input").
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources

from scaletrain.config_io import read_text_file
from scaletrain.sim.catalog import Catalog, default_catalog

EFFICIENCY_ENV = "SCALETRAIN_EFFICIENCY"
"""Environment variable naming an efficiency file (`sim calibrate --out`) whose sets win over the shipped ones."""


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
    eval_eff: float = 1.0
    """Evaluation forward throughput relative to the training forward: 1 in every published-result set (an evaluation
    runs the training forward's kernels; what else it costs is `eval_fixed_s`), fitted only by `sim calibrate
    RUN_DIR...` on measured runs."""
    sync_log2_s: float = 0.002
    """Per-step synchronisation latency per doubling of the NVLink domains (tree-like collectives and barriers),
    seconds. 0 in the published sets: their logs show data-parallel scale-out almost free (H100 TP4 CP2 LoRA
    0.541 s at 64 GPUs, 0.545 s at 1,024), so the cost of leaving one domain is `fabric_sync_s`, once."""
    fabric_sync_s: float = 0.0
    """Seconds per step a job pays once it spans more than one NVLink domain: its step-end collectives (loss and
    gradient-norm all-reduces, the distributed optimizer's last gathers) and barriers leave NVLink for the scale-out
    fabric's latency and the host work around it. Fitted on the logs' step times (8-GPU vs 16-GPU rows of one
    system and layout differ by it)."""
    straggler_cv: float = 0.01
    """Relative per-rank jitter of the busy time: each step waits for the slowest of N (`fixed_costs`). 0 in the
    published sets: a wait growing as sqrt(2 ln N) is not in their logs (GB300 CP8 LoRA 0.172 s at 72 GPUs, 0.183 s at
    512; the rest of that gap is the fabric crossing)."""
    warmup_steps: float = 3.0
    """Extra step-times the first steps of a run take (allocator growth, autotuning, CUDA graph capture)."""
    comm_init_s: float = 0.3
    """Communicator creation, seconds per process group and per doubling of its members (timed warm-up)."""
    eval_fixed_s: float = 0.5
    """Fixed seconds per evaluation besides its forward passes (mode switch, data loader, metric reduction); the
    published sets carry the value fitted on the evaluation times of the benchmark's software release
    (`run_terms`)."""
    eval_first_extra_s: float = 0.0
    """Seconds the first evaluation takes beyond the others (its data loader and graphs are built then), per software
    release (`run_terms`)."""
    eval_host_layer_s: float = 0.0
    """Host seconds per layer of an evaluation forward, per software release (`run_terms`): evaluation runs without
    the training step's CUDA graphs, so each layer's kernels are launched from Python, and a micro-batch forward
    takes at least layers x this even where its GPU work is shorter (small per-GPU shards: TP4 CP2 at one sequence
    per replica)."""
    switch_s: float = 0.0
    """Seconds an FP4 run loses once at its healing step, switching to FP8 (re-quantising, rebuilding graphs), per
    software release (`run_terms`)."""
    pause_s: float = 0.0
    """Seconds of the pause a benchmark's recipe takes every `PAUSE_EVERY_STEPS` steps (NeMo's garbage collection),
    per software release (`run_terms`)."""
    one_off_s: float = 0.0
    """Seconds inside the timed region that are neither steps nor evaluations (start-up, the first validation's
    set-up, a garbage-collection pause), per software release, fitted on the one-offs of its public logs
    (`run_terms`)."""
    a2a_exposed: float = 1.0
    """Fraction of the MoE dispatch/combine all-to-all not hidden under computation (1 = none hidden, Megatron
    without its all-to-all overlap; DeepSeek-V3's DualPipe hides most). No calibration row has experts, so it is not
    fitted: this prior is what every set carries."""
    comm_eff: float = 1.0
    """Fraction of the modelled collective bandwidths (the catalog's NVLink and fabric bus bandwidths, measured with
    nccl-tests) that collectives reach inside a training step. 1 in every published-result set (not fitted there:
    the DP overlap and TP exposure absorb what the rows show); `sim calibrate RUN_DIR...` fits it where measured
    runs show slower collectives, e.g. gloo on a CPU host, whose collective threads share the cores with compute."""
    fp4_eff: float = 1.0
    """Fraction of the FP4 GEMM ceiling a training step reaches relative to the fraction of the FP8 one (gemm_eff):
    FP4 GEMMs are shorter, so quantisation, scale handling and the non-GEMM work between them weigh more."""

    def to_dict(self) -> dict:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Efficiency:
        """From a dict, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in data.items() if k in names})


def load_efficiencies() -> dict:
    """Fitted sets: {"sets": {"v4.1/hopper": {...}, ...}, "sku_gemm": {gpu: multiplier}, "benchmarks": {benchmark:
    {scalar: value}}, "fit": {...}} (`efficiency_for` says how they combine), and from a fit on measured runs
    "gemm_classes": {set: [{"gflop", "gemm_eff", ...}]} (`gemm_classes.eff_at`).

    The shipped sim/data/efficiency.json (fitted on the published calibration rows), then the file named by
    $SCALETRAIN_EFFICIENCY (what `scaletrain sim calibrate --out` writes), whose sets win.
    """
    path = resources.files("scaletrain.sim") / "data" / "efficiency.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"sets": {}}
    extra = user_efficiencies()
    if extra:
        doc["sets"].update(extra.get("sets", {}))
        doc.setdefault("gemm_classes", {}).update(extra.get("gemm_classes", {}))
        for section in ("sku_gemm", "benchmarks", "run_terms"):
            if section in extra:
                doc[section] = extra[section]
    return doc


def user_efficiencies() -> dict | None:
    """The efficiency file $SCALETRAIN_EFFICIENCY names, or None when the variable is unset or empty.

    A set variable that names no readable efficiency file is a ValueError naming the variable and the path: a
    mistyped path silently pricing with the shipped sets instead would be a wrong answer nobody sees.
    """
    user = os.environ.get(EFFICIENCY_ENV, "")
    if not user:
        return None
    where = f"${EFFICIENCY_ENV}={user}"
    text = read_text_file(user, where, error=ValueError)
    try:
        extra = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: not an efficiency file (not valid JSON: {exc})") from None
    problem = _efficiency_file_problem(extra)
    if problem:
        raise ValueError(f"{where}: not an efficiency file ({problem})")
    return extra


def _efficiency_file_problem(doc) -> str | None:
    if not isinstance(doc, dict):
        return f"a JSON object of sections, got {type(doc).__name__}"
    for section in ("sets", "gemm_classes", "sku_gemm", "benchmarks"):
        if not isinstance(doc.get(section, {}), dict):
            return f"{section!r} must be an object"
    if "sets" not in doc:
        return "no 'sets' section (what `scaletrain sim calibrate --out` writes)"
    for name, values in {**doc.get("sets", {}), **doc.get("benchmarks", {})}.items():
        if not isinstance(values, dict):
            return f"{name!r} must be an object of scalars"
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"{name}.{key}={value!r} is not a finite number"
    return _run_terms_problem(doc.get("run_terms", {}))


def _run_terms_problem(run_terms) -> str | None:
    """What is wrong with a `run_terms` section ({benchmark: {"software": {label: {term: seconds}}, "default":
    {round: label}}}), or None."""
    if not isinstance(run_terms, dict):
        return "'run_terms' must be an object"
    for bench, terms in run_terms.items():
        where = f"run_terms.{bench}"
        if not isinstance(terms, dict) or not isinstance(terms.get("software", {}), dict):
            return f"{where} must be an object with a 'software' object"
        for label, values in terms.get("software", {}).items():
            if not isinstance(values, dict):
                return f"{where}.software.{label!r} must be an object of seconds"
            for key, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    return f"{where}.software.{label!r}.{key}={value!r} is not a finite number"
                if key in RUN_TERMS and value < 0:
                    return f"{where}.software.{label!r}.{key}={value!r} is negative"
        default = terms.get("default", {})
        if not isinstance(default, dict) or not all(isinstance(v, str) for v in default.values()):
            return f"{where}.default must map rounds to software labels"
    return None


PER_BENCHMARK = ("tp_exposed",)
"""Scalars fitted per benchmark, not shared: they depend on the benchmark's implementation, not the hardware.
TP exposure depends on which GEMMs the TP collectives can hide under (LoRA's backward has no weight-gradient GEMMs
of the frozen base weights, so its TP collectives have half the GEMM time to hide under) and on the
implementation's overlap settings. A model that is no MLPerf
benchmark gets the set's values, which are the pretraining benchmark's (gpt3)."""

DEFAULT_GEMM_EFF = Efficiency().gemm_eff
"""gemm_eff of a generation no release has a fitted set for (Ampere and CDNA 4 in the shipped file): the
model's prior for a mature kernel library. The kernels' own distance from the datasheet peak is already in the
catalog's matmul ceilings (measured, or for AMD the peak x H100's measured ceiling/peak), so this only covers how
much of that ceiling a training step keeps."""


def releases() -> list[str]:
    """Releases with a fitted set, oldest first."""
    sets = load_efficiencies()["sets"]
    return sorted({k.split("/")[0] for k in sets}, key=_release_key)


OWN_FIT = ("gemm_mult",)
"""Scalars a benchmark outside `calibrate.SHARED_FIT` (llama31_405b, llama31_8b) fits on its own rows, on top of
the sets the others fitted, most telling first (`calibrate.fit_own` fits as many as its rows can pin): `gemm_mult`,
a multiplier on the set's gemm_eff (its kernels and fusions at its shapes). Only a scalar that does not grow with
the scale: the scale terms (DP overlap, synchronisation, stragglers) stay with the SHARED_FIT rows, which span 4 to
10,752 GPUs; TP exposure stays the pretraining benchmark's (gpt3's, the same Megatron overlap). Evaluation and
one-off seconds are fitted per software release for every benchmark alike (`RUN_TERMS`)."""


def specialise(eff: Efficiency, gpu: str, benchmark: str | None, sku_gemm: dict, bench: dict) -> Efficiency:
    """A set's Efficiency for one GPU SKU and benchmark: gemm_eff x the SKU's multiplier (power-limited sustained
    clocks and memory bandwidth differ between SKUs of one generation with the same datasheet peak) x the
    benchmark's own `gemm_mult` where it has one, and the benchmark's own values of the PER_BENCHMARK and OWN_FIT
    scalars it was fitted with."""
    own = bench.get(benchmark or "", {})
    changes = {k: float(v) for k, v in own.items() if k in PER_BENCHMARK + OWN_FIT and k != "gemm_mult"}
    mult = float(sku_gemm.get(gpu, 1.0)) * float(own.get("gemm_mult", 1.0))
    if mult != 1.0:
        changes["gemm_eff"] = eff.gemm_eff * mult
    return replace(eff, **changes) if changes else eff


def efficiency_for(
    release: str | None,
    gpu: str,
    benchmark: str | None = None,
    catalog: Catalog | None = None,
    software: str | None = None,
) -> tuple[str, Efficiency]:
    """(set name, Efficiency) for a release ("v3.0" ... "v5.1"; None/"latest" = newest) on catalog GPU `gpu`,
    running `benchmark` (an MLPerf benchmark name; None for another model). The GPU's generation comes from
    `catalog` (default: the shipped one with $SCALETRAIN_CATALOG's files); a key it does not know is a CatalogError.

    The set found below is then specialised (`specialise`): its gemm_eff times the GPU SKU's fitted multiplier
    ("sku_gemm"; 1 for a generation's reference SKU and SKUs without calibration rows), and the benchmark's own
    fitted PER_BENCHMARK scalars ("benchmarks"), its evaluation and one-off seconds of the release's software
    (`with_run_terms`; `software` names another fitted label than the release's own), and gemm_eff capped where an effective rate would pass 90% of the GPU's datasheet peak
    (`rate_bounds.cap_gemm_eff`).

    The lookup, most specific first:
    1. the set fitted on the GPU's generation in that release ("v4.1/hopper");
    2. the generation's set from the nearest release that has one (the newest older one, else the oldest newer
       one): a generation's kernels matter more than the release ("v4.1/blackwell for v4.0");
    3. a generation no release was fitted on (Ampere and CDNA 4 in the shipped file) gets the documented
       default "<release>/<generation> (default)": the release's fitted scalars, which the calibration shares
       across generations (DP overlap and slowdown, FP4 efficiency, the fixed costs, and the PER_BENCHMARK ones:
       taken from the release's Hopper set, else its first), with gemm_eff = DEFAULT_GEMM_EFF.
    """
    g = (catalog or default_catalog()).gpu(gpu)
    doc = load_efficiencies()
    name, eff = _set_for(doc["sets"], release, gpu, g.generation)
    # A set fitted on the user's own runs ("measured") was fitted on this very GPU: no SKU multiplier of the published
    # fit applies to it (one in its own file still does).
    own = _release_key(name.split("/")[0]) == (0,)
    sku = doc.get("sku_gemm", {}) if not own else (user_efficiencies() or {}).get("sku_gemm", {})
    eff = specialise(eff, gpu, benchmark, sku, doc.get("benchmarks", {}))
    asked = name.split(" ")[0].split("/")[0] if release in (None, "", "latest") else _normal_release(release)
    eff = with_run_terms(eff, doc.get("run_terms", {}), benchmark, asked, g.generation, software)[1]
    return name, cap_gemm_eff(eff, g)


def _normal_release(release: str) -> str:
    return "v" + release if release[:1].isdigit() else release


RUN_TERMS = ("eval_fixed_s", "eval_first_extra_s", "eval_host_layer_s", "one_off_s", "pause_s", "switch_s")
"""The Efficiency fields a benchmark's software release sets (`sim calibrate` fits them on the public logs' evaluation
and one-off seconds: `calibrate.fit_run_terms`)."""


PAUSE_EVERY_STEPS = {"llama31_8b": 10_000}
"""Steps between the pauses a benchmark's recipe takes: NVIDIA's llama31_8b config sets GC_TRAIN=10000 for NeMo's
GarbageCollectionCallback (mlcommons/training_results_v5.1: NVIDIA/benchmarks/llama31_8b/implementations/nemo/
config_common_8b.sh), and every v5.1 run that passes step 10,000 loses about 40 s in the segment holding it, no run
before it (sim/data/mlperf_terms/README.md)."""


def pauses(benchmark: str | None, steps: float) -> int:
    """Pauses a run of `steps` steps of `benchmark` takes (`PAUSE_EVERY_STEPS`)."""
    every = PAUSE_EVERY_STEPS.get(benchmark or "", 0)
    return int(steps // every) if every and steps > 0 else 0


def software_for(run_terms: dict, benchmark: str | None, release: str, generation: str) -> str | None:
    """The software release a benchmark's run is priced with on `release`/`generation`: the label most of that
    round's calibration rows on that generation ran ("NeMo 24.09" for v4.1 Hopper), else most of the round's rows,
    else the nearest round's (older first); None where the benchmark has no fitted run terms."""
    terms = run_terms.get(benchmark or "")
    if not terms:
        return None
    default = terms.get("default", {})
    for key in (f"{release}/{generation}", release):
        if key in default:
            return default[key]
    rounds = sorted({k.split("/")[0] for k in default}, key=_release_key)
    older = [r for r in rounds if _release_key(r) <= _release_key(release)]
    near = older[-1] if older else (rounds[0] if rounds else None)
    if near is None:
        return None
    return default.get(f"{near}/{generation}", default.get(near))


def with_run_terms(
    eff: Efficiency,
    run_terms: dict,
    benchmark: str | None,
    release: str,
    generation: str,
    software: str | None = None,
) -> tuple[str | None, Efficiency]:
    """(software label, `eff` with that software's RUN_TERMS) for a benchmark run on `release`/`generation`: the
    `software` label where the benchmark has it fitted, else the release's own (`software_for`); `eff` unchanged
    where there is none."""
    fitted = run_terms.get(benchmark or "", {}).get("software", {})
    label = software if software in fitted else software_for(run_terms, benchmark, release, generation)
    values = fitted.get(label or "")
    if not values:
        return None, eff
    return label, replace(eff, **{k: float(values[k]) for k in RUN_TERMS if k in values})


def cap_gemm_eff(eff: Efficiency, gpu) -> Efficiency:
    """`eff` with gemm_eff lowered where an effective GEMM or attention rate on `gpu` would pass
    `rate_bounds.PEAK_FRACTION` of its datasheet dense peak (no fitted set prices a GPU faster than physics)."""
    from scaletrain.sim.rate_bounds import max_gemm_eff

    cap = max_gemm_eff(gpu, eff.fp4_eff)
    return replace(eff, gemm_eff=cap) if eff.gemm_eff > cap else eff


def _set_for(sets: dict, release: str | None, gpu: str, gen: str) -> tuple[str, Efficiency]:
    if not sets:
        return "prior", Efficiency()
    known = sorted({k.split("/")[0] for k in sets}, key=_release_key)
    if release in (None, "", "latest"):
        release = known[-1]
    if not release.startswith("v") and release[:1].isdigit():
        release = "v" + release
    if release not in known and release.lstrip("v") in known:
        release = release.lstrip("v")
    if release not in known:
        hint = f" (the {release} sets come from `scaletrain sim calibrate ... --out F`, with ${EFFICIENCY_ENV}=F)"
        raise ValueError(
            f"--calibration {release}: no fitted set; known: {', '.join(known)}"
            + (hint if release == "measured" else "")
        )
    key = f"{release}/{gen}"
    if key in sets:
        return key, Efficiency.from_dict(sets[key])
    if _release_key(release) == (0,):
        # A set fitted on the user's own runs ("measured", from `sim calibrate`) describes the hardware it was
        # fitted on: standing in a published release's set for another GPU would answer for a calibration that
        # was never made, under its name.
        have = sorted(k for k in sets if k.split("/")[0] == release)
        numbered = [r for r in known if _release_key(r) != (0,)]
        raise ValueError(
            f"--calibration {release}: no set {key} for {gpu} in ${EFFICIENCY_ENV} (it has {', '.join(have)}"
            + (", which prices CPU runs only" if have == [f"{release}/cpu"] else "")
            + f"); fit {gpu} runs with `scaletrain sim calibrate`, or use a published release: {', '.join(numbered)}"
        )
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


def nearest_set(effs: dict, name: str) -> tuple[str, Efficiency]:
    """(set name, Efficiency) for set `name` ("v4.1/hopper") from fitted sets that may lack it: the same release's
    other generation (its own, then Hopper, Blackwell, Ampere), else the newest release's, its own generation
    first; the priors when there is no set at all."""
    if name in effs:
        return name, effs[name]
    release, gen = name.split("/", 1)
    for candidate in (gen, "hopper", "blackwell", "ampere"):
        if f"{release}/{candidate}" in effs:
            return f"{release}/{candidate}", effs[f"{release}/{candidate}"]
    newest = sorted(effs, key=lambda k: (k.split("/")[1] == gen, _release_key(k.split("/")[0])))
    if not newest:
        return "prior", Efficiency()
    return newest[-1], effs[newest[-1]]
