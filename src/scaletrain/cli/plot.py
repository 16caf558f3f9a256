"""`scaletrain sim plot`: predicted time-to-train against GPU count per GPU type, published results overlaid.

A curve is the planner's best layout at each GPU count; a published point ran its submitter's layout, which is
often another one (a different TP/PP split or global batch). So each point is planned at its own GPU count too, and
the plot and the printed notes say which published points ran a layout other than the curve's there: the vertical
gap to such a point is not the model's error on that layout (`sim validate` measures that).
"""

from __future__ import annotations

from scaletrain import benchmarks
from scaletrain.sim.catalog import default_catalog
from scaletrain.sim.fit.results import bundled_results, load_results
from scaletrain.sim.workload import load_workload

DEFAULT_COUNTS = (8, 64, 512)
"""GPU counts for a preset that is no MLPerf benchmark (a benchmark's come from its registry entry)."""


def default_gpus(rows) -> tuple[str, ...]:
    """The GPUs drawn when --gpu is not given: those the published results ran on, in catalog order, so every
    published point has its curve."""
    ran = {r.gpu for r in rows}
    return tuple(k for k in default_catalog().gpus if k in ran)


def gpu_colour(gpu: str):
    """One colour per catalog GPU (by its place in the catalog), the same in every plot; black for another."""
    import matplotlib

    keys = list(default_catalog().gpus)
    if gpu not in keys:
        return "black"
    i = keys.index(gpu) % 20
    # tab20 pairs a dark and a light shade of each hue: the ten dark ones first, so neighbours differ in hue.
    return matplotlib.colormaps["tab20"](2 * i % 20 + i // 10)


def layout_text(tp: int, pp: int, vp: int, cp: int, gbs: int) -> str:
    """A layout as the curves and the notes print it."""
    return f"TP{tp} PP{pp} VP{vp} CP{cp} GBS{gbs}"


def scaling_curves(
    model: str, gpus: tuple[str, ...], counts=None, calibration: str | None = None, also: dict | None = None
) -> dict:
    """{gpu: [(n_gpus, minutes, layout text), ...]} from the planner's best layout at each count (`also`: {gpu:
    further counts}, the published points' own)."""
    from scaletrain.sim.plan import plan

    spec = benchmarks.for_model(model)
    preset = spec.reference_preset if spec else model
    w = load_workload(preset)
    out = {}
    for gpu in gpus:
        pts = []
        for n in sorted(
            set(counts or (spec.plot_gpu_counts if spec else DEFAULT_COUNTS)) | set((also or {}).get(gpu, ()))
        ):
            res = plan(w, gpu, n, calibration=calibration, top=1)
            if res.best and res.best[0].time_to_train_min is not None:
                best = res.best[0]
                lay = best.layout
                pts.append(
                    (n, best.time_to_train_min, layout_text(lay["tp"], lay["pp"], lay["vp"], lay["cp"], lay["gbs"]))
                )
        out[gpu] = pts
    return out


def layout_notes(curves: dict, rows) -> tuple[int, list[str]]:
    """(how many published points drawn against a curve ran another layout than the curve's at their GPU count,
    one line per GPU and count with such points: the curve's layout there and the published ones, with how many
    results ran each)."""
    groups: dict[tuple[str, int], dict[str, int]] = {}
    for r in rows:
        if r.gpu not in curves:
            continue
        published = layout_text(r.tp, r.pp, r.vp, r.cp, r.gbs)
        if _planned_at(curves, r.gpu, r.gpus) != published:
            counts = groups.setdefault((r.gpu, r.gpus), {})
            counts[published] = counts.get(published, 0) + 1
    lines = []
    for (gpu, n), layouts in sorted(groups.items()):
        ran = ", ".join(f"{text} ({k} result{'s' if k > 1 else ''})" for text, k in sorted(layouts.items()))
        lines.append(
            f"{gpu} x{n}: the curve {_planned_at(curves, gpu, n) or 'has no feasible layout'}; published {ran}"
        )
    return sum(sum(c.values()) for c in groups.values()), lines


def _planned_at(curves: dict, gpu: str, n: int) -> str | None:
    return {count: text for count, _, text in curves[gpu]}.get(n)


def plot_scaling(
    model: str, out: str, gpus=None, calibration: str | None = None, results=()
) -> tuple[str, int, list[str]]:
    """Draw the curves and the published points of the same benchmark; returns the PNG path, and how many published
    points ran another layout than the curve's with the lines that say which (`layout_notes`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = benchmarks.for_model(model)
    if spec is None:
        known = ", ".join(b.reference_preset for b in benchmarks.BENCHMARKS.values())
        raise ValueError(f"--model {model}: plot needs an MLPerf benchmark model ({known})")
    rows = [r for r in bundled_results(spec.name)]
    for path in results:
        rows += [r for r in load_results(path).rows if r.benchmark == spec.name]
    drawn = tuple(gpus or default_gpus(rows))
    also = {g: {r.gpus for r in rows if r.gpu == g} for g in drawn}
    curves = scaling_curves(spec.reference_preset, drawn, calibration=calibration, also=also)
    differ, notes = layout_notes(curves, rows)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for gpu, pts in curves.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=gpu_colour(gpu), label=f"{gpu} predicted")
    seen = set()
    for r in rows:
        label = f"{r.gpu} published" if r.gpu not in seen else None
        seen.add(r.gpu)
        colour = gpu_colour(r.gpu)
        ax.plot(r.gpus, r.score_minutes, "o", color=colour, mfc="none", ms=8, label=label)
        if r.gpu in curves and _planned_at(curves, r.gpu, r.gpus) != layout_text(r.tp, r.pp, r.vp, r.cp, r.gbs):
            ax.plot(r.gpus, r.score_minutes, "x", color=colour, ms=5)  # another layout than the curve's there
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("time to train (minutes)")
    ax.set_title(f"{spec.name}: predicted (best planned layout) vs published MLPerf results")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if notes:
        fig.text(
            0.01,
            0.01,
            f"x: {differ} of {sum(r.gpu in curves for r in rows)} published points ran another layout than the "
            "curve's best planned one at their GPU count (see the printed notes); the gap to them is not the "
            "model's error on their layout",
            fontsize=7,
            wrap=True,
        )
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out, differ, notes
