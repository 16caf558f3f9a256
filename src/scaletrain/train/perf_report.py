"""`scaletrain report`'s performance half: perf.png and its table, measured beside predicted, for one run or several.

perf.png: the measured step time over the steps with the predicted step time as a dashed line of the same colour,
and a stacked bar per run of the measured step breakdown (means over the steady steps, which sum to their mean
step time) beside the predicted one (prediction.json, mapped onto the same keys). The table prints the same numbers:
the median steady step time (as `sim calibrate` reads a run), its ratio to the prediction, and the parts. Every part
is named as metrics.jsonl names it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from scaletrain.sim.fit.run_files import read_metrics, read_prediction
from scaletrain.sim.run_prediction import steady_median
from scaletrain.train.report import save_figure

PARTS = ("data_s", "fwd_bwd_s", "comm_exposed_s", "optimizer_s", "other_s")
"""The breakdown's parts, as metrics.jsonl names them."""

STACKED = ("data_s", "fwd_bwd_s", "optimizer_s", "other_s")
"""The parts that sum to the step time, stacked in the bars; comm_exposed_s is time inside fwd_bwd_s (and the
optimizer's) spent waiting for collectives, drawn hatched over the top of the fwd_bwd_s segment."""

_COLOURS = {
    "data_s": "#8c8c8c",
    "fwd_bwd_s": "#4c72b0",
    "comm_exposed_s": "#dd8452",
    "optimizer_s": "#55a868",
    "other_s": "#c44e52",
}


def _stack(b: dict) -> dict:
    """A breakdown (metrics.jsonl or prediction.json keys) -> PARTS, a missing part 0."""
    return {k: b.get(k) or 0.0 for k in PARTS}


class RunPerf:
    """One run's measured steps and its prediction."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir)
        train, _ = read_metrics(self.path)  # every field checked: finite, in range (sim/fit/run_files.py)
        self.records = [r for r in train if "step_time_s" in r]
        self.prediction = read_prediction(self.path)

    @property
    def name(self) -> str:
        """The run directory's name (for legends and the table)."""
        return self.path.name

    @property
    def predicted_step_s(self) -> float | None:
        """The predicted step time, or None (no prediction.json, or the prediction failed)."""
        p = self.prediction
        return p.get("step_time_s") if p and "error" not in p else None

    def measured_step_s(self) -> float | None:
        """Median step time past the first third of the timed steps."""
        return steady_median([r["step_time_s"] for r in self.records]) if self.records else None

    def measured_parts(self) -> dict | None:
        """Mean of each part over the steady steps (a step without the breakdown counts whole as other_s)."""
        steady = self.records[len(self.records) // 3 :]
        if not steady:
            return None
        parts = []
        for r in steady:
            if "fwd_bwd_s" in r:
                parts.append(_stack(r))
            else:  # a run from before the breakdown was recorded
                parts.append({**dict.fromkeys(PARTS, 0.0), "other_s": r["step_time_s"]})
        return {k: statistics.fmean(p[k] for p in parts) for k in PARTS}

    def predicted_parts(self) -> dict | None:
        """The prediction's breakdown as PARTS, or None."""
        if self.predicted_step_s is None or not isinstance(self.prediction, dict):
            return None
        return _stack(self.prediction.get("breakdown") or {})


def perf_table(runs: list[RunPerf]) -> str:
    """The text table `scaletrain report` prints: per run a measured and a predicted row."""
    head = f"{'run':<20} {'':<9} {'step_s':>9} {'ratio':>6}" + "".join(f" {k:>14}" for k in PARTS)
    lines = [head]
    for run in runs:
        measured, predicted = run.measured_step_s(), run.predicted_step_s
        ratio = f"{measured / predicted:6.2f}" if measured and predicted else f"{'-':>6}"
        for label, step, parts, r in (
            ("measured", measured, run.measured_parts(), ratio),
            ("predicted", predicted, run.predicted_parts(), ""),
        ):
            cells = "".join(f" {parts[k]:14.4f}" for k in PARTS) if parts else "".join(f" {'-':>14}" for _ in PARTS)
            step_text = f"{step:9.4f}" if step is not None else f"{'-':>9}"
            lines.append(f"{run.name[:20]:<20} {label:<9} {step_text} {r:>6}{cells}")
        if run.prediction and "error" in run.prediction:
            error = run.prediction["error"].strip().splitlines()[:1] or ["(no message)"]
            lines.append(f"{'':<20} prediction failed: {error[0][:200]}")
        elif run.prediction is None:
            lines.append(f"{'':<20} no prediction.json")
    lines.append(
        "step_s: median of the steady steps (past the first third); parts: their means, comm_exposed_s inside "
        "fwd_bwd_s and optimizer_s; ratio: measured/predicted"
    )
    return "\n".join(lines)


def plot_perf(runs: list[RunPerf], path: Path) -> Path:
    """Draw perf.png at `path`: step time over steps (predicted as dashed lines) and the breakdown bars."""
    import matplotlib.pyplot as plt

    fig = perf_figure(runs)
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def perf_figure(runs: list[RunPerf]):
    """perf.png's matplotlib figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    for run in runs:
        (line,) = ax.plot(
            [r["step"] for r in run.records], [r["step_time_s"] for r in run.records], lw=0.9, label=run.name
        )
        if run.predicted_step_s is not None:
            ax.axhline(run.predicted_step_s, color=line.get_color(), ls="--", lw=1, label=f"{run.name} predicted")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    labels: list[str] = []
    for i, run in enumerate(runs):
        for j, (what, parts) in enumerate((("measured", run.measured_parts()), ("predicted", run.predicted_parts()))):
            x = len(labels)
            labels.append(f"{run.name}\n{what}" if len(runs) > 1 else what)
            bottom = 0.0
            first = i == 0 and j == 0
            for k in STACKED:
                value = max(0.0, parts[k]) if parts else 0.0
                bars.bar(
                    x, value, bottom=bottom, color=_COLOURS[k], alpha=0.6 if j else 1.0, label=k if first else None
                )
                if k == "fwd_bwd_s" and parts:
                    # The wait for collectives, within fwd_bwd_s: the segment's top part, hatched.
                    comm = min(max(0.0, parts["comm_exposed_s"]), value)
                    bars.bar(
                        x,
                        comm,
                        bottom=bottom + value - comm,
                        color=_COLOURS["comm_exposed_s"],
                        alpha=0.6 if j else 1.0,
                        hatch="//",
                        label="comm_exposed_s (in fwd_bwd_s)" if first else None,
                    )
                bottom += value
    bars.set_xticks(range(len(labels)), labels, fontsize=8)
    bars.set_ylabel("seconds per step")
    bars.legend(fontsize=8)
    fig.suptitle(" vs ".join(r.name for r in runs) if len(runs) > 1 else str(runs[0].path))
    fig.tight_layout()
    return fig


def report_perf(run_dirs: list[Path], out: Path | None = None) -> tuple[Path, str]:
    """perf.png (into the run directory for one run; at `out`, default ./perf.png, for several) and the table."""
    runs = [RunPerf(d) for d in run_dirs]
    if out is None:
        out = runs[0].path / "perf.png" if len(runs) == 1 else Path("perf.png")
    return plot_perf(runs, out), perf_table(runs)
