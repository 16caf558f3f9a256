"""`scaletrain report`: loss curves of a run (or of every run of a benchmark) as loss.png.

The run directories are read as untrusted data (`sim/fit/run_files.py`: every field checked, one line naming the file
for anything wrong); the plots are written only where every one of them can be, each through a temporary file and
a rename, so a failed report leaves no half-written or damaged png behind.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from scaletrain.data.indexed import DataError
from scaletrain.sim.fit.run_files import read_config_table, read_metrics

__all__ = [
    "read_metrics",
    "plot_run",
    "loss_targets",
    "read_loss",
    "draw_loss",
    "loss_figure",
    "check_writable",
    "save_figure",
]


def loss_targets(run_dir: Path) -> list[tuple[Path, list[Path]]]:
    """(directory that gets a loss.png, the runs drawn in it) for a run directory, or for a benchmark directory:
    each run_*/ and the directory itself with all of them."""
    runs = sorted(p for p in run_dir.glob("run_*") if (p / "metrics.jsonl").is_file())
    if runs:
        return [(r, [r]) for r in runs] + [(run_dir, runs)]
    return [(run_dir, [run_dir])]


def check_writable(path: Path) -> None:
    """DataError (one line naming it) when a report cannot write its plot `path`: its directory missing or
    read-only, or the name taken by something other than a file. Checked for every plot before any is drawn, so
    that no plot is written when another cannot be."""
    directory = path.parent
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory; nothing written")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(
            f"{directory}: cannot write the report's plots here (read-only); nothing written "
            "(copy the run directory somewhere writable)"
        )
    if os.path.lexists(path) and not path.is_file():
        raise DataError(f"{path}: cannot write the plot there (not a file); nothing written")


def save_figure(fig, path: Path) -> Path:
    """Save matplotlib figure `fig` as png at `path` through a temporary file and a rename (an older plot stays
    whole if saving fails); DataError naming the file when it cannot be written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path}: cannot write ({exc.strerror or exc}); nothing written there") from None
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write loss.png into run_dir (and into each run_*/ of a benchmark directory); return the paths."""
    return [draw_loss(target, read_loss(runs)) for target, runs in loss_targets(run_dir)]


def read_loss(runs: list[Path]) -> dict:
    """What one loss.png draws, every file read and checked: {"curves": [(label, training records, evaluation
    records)], "target": the first run's train.target_eval_loss or None}."""
    curves = []
    for run in runs:
        train, evals = read_metrics(run)
        train = [r for r in train if "loss" in r]
        curves.append((run.name if len(runs) > 1 else "", train, evals))
    return {"curves": curves, "target": _target(runs[0])}


def _number(value) -> float:
    """A loss for plotting: null (a non-finite loss, written so in strict JSON) becomes NaN, a gap in the line."""
    return math.nan if value is None else float(value)


def draw_loss(target: Path, data: dict) -> Path:
    """Draw `read_loss`'s `data` as target/loss.png; returns its path."""
    import matplotlib.pyplot as plt

    fig = loss_figure(target, data)
    try:
        return save_figure(fig, target / "loss.png")
    finally:
        plt.close(fig)


def loss_figure(target: Path, data: dict):
    """loss.png's matplotlib figure (the caller saves and closes it). Curves are named as metrics.jsonl names
    them, `loss` (training) and `eval_loss`, after the run's name when several runs share the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        for name, train, evals in data["curves"]:
            label = f"{name} " if name else ""
            (line,) = ax.plot(
                [r["tokens"] for r in train],
                [_number(r["loss"]) for r in train],
                lw=0.8,
                alpha=0.7,
                label=f"{label}loss",
            )
            if evals:
                ax.plot(
                    [r["tokens"] for r in evals],
                    [_number(r["eval_loss"]) for r in evals],
                    "o-",
                    color=line.get_color(),
                    label=f"{label}eval_loss",
                )
        if data["target"] is not None:
            ax.axhline(data["target"], color="k", ls="--", lw=0.8, label=f"target {data['target']}")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(str(target))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _target(run: Path) -> float | None:
    """train.target_eval_loss of the run's config.json (None without one); DataError naming the file when it is
    there but not a finite number."""
    if not (run / "config.json").exists():
        return None
    path = run / "config.json"
    train = read_config_table(run).get("train", {})
    if not isinstance(train, dict):
        raise DataError(f"{path}: train={train!r} must be a section (a JSON object)")
    value = train.get("target_eval_loss")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{path}: train.target_eval_loss={value!r} must be a finite number")
    return float(value)
