"""`scaletrain export`: which checkpoint a run directory, checkpoints folder or checkpoint names; where its Hugging Face
export may go; and reading it while its run may still be training.

* Source: a checkpoint (step_N with a manifest), a checkpoints folder or a run directory; the last two give their
  newest complete checkpoint, which after a run that ended is its last step (train/loop.py saves it).
* Target: a new or empty directory; an existing one only with --overwrite, which replaces the export's own files
  and nothing else (checkpoint/hf/common.py). Never, not even with --overwrite: a run or benchmark directory, a
  checkpoint or checkpoints folder (or a directory inside a checkpoint), the current directory or one above it,
  the checkpoint being exported or a directory that contains it.
* A live run: the checkpoints folder is held for reading (store.reading), so the run's pruner deletes nothing until
  the export has read its checkpoint; a checkpoint removed by anything else meanwhile is one line, not a traceback.
* Tokenizer: the one the run trained with (its config's data.tokenizer, else its default corpus's), or --tokenizer
  FILE, goes into the export as tokenizer.json + tokenizer_config.json + generation_config.json
  (checkpoint/hf/tokenizer_export.py). One whose sha256 or vocabulary differs from what the run's training data
  was encoded with is never shipped: the export then holds the weights alone and its line says why.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from scaletrain.checkpoint import store
from scaletrain.checkpoint.store import CheckpointError
from scaletrain.data.indexed import DataError
from scaletrain.train.rundir import LOCK_NAME, holds_run, live_owner

__all__ = ["Source", "find_source", "target_problem", "final_step_note", "run_tokenizer", "export"]

NO_CHECKPOINT_FIX = (
    "`scaletrain train` saves the last step of a run that converges or uses up its step budget (unless "
    "checkpoint.final=false; not after a divergence or a crash), `scaletrain bench` runs only with --set "
    "checkpoint.interval_steps=N (which also saves after evaluations); train again to get one"
)
"""How a run gets a checkpoint to export (CheckpointConfig.final and the interval triggers); the message's fix."""


@dataclass
class Source:
    """What `export` reads: the checkpoints folder (`root`, None for a lone checkpoint elsewhere), the run directory
    above it (None when there is none) and the checkpoint named directly (None: the newest in `root`)."""

    given: Path
    root: Path | None
    run_dir: Path | None
    checkpoint: Path | None

    def newest(self) -> Path:
        """The checkpoint to export: the one named, else the newest complete one in `root` (call under reading())."""
        if self.checkpoint is not None:
            return self.checkpoint
        found = store.complete_checkpoints(self.root) if self.root is not None else []
        if not found:
            half = store.unpublished(self.root) if self.root is not None else []
            held = f"only an unfinished save, {half[-1].name}" if half else "none"
            raise CheckpointError(
                f"{self.given}: no checkpoint to export ({self.root} holds {held}{self._ended()}); {NO_CHECKPOINT_FIX}"
            )
        return found[-1]

    def _ended(self) -> str:
        """How the run ended, from its result.json ("" when unknown): a diverged run explains its missing save."""
        try:
            result = json.loads((self.run_dir / "result.json").read_text()) if self.run_dir is not None else None
        except (OSError, ValueError, RecursionError):
            return ""
        outcome = result.get("outcome") if isinstance(result, dict) else None
        return f"; the run's outcome: {outcome}" if isinstance(outcome, str) and outcome.isprintable() else ""


def find_source(given: str | Path) -> Source:
    """Classify the export's CHECKPOINT argument (a checkpoint, a checkpoints folder or a run directory)."""
    path = Path(given)
    if (path / store.MANIFEST).exists():
        # Its folder is locked for reading only when it is one a run prunes (not any directory a copy sits in).
        root = path.parent if store.complete_checkpoints(path.parent) else None
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return Source(path, root, run_dir, path)
    if not path.is_dir():
        return Source(path, None, None, path)
    if (path / "checkpoints").is_dir():
        return Source(path, path / "checkpoints", path, None)
    if store.complete_checkpoints(path) or store.unpublished(path):
        return Source(path, path, path.parent if path.name == "checkpoints" else None, None)
    if holds_run(path) is not None:
        # A run directory without checkpoints/: its checkpoint.dir elsewhere, else none was ever saved.
        return Source(path, _checkpoint_dir(path) or path / "checkpoints", path, None)
    # Neither: verification names what is missing (no manifest, not a checkpoint).
    return Source(path, None, None, path)


def _checkpoint_dir(run_dir: Path) -> Path | None:
    """The checkpoint.dir that the run in `run_dir` recorded in its config.json, when it is set and exists."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        where = cfg["checkpoint"]["dir"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    return Path(where) if isinstance(where, str) and where and Path(where).is_dir() else None


def _scaletrain_dir(path: Path) -> str | None:
    """What marks `path` as a directory scaletrain writes (run, benchmark, checkpoint, checkpoints folder), else None."""
    if not path.is_dir():
        return None
    if (path / LOCK_NAME).exists():
        return f"a run directory (holds {LOCK_NAME})"
    found = holds_run(path, bench=True)
    if found is not None:
        return f"a run directory (holds {found})"
    if (path / store.MANIFEST).exists() or (path / store.TRAINER).exists():
        return "a checkpoint"
    if (path / store.READERS_LOCK).exists() or store.complete_checkpoints(path) or store.unpublished(path):
        return "a checkpoints folder"
    return None


def target_problem(out: str | Path, source: Source) -> str | None:
    """Why `out` must never receive an export of `source`, with or without --overwrite; None when it may (the
    new-or-empty rule itself is checkpoint/hf/common.export_target_problem)."""
    out = Path(out)
    real = Path(os.path.realpath(out))
    if source.checkpoint is not None:
        src = Path(os.path.realpath(source.checkpoint))
        if real == src or src in real.parents:
            return f"{out} is the checkpoint being exported{'' if real == src else ' or inside it'}"
    for holder in (source.checkpoint, source.root, source.run_dir):
        if holder is not None and real in Path(os.path.realpath(holder)).parents:
            return f"{out} contains the checkpoint being exported ({holder})"
    what = _scaletrain_dir(real)
    if what is None:
        what = next((f"inside {a} (a checkpoint)" for a in real.parents if (a / store.MANIFEST).is_file()), None)
    if what is not None:
        return f"{out} is {what}; export into a new directory"
    return None


def final_step_note(source: Source, step: int) -> str:
    """How `step` relates to the run's end: its final step, the newest checkpoint of a live run, or neither."""
    if source.run_dir is None:
        return ""
    owner = live_owner(source.run_dir)
    if owner is not None:
        return f" (its newest complete checkpoint: the run is live, pid {owner.get('pid')} on {owner.get('host', '?')})"
    try:
        result = json.loads((source.run_dir / "result.json").read_text())
    except (OSError, ValueError, RecursionError):
        return ""
    steps = result.get("steps") if isinstance(result, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool):
        return ""
    if steps == step:
        outcome = result.get("outcome")
        ended = outcome in ("converged", "budget_exhausted") or not isinstance(outcome, str)
        return " (the final step)" if ended else f" (the step the run stopped at: {outcome})"
    if source.checkpoint is None:  # the newest was asked for and is not the last step
        return f" (the run ended at step {steps}, which has no checkpoint)"
    return ""


def _dataset_tokenizer_sha(cfg) -> tuple[str | None, Path | None]:
    """(sha256 of the tokenizer the run's training data was encoded with, its sidecar), (None, None) if unknown."""
    from scaletrain.data.prepare import meta_path

    try:
        if cfg.data.format == "sft":
            from scaletrain.data.sft_paths import resolve_paths
        else:
            from scaletrain.data.corpus import resolve_paths
        sidecar = meta_path(resolve_paths(cfg.data)[0])
        sha = json.loads(sidecar.read_text()).get("tokenizer_sha256")
    except (OSError, ValueError, RecursionError, AttributeError, DataError):
        return None, None
    return (sha, sidecar) if isinstance(sha, str) else (None, None)


def run_tokenizer(cfg, given: str | Path | None = None):
    """(Tokenizer, "") of the run whose Config is `cfg`: `given`, else its data.tokenizer, else its default corpus's;
    (None, why not) when there is none to ship. Never one other than the run's data was encoded with (sha256) or
    with another vocabulary than the model's. CheckpointError for a `given` file that is unreadable or not the
    run's: the user asked for it by name."""
    from scaletrain.data.tokenizer import Tokenizer

    try:
        if given is not None:
            path: Path | None = Path(given)
        elif cfg.data.format == "sft":
            from scaletrain.data.sft_paths import resolve_paths

            path = resolve_paths(cfg.data)[2]
        else:
            from scaletrain.data.corpus import resolve_paths

            path = resolve_paths(cfg.data)[2]
        if path is None:
            return None, "the run's datasets name no tokenizer (data.tokenizer is empty)"
        tok = Tokenizer(path)
    except DataError as exc:
        if given is not None:
            raise CheckpointError(f"--tokenizer {given}: {exc}") from None
        return None, str(exc)
    sha, sidecar = _dataset_tokenizer_sha(cfg)
    if sha is not None and sha != tok.sha256:
        why = f"{tok.path} is not the tokenizer {sidecar} was encoded with (sha256 {tok.sha256[:12]}, not {sha[:12]})"
    elif tok.vocab_size != cfg.model.vocab_size:
        why = f"{tok.path} has {tok.vocab_size} tokens, the model was trained with model.vocab_size={cfg.model.vocab_size}"
    else:
        return tok, ""
    if given is not None:
        raise CheckpointError(f"--tokenizer {given}: {why}")
    return None, why


def export(given: str | Path, out: str | Path, overwrite: bool = False, tokenizer: str | Path | None = None) -> str:
    """Export `given` (see find_source) as a Hugging Face directory `out`; returns the line to print.

    The export holds the run's tokenizer (run_tokenizer; `tokenizer` names one instead) as tokenizer.json,
    tokenizer_config.json and generation_config.json, or the line says why it has none.
    Under torchrun every rank reads and writes only its own shards (init_from.export_sharded); the others return "".
    CheckpointError (one line) for a refused target, a missing or damaged checkpoint, or one removed while read.
    """
    from scaletrain.checkpoint.hf.common import cwd_problem, export_target_problem
    from scaletrain.train.distributed import launched_world_size

    source = find_source(given)
    # The never-rules first: a run directory is not "not empty, pass --overwrite", it is not a target at all.
    problem = cwd_problem(Path(out)) or target_problem(out, source) or export_target_problem(Path(out), overwrite)
    if problem:
        raise CheckpointError(f"export: {problem}")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise CheckpointError(f"--tokenizer {tokenizer}: no such file")
    holder = store.reading(source.root) if source.root is not None else contextlib.nullcontext()
    missing: list[str] = []

    def tokenizer_files(cfg) -> dict[str, bytes] | None:
        from scaletrain.checkpoint.hf.tokenizer_export import tokenizer_files as files_of

        tok, why = run_tokenizer(cfg, tokenizer)
        if tok is None:
            missing.append(why)
            return None
        try:
            return files_of(tok, cfg.model.seq_len)
        except (ValueError, OSError) as exc:
            if tokenizer is not None:
                raise CheckpointError(f"--tokenizer {tokenizer}: {exc}") from None
            missing.append(str(exc))
            return None

    with holder:
        path = source.newest()
        existed = path.exists()
        try:
            if launched_world_size() > 1:
                cfg, written, rank = _export_sharded(path, Path(out), overwrite, tokenizer_files)
                if rank:
                    return ""
            else:
                cfg, written = _export_one(path, Path(out), overwrite, tokenizer_files)
        except (CheckpointError, OSError) as exc:
            if existed and not path.exists():
                raise CheckpointError(
                    f"{path}: removed while being exported (by another process); export again for the newest"
                ) from None
            if isinstance(exc, FileExistsError):
                raise CheckpointError(str(exc)) from None
            if isinstance(exc, OSError):  # the target: a read-only or full disk
                where = f" ({exc.filename})" if exc.filename else ""
                raise CheckpointError(f"export to {out} failed: {exc.strerror or exc}{where}") from None
            raise
        step = _step_of(path)
    from scaletrain.model.spec import model_spec

    hf_class = model_spec(cfg.model.arch).hf_class
    line = f"exported step {step} of {source.given}{final_step_note(source, step)}: {path} -> {written} "
    if missing:
        return line + (
            f"(load with transformers.{hf_class}.from_pretrained; no tokenizer: {missing[0]}; "
            "pass --tokenizer FILE, the .model or tokenizer.json the run trained with)"
        )
    return (
        line + f"with its tokenizer (load with transformers.AutoTokenizer and transformers.{hf_class}.from_pretrained)"
    )


def _step_of(path: Path) -> int:
    """The step of a checkpoint that just loaded (its manifest passed verification)."""
    step = json.loads((path / store.MANIFEST).read_text()).get("step")
    return step if isinstance(step, int) else -1


def _export_one(path: Path, out: Path, overwrite: bool, extra_files):
    from scaletrain.checkpoint.hf import export_hf
    from scaletrain.checkpoint.init_from import load_full_model

    cfg, model = load_full_model(path)
    if cfg.lora.rank > 0:
        # The HF format has no adapters: a LoRA checkpoint is always exported merged (W + (alpha/r)·B·A).
        from scaletrain.model.lora import merge_lora

        merge_lora(model)
    files = extra_files(cfg)
    try:
        return cfg, export_hf(model.state_dict(), cfg.model, out, overwrite=overwrite, extra_files=files)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _export_sharded(path: Path, out: Path, overwrite: bool, extra_files):
    import torch

    from scaletrain.checkpoint.init_from import export_sharded
    from scaletrain.train.distributed import init_distributed

    rank, _ = init_distributed(torch.device("cpu"))
    cfg, written = export_sharded(path, out, overwrite, extra_files)
    return cfg, written, rank
