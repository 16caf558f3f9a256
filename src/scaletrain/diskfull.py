"""A full disk, named in one line: `no space left on device while writing <path>`.

Every file a run writes can meet a full filesystem (ENOSPC) or a used-up quota (EDQUOT): checkpoint shards and
their metadata, manifest and rename, result.json, metrics.jsonl, TensorBoard events, config.json, the run lock.
Python's writers keep the errno somewhere in the exception chain (DCP wraps per-rank failures in a
CheckpointException, torch.save to a Python stream chains the OSError under its own RuntimeError). torch's C++
writer on a path (inline_container.cc) drops it and says "unexpected pos …" or "file write failed"; for those the
free space left on the target's filesystem decides.

Torch-free: the command line imports DiskFullError without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DiskFullError", "NO_SPACE_ERRNOS", "free_bytes", "is_no_space", "disk_full", "writing"]

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# What torch's C++ stream writer says when a write came up short; it keeps no errno.
_TORCH_WRITER_FAILURES = ("unexpected pos", "file write failed", "iostream error")
FULL_BELOW = 4 << 20
"""Free bytes under which a filesystem counts as full after a write failure that kept no errno (a failed write has
used up what was left; a few MiB cover filesystems that keep some blocks back, such as btrfs's metadata)."""


class DiskFullError(RuntimeError):
    """No space (or quota) left while writing `path`; the message is one line (exit status 2 on the command line)."""

    def __init__(self, path: str | Path, detail: str = "") -> None:
        self.path = Path(path)
        self.detail = detail
        super().__init__(f"no space left on device while writing {path}" + (f" ({detail})" if detail else ""))

    def also(self, path: str | Path) -> DiskFullError:
        """This error, adding that `path` (result.json) could not be written either."""
        more = f"{path} not written either"
        return DiskFullError(self.path, f"{self.detail}; {more}" if self.detail else more)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures of a DCP CheckpointException (each once).

    A DiskFullError met in the chain ends that branch: it is an earlier failure being handled while this one
    happened (result.json on a full disk after a checkpoint), already reported on its own.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFullError) and e is not exc:
            continue
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                if isinstance(failure, tuple) and failure:  # (exception, traceback summary)
                    failure = failure[0]
                if isinstance(failure, BaseException):
                    todo.append(failure)
        todo += [e.__cause__, e.__context__]


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or its nearest existing
    parent); None when that cannot be asked."""
    p = Path(path)
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except (FileNotFoundError, NotADirectoryError):
            if p.parent == p:
                return None
            p = p.parent
        except OSError:
            return None


def is_no_space(exc: BaseException, path: str | Path) -> bool:
    """Whether `exc` is a full disk or quota while writing under `path`.

    Call it before removing what the failed write left: the free-space check for torch's errno-less writer errors
    looks at the filesystem as the failure left it.
    """
    chain = list(_chain(exc))
    if isinstance(exc, DiskFullError) or any(isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS for e in chain):
        return True
    if any(isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITER_FAILURES) for e in chain):
        free = free_bytes(path)
        return free is not None and free < FULL_BELOW
    return False


def disk_full(exc: BaseException, path: str | Path, detail: str = "") -> DiskFullError | None:
    """`exc` as a DiskFullError naming `path` (`exc` itself when it is one), or None when it is no full disk."""
    if isinstance(exc, DiskFullError):
        return exc
    return DiskFullError(path, detail) if is_no_space(exc, path) else None


@contextlib.contextmanager
def writing(path: str | Path, detail: str = "") -> Iterator[None]:
    """Inside: a full disk (ENOSPC/EDQUOT, or torch's errno-less writer error on a full filesystem) becomes one
    DiskFullError naming `path`; any other error passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        full = disk_full(exc, path, detail)
        if full is None:
            raise
        raise full from None
