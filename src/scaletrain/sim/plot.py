"""`scaletrain sim plot`: predicted time-to-train against GPU count per GPU type, published results overlaid."""

from __future__ import annotations

from scaletrain import benchmarks
from scaletrain.sim.results import bundled_results, load_results
from scaletrain.sim.workload import load_workload

DEFAULT_GPUS = ("h100", "h200", "b200", "gb200", "gb300")
DEFAULT_COUNTS = (8, 64, 512)
"""GPU counts for a preset that is no MLPerf benchmark (a benchmark's come from its registry entry)."""
COLORS = {
    "a100": "tab:gray",
    "h100": "tab:blue",
    "h200": "tab:orange",
    "b200": "tab:green",
    "gb200": "tab:red",
    "gb300": "tab:purple",
}


def scaling_curves(model: str, gpus=DEFAULT_GPUS, counts=None, calibration: str | None = None) -> dict:
    """{gpu: [(n_gpus, minutes, layout text), ...]} from the planner's best layout at each count."""
    from scaletrain.sim.plan import plan

    spec = benchmarks.for_model(model)
    preset = spec.reference_preset if spec else model
    w = load_workload(preset)
    out = {}
    for gpu in gpus:
        pts = []
        for n in counts or (spec.plot_gpu_counts if spec else DEFAULT_COUNTS):
            res = plan(w, gpu, n, calibration=calibration, top=1)
            if res.best and res.best[0].time_to_train_min is not None:
                best = res.best[0]
                lay = best.layout
                pts.append(
                    (
                        n,
                        best.time_to_train_min,
                        f"TP{lay['tp']} PP{lay['pp']} VP{lay['vp']} CP{lay['cp']} GBS{lay['gbs']}",
                    )
                )
        out[gpu] = pts
    return out


def plot_scaling(model: str, out: str, gpus=None, calibration: str | None = None, results=()) -> str:
    """Draw the curves and the published points of the same benchmark; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = benchmarks.for_model(model)
    if spec is None:
        known = ", ".join(b.reference_preset for b in benchmarks.BENCHMARKS.values())
        raise ValueError(f"--model {model}: plot needs an MLPerf benchmark model ({known})")
    curves = scaling_curves(spec.reference_preset, tuple(gpus or DEFAULT_GPUS), calibration=calibration)
    rows = [r for r in bundled_results(spec.name)]
    for path in results:
        rows += [r for r in load_results(path).rows if r.benchmark == spec.name]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for gpu, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=COLORS.get(gpu), label=f"{gpu} predicted")
    seen = set()
    for r in rows:
        label = f"{r.gpu} published" if r.gpu not in seen else None
        seen.add(r.gpu)
        ax.plot(r.gpus, r.score_minutes, "o", color=COLORS.get(r.gpu, "black"), mfc="none", ms=8, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("time to train (minutes)")
    ax.set_title(f"{spec.name}: predicted (best planned layout) vs published MLPerf results")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
