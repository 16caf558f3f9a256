"""Scalar sinks of the metrics logger (metrics.py): TensorBoard always, Weights & Biases on request.

Every sink gets the same scalars at the same step from `scalars_of(record)`, so the two dashboards never disagree.
W&B (`train.wandb_project`, the [wandb] extra) is imported only when asked for; without network it runs with
WANDB_MODE=offline and `wandb sync <run_dir>/wandb/offline-run-*` uploads the run later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from scaletrain.config import WANDB_MISSING, Config, ConfigError
from scaletrain.diskfull import is_no_space, writing

__all__ = ["ScalarSink", "TensorBoardSink", "WandbSink", "scalars_of", "optional_sinks"]


class ScalarSink(Protocol):
    """Where the numeric fields of each metrics record go."""

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Record `scalars` (name -> number) at training step `step`."""

    def close(self) -> None:
        """Flush and release; called once at the end of the run."""


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, less its step and wall time: what every sink receives."""
    return {k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))}


class TensorBoardSink:
    """Event files under <run_dir>/tensorboard, one scalar per key. A full disk is one DiskFullError naming the
    directory, raised at the next add_scalars or close (TensorBoard writes from a thread of its own)."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        """`first_step`: where a resumed run starts; TensorBoard hides the lost attempt's events after it."""
        from torch.utils.tensorboard import SummaryWriter  # heavy import: only when asked for

        _quiet_writer_thread_on_full_disk()
        self.path = run_dir / "tensorboard"
        with writing(self.path):
            self._writer = SummaryWriter(log_dir=str(self.path), purge_step=first_step + 1)

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """One add_scalar per key at `step`."""
        with writing(self.path):
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush the event file."""
        with writing(self.path):
            self._writer.close()


def _quiet_writer_thread_on_full_disk() -> None:
    """Keep threading's traceback off stderr when TensorBoard's writer thread dies of a full disk.

    The thread keeps its exception and TensorBoard raises it again in the training thread at the next write or
    close, where TensorBoardSink turns it into one line; the thread's own report would be a second, traceback one.
    Every other thread exception goes to the hook that was installed before (installed once per process).
    """
    import threading

    if getattr(threading.excepthook, "_scaletrain_tensorboard", False):
        return
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook

    def hook(args) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and args.exc_value is not None:
            if is_no_space(args.exc_value, "."):  # errno-carrying OSErrors only: the path is not consulted
                return
        previous(args)

    hook._scaletrain_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class WandbSink:
    """One W&B run per process start (a resumed run is a new W&B run that begins at its resume step); its files go
    to <run_dir>/wandb and its config is the resolved config.json."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        """Starts the W&B run (wandb.init); wandb is imported here, the only place."""
        try:
            import wandb
        except ImportError:
            raise ConfigError(WANDB_MISSING) from None
        t = cfg.train
        self._run = wandb.init(
            project=t.wandb_project,
            name=t.wandb_run_name or run_dir.resolve().name,
            dir=str(run_dir),
            config=cfg.to_dict(),
        )

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """wandb.log of the scalars at `step` (an evaluation line logs at the step of the training line before it)."""
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        """wandb finish: uploads (online) or closes the offline run directory."""
        self._run.finish()


def optional_sinks(cfg: Config, run_dir: str | Path) -> list[ScalarSink]:
    """The sinks the config asks for besides TensorBoard: W&B when train.wandb_project is set."""
    return [WandbSink(cfg, Path(run_dir))] if cfg.train.wandb_project else []
