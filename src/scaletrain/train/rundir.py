"""Keeping a run directory whole: one writer at a time, no silent mixing of two runs, strict JSON files.

* `RunDirLock`: an exclusive `fcntl.flock` on `<dir>/.scaletrain.lock`, which holds the owner's pid and host.
  The kernel drops a flock when its process dies (SIGKILL included), so a lock file left behind by a dead run
  is taken over with a warning; a live owner makes the second run refuse with one line.
* `RunDirClaim`: what to do with a directory that already holds a run. `--resume` continues it,
  `--overwrite` clears the old run's files first, the default directories (`runs/latest`, `runs/bench`) move
  the previous run aside to `<dir>.<N>`, and any other directory is refused. Under torchrun rank 0 decides
  and every rank gets its answer, so a refusal stops all of them.
* `strict_json`: NaN/Infinity are not JSON; they are written as null and named under "non_finite".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from scaletrain.config import ConfigError
from scaletrain.config_io import load_json_bounded, loads_bounded
from scaletrain.diskfull import NO_SPACE_ERRNOS
from scaletrain.log import get_logger

log = get_logger(__name__)

LOCK_NAME = ".scaletrain.lock"
DEFAULT_DIRS = ("runs/latest", "runs/bench")
"""Directories a command uses when none is named; re-running into them moves the previous run aside."""
# What a run (train) or a benchmark (bench --out) leaves in its directory; --overwrite removes exactly these.
RUN_FILES = (
    "result.json",
    "mllog.txt",
    "metrics.jsonl",
    "tensorboard",
    "profile",  # train.profile_steps / memory_snapshot (profiling.py)
    "wandb",  # the W&B sink's local files (sinks.py)
    "checkpoints",
    "loss.png",
    "perf.png",
    "prediction.json",
    "compliance.txt",
    "compliance_checker.log",
    "config.json",
)
BENCH_FILES = ("summary.json",)
_BENCH_RUN = re.compile(r"^run_\d+$")
_CHECKPOINT_ENTRY = re.compile(r"^step_\d{8}($|\.)")


class RunDirError(ConfigError):
    """The run directory is in use or holds another run; the message says which flag resolves it."""


# ---------------------------------------------------------------- strict JSON


def strict_json(value: Any) -> Any:
    """`value` with every NaN/Infinity replaced by None; a dict that had one gains "non_finite": {key: "nan"}."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        out, bad = {}, {}
        for key, item in value.items():
            if isinstance(item, float) and not math.isfinite(item):
                bad[key] = str(item)
            out[key] = strict_json(item)
        if bad:
            out["non_finite"] = {**out.get("non_finite", {}), **bad}
        return out
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps_strict(value: Any, **kwargs) -> str:
    """json.dumps that never writes a bare NaN/Infinity (see strict_json)."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


# ---------------------------------------------------------------- metrics.jsonl on resume


def truncate_metrics(path: Path, step: int) -> int:
    """Cut metrics.jsonl after its last record at or before `step`; returns the bytes kept.

    A resumed run re-trains the steps after its checkpoint and logs them again, so the lines of the lost
    attempt go (a line torn by a kill too): every step stays in the file once. Records are in step order.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    keep = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = loads_bounded(line, str(path)) if line.endswith(b"\n") else None
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] > step:
                break
            keep += len(line)
    if keep < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(keep)
    return keep


# ---------------------------------------------------------------- lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    """Exclusive lock on a run directory for the life of this process (or until release())."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> str | None:
        """Take the lock or raise RunDirError naming the owner; returns a warning when a stale lock was taken."""
        self._created = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_error(exc, self.directory, "cannot use it as a run directory") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                if self._created:  # made for this run a moment ago: leave no empty directory behind
                    with contextlib.suppress(OSError):
                        self.directory.rmdir()
                raise _os_error(exc, self.path, "cannot create the lock file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = _read_owner(fd)
                os.close(fd)
                self._created = False
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RunDirError(f"{self.path}: cannot lock the run directory ({exc.strerror})") from None
                raise RunDirError(
                    f"run directory {self.directory} is in use by {_describe(owner)} "
                    f"(lock file {self.path}); wait for it to end or choose another directory"
                ) from None
            # The previous owner may have unlinked the file between our open and flock: lock the file on disk.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        owner = _read_owner(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._fd = fd  # held from here: release() on the error below unlinks the file and frees the directory
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError as exc:
            self.release()
            raise _os_error(exc, self.path, "cannot write the lock file") from None
        pid = owner.get("pid")
        if owner and pid != me["pid"]:
            dead = isinstance(pid, int) and pid > 0 and owner.get("host") == me["host"] and not _alive(pid)
            gone = "not running" if dead else "its lock is free"
            return f"took over the stale lock of {_describe(owner)} in {self.directory} ({gone})"
        return None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still locked: nobody can have taken it in between
        except FileNotFoundError:
            pass  # the directory was removed or moved
        os.close(self._fd)
        self._fd = None
        if self._created:  # a run refused before it wrote anything leaves no empty directory behind
            with contextlib.suppress(OSError):
                self.directory.rmdir()


def _os_error(exc: OSError, path: Path, what: str) -> RunDirError:
    """One line for an OS error on the run directory or its lock; a full disk or quota in the words of every other
    writer of a run (diskfull.py)."""
    if exc.errno in NO_SPACE_ERRNOS:
        return RunDirError(f"no space left on device while writing {path} ({what})")
    return RunDirError(f"{path}: {what} ({exc.strerror or exc})")


def live_owner(directory: str | Path) -> dict | None:
    """The lock owner ({"pid", "host", "since"}) of a run that is live in `directory`, else None. Reads the lock
    file without locking it (a run starting meanwhile must not find it taken); a lock file left by a killed run of
    this host names a dead pid and counts as not live."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        owner = _read_owner(fd)
    finally:
        os.close(fd)
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    if owner.get("host") == socket.gethostname() and not _alive(pid):
        return None
    return owner


def _read_owner(fd: int) -> dict:
    try:
        owner = loads_bounded(os.pread(fd, 4096, 0) or b"{}", "lock")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
    if not owner.get("pid"):
        return "another process"
    return f"pid {owner['pid']} on host {owner.get('host', '?')}"


# ---------------------------------------------------------------- an existing run


def holds_run(directory: Path, bench: bool = False, checkpoint_dir: Path | None = None) -> str | None:
    """The first file that shows `directory` already holds a run (config.json alone does not), else None."""
    names = [n for n in RUN_FILES if n != "config.json"] + (list(BENCH_FILES) if bench else [])
    for name in names:
        if (directory / name).exists():
            return name
    if bench and directory.is_dir():
        runs = sorted(p.name for p in directory.iterdir() if _BENCH_RUN.match(p.name))
        if runs:
            return runs[0]
    if checkpoint_dir is not None and _checkpoint_entries(checkpoint_dir, bench):
        return str(checkpoint_dir)
    return None


def _checkpoint_entries(root: Path, bench: bool = False) -> list[Path]:
    """step_<N> entries (complete, .tmp, .damaged-*) in a checkpoint.dir outside the run directory; a benchmark
    keeps one run_<i>/ per run under it."""
    if not root.is_dir():
        return []
    if bench:
        return [e for p in sorted(root.iterdir()) if _BENCH_RUN.match(p.name) for e in _checkpoint_entries(p)]
    return sorted(p for p in root.iterdir() if _CHECKPOINT_ENTRY.match(p.name))


def clear_run(directory: Path, bench: bool = False, checkpoint_dir: Path | None = None) -> list[str]:
    """Remove the previous run's files (only those a run writes; anything else stays); returns their names."""
    removed = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if entry.name in RUN_FILES or (bench and (entry.name in BENCH_FILES or _BENCH_RUN.match(entry.name))):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
    for entry in _checkpoint_entries(checkpoint_dir, bench) if checkpoint_dir is not None else []:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        removed.append(str(entry))
    return removed


def move_aside(directory: Path) -> Path:
    """Move everything but the lock into a fresh sibling `<dir>.<N>` (N = 1, 2, ...); returns it."""
    n = 1
    while True:
        dest = directory.with_name(f"{directory.name}.{n}")
        try:
            dest.mkdir()  # exclusive: two runs never pick the same N
            break
        except FileExistsError:
            n += 1
    for entry in directory.iterdir():
        if entry.name != LOCK_NAME:
            entry.rename(dest / entry.name)
    return dest


def is_default_dir(directory: str | Path) -> bool:
    """Whether `directory` is one of the commands' default directories (runs/latest, runs/bench)."""
    return any(Path(directory) == Path(d) for d in DEFAULT_DIRS)


def plan_existing(
    directory: Path,
    *,
    resume: str,
    overwrite: bool,
    bench: bool = False,
    checkpoint_dir: Path | None = None,
    flag: str = "--run-dir",
) -> str:
    """What to do with `directory` before a run starts: "fresh", "resume", "overwrite" or "move".

    Raises RunDirError (one line with the flags to use) for a directory that holds another run.
    """
    if overwrite and resume not in ("", "none"):
        raise RunDirError(
            f"--overwrite and --resume {resume}: choose one (--overwrite starts the run again, --resume continues it)"
        )
    found = holds_run(directory, bench, checkpoint_dir)
    if found is None:
        return "fresh"
    if overwrite:
        return "overwrite"
    if resume not in ("", "none"):
        return "resume"
    outside = checkpoint_dir is not None and _checkpoint_entries(checkpoint_dir, bench)
    if is_default_dir(directory) and not outside:
        return "move"
    raise RunDirError(
        f"{directory} already holds a run ({found}); pass --resume auto to continue it, --overwrite "
        f"to replace it, or {flag} DIR for a new one"
    )


def apply_plan(
    directory: Path, action: str | None, *, bench: bool = False, checkpoint_dir: Path | None = None
) -> str | None:
    """Carry out plan_existing's answer (rank 0, holding the lock); returns a line to print, if any."""
    if action == "overwrite":
        removed = clear_run(directory, bench, checkpoint_dir)
        return f"--overwrite: removed the previous run's {', '.join(removed)} from {directory}" if removed else None
    if action == "move":
        return f"moved the previous run in {directory} to {move_aside(directory)}"
    return None


class RunDirClaim:
    """One command's hold on a run directory: `with RunDirClaim(...) as claim:` locks it (rank 0, the writer),
    `claim.decide()` says what to do with a run already there, `claim.apply()` does it, and leaving the block
    releases the lock (exceptions included).

    Every rank gets rank 0's answers, so a busy or occupied directory stops all ranks alike. decide() comes
    after the caller has validated its inputs, so a bad config or damaged data is reported as such first.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        writer: bool,
        resume: str,
        overwrite: bool,
        bench: bool = False,
        checkpoint_dir: Path | None = None,
        flag: str = "--run-dir",
    ):
        self.directory = Path(directory)
        self.writer, self.resume, self.overwrite, self.bench = writer, resume, overwrite, bench
        self.checkpoint_dir, self.flag = checkpoint_dir, flag
        self.lock = RunDirLock(self.directory) if writer else None
        self.action: str | None = None

    def __enter__(self) -> RunDirClaim:
        error = None
        if self.lock is not None:
            try:
                stale = self.lock.acquire()
                if stale:
                    log.warning(stale)
            except RunDirError as exc:
                error = str(exc)
        error = share(error)
        if error:
            raise RunDirError(error)
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()

    def decide(self) -> dict | None:
        """plan_existing's answer for every rank (raises RunDirError on all of them); returns the result.json of
        a run that already ended on its own when asked to resume it (auto), else None."""
        answer: dict[str, Any] = {"error": None, "action": None, "finished": None}
        if self.writer:
            try:
                answer["action"] = plan_existing(
                    self.directory,
                    resume=self.resume,
                    overwrite=self.overwrite,
                    bench=self.bench,
                    checkpoint_dir=self.checkpoint_dir,
                    flag=self.flag,
                )
                if answer["action"] == "resume" and self.resume == "auto" and not self.bench:
                    answer["finished"] = finished_result(self.directory)
            except RunDirError as exc:
                answer["error"] = str(exc)
            except OSError as exc:  # reported on every rank: one left behind would wait in a collective
                answer["error"] = f"{self.directory}: {exc.strerror or exc}"
        answer = share(answer)
        if answer["error"]:
            raise RunDirError(answer["error"])
        self.action = answer["action"]
        return answer["finished"]

    def apply(self) -> None:
        """Rank 0: clear (--overwrite) or move aside (default directory) the previous run, printing what it did."""
        error = None
        if self.writer:
            try:
                done = apply_plan(self.directory, self.action, bench=self.bench, checkpoint_dir=self.checkpoint_dir)
                if done:
                    log.info(done)
            except OSError as exc:
                error = (
                    f"{self.directory}: cannot {'clear' if self.action == 'overwrite' else 'move'} the previous "
                    f"run ({exc.strerror or exc}: {getattr(exc, 'filename', '')})"
                )
        error = share(error)
        if error:
            raise RunDirError(error)


def finished_result(directory: Path) -> dict | None:
    """result.json of a run that ended on its own (converged, or stopped by its budget or a divergence), else None.

    A crashed run (result.json with an "error") is not finished: resuming it continues from its checkpoint.
    """
    try:
        result = load_json_bounded(Path(directory) / "result.json")
    except (OSError, ValueError):
        return None
    if isinstance(result, dict) and result.get("error") is None and result.get("status") in ("success", "aborted"):
        return result
    return None


def share(value: Any) -> Any:
    """Rank 0's `value` on every rank (the value itself when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
