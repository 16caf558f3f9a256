"""`scaletrain report`: loss curves of a run (or of every run of a benchmark) as loss.png."""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.data.indexed import DataError


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of run_dir/metrics.jsonl; a bad line is a one-line error. Other lines (a
    checkpoint save's {"step", "checkpoint_s"}) are in neither."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: no metrics.jsonl (is {run_dir} a run directory?)")
    train: list[dict] = []
    evals: list[dict] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if "eval_loss" in record:
            evals.append(record)
        elif "loss" in record:
            train.append(record)
    return train, evals


def plot_run(run_dir: Path) -> list[Path]:
    """Write loss.png into run_dir (and into each run_*/ of a benchmark directory); return the paths."""
    runs = sorted(p for p in run_dir.glob("run_*") if (p / "metrics.jsonl").is_file())
    if runs:
        out = [_plot(r, [r]) for r in runs]
        out.append(_plot(run_dir, runs))
        return out
    return [_plot(run_dir, [run_dir])]


def _plot(target: Path, runs: list[Path]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        train, evals = read_metrics(run)
        label = run.name if len(runs) > 1 else "train"
        (line,) = ax.plot(
            [r["tokens"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.7, label=f"{label} loss"
        )
        if evals:
            ax.plot(
                [r["tokens"] for r in evals],
                [r["eval_loss"] for r in evals],
                "o-",
                color=line.get_color(),
                label=f"{label} eval",
            )
    target_loss = _target(runs[0])
    if target_loss is not None:
        ax.axhline(target_loss, color="k", ls="--", lw=0.8, label=f"target {target_loss}")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(str(target))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = target / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _target(run: Path):
    cfg = run / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("train", {}).get("target_eval_loss")
    return None
