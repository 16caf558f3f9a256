"""A debug mode that refuses a tensor a collective would read or write wrongly (`SCALETRAIN_CHECK_COLLECTIVES=1`).

Why: c10d's collectives (`torch.distributed.all_reduce`, `broadcast`, `all_gather_into_tensor`, `send`, ...) hand the
backend `data_ptr()` and `numel()`, and gloo reads and writes `numel` elements from there. A non-contiguous view
therefore gets the wrong elements without any error (measured on torch 2.13, 2 gloo ranks: `all_reduce` of
`t[:, 1:3]` of a 3x4 tensor doubled elements 1..6 of the storage, not the two columns), and an expanded (stride 0)
view, or a tensor whose storage was freed or shrunk (FSDP resizes unsharded storages to 0 bytes), makes gloo write
past the end of its allocation: a corrupted heap that aborts later, somewhere else ("malloc(): unaligned tcache
chunk detected"), after wrong numbers may already have been used.

While installed (`install`/`uninstall`, counted; `checking()` as a context manager), torch.distributed's
collectives and `P2POp` (what pipeline schedules send and receive through) are wrapped so that every plain tensor
argument must be contiguous and lie inside its storage; a bad one raises `CollectiveTensorError` naming the
collective, the argument, its shape and strides. The project's own collective calls go through the same
`torch.distributed` names, and so do FSDP2's all-gathers and reduce-scatters and the pipeline's point-to-point ops.

Not wrapped: torch's functional collectives (`torch.distributed._functional_collectives`, what DTensor's tensor and
sequence parallelism use) copy their inputs and allocate their outputs in C++ (checked on torch 2.13: non-contiguous
inputs of all_gather_single, reduce_scatter_single, all_to_all_single and broadcast give correct results on gloo);
`isend`/`irecv`, because `batch_isend_irecv` tells sends from receives by identity (their tensors are checked when
the `P2POp` is built); and tensor subclasses (DTensor and the like), which c10d does not accept anyway.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

ENV = "SCALETRAIN_CHECK_COLLECTIVES"

# torch.distributed's collectives that take tensors (names missing from a torch version are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
)


class CollectiveTensorError(ValueError):
    """A tensor handed to a collective is not contiguous or does not fit in its storage."""


def enabled() -> bool:
    """True when the environment asks for the check (`SCALETRAIN_CHECK_COLLECTIVES=1`)."""
    return os.environ.get(ENV, "").strip() == "1"


def check_tensor(t: object, op: str, arg: str) -> None:
    """Raise CollectiveTensorError (one line) when `t` is a plain strided tensor that `op` would mishandle.

    Anything that is not a plain tensor (None, numbers, tensor subclasses such as DTensor) passes unchecked.
    """
    if not isinstance(t, torch.Tensor) or hasattr(t, "__tensor_flatten__") or t.layout != torch.strided:
        return
    if t.device.type == "meta" or t.numel() == 0:
        return  # nothing is read or written
    where = f"collective {op}: argument {arg} (shape {list(t.shape)}, stride {tuple(t.stride())}, dtype {t.dtype})"
    if not t.is_contiguous():
        raise CollectiveTensorError(
            f"{where} is not contiguous: the backend reads and writes numel elements from data_ptr(), so it would "
            f"get the wrong elements; pass a .contiguous() copy (and copy the result back)"
        )
    need = (t.storage_offset() + t.numel()) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise CollectiveTensorError(
            f"{where} extends past its storage ({need} bytes needed from its start, the storage has {have}: freed "
            f"or resized): the backend would write outside the allocation"
        )


def check_call(op: str, fn: Callable, args: tuple, kwargs: dict) -> None:
    """Check every tensor among the arguments of `fn(*args, **kwargs)` (lists of tensors too), named for errors."""
    try:
        named = inspect.signature(fn).bind(*args, **kwargs).arguments.items()
    except (TypeError, ValueError):  # no signature or a call torch itself will refuse: name them by position
        named = [(f"#{i}", a) for i, a in enumerate(args)] + list(kwargs.items())  # type: ignore[assignment]
    for name, value in named:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check_tensor(item, op, f"{name}[{i}]")
        else:
            check_tensor(value, op, name)


def _wrap(op: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check_call(op, fn, args, kwargs)
        return fn(*args, **kwargs)

    checked._scaletrain_checked = True  # type: ignore[attr-defined]
    return checked


class _State:
    def __init__(self) -> None:
        self.users = 0
        self.saved: list[tuple[object, str, object]] = []  # (owner, attribute, original)
        self.lock = threading.Lock()


_STATE = _State()


def install() -> None:
    """Wrap torch.distributed's collectives and P2POp with the check (once per process however many users)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    with _STATE.lock:
        _STATE.users += 1
        if _STATE.users > 1:
            return
        wrapped: dict[int, Callable] = {}  # one wrapper per function: torch.distributed re-exports c10d's
        for owner in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(owner, name, None)
                if original is None or getattr(original, "_scaletrain_checked", False):
                    continue
                _STATE.saved.append((owner, name, original))
                setattr(owner, name, wrapped.setdefault(id(original), _wrap(name, original)))
        p2p = getattr(c10d, "P2POp", None)
        if p2p is not None:
            original_init = p2p.__init__
            _STATE.saved.append((p2p, "__init__", original_init))
            p2p.__init__ = _wrap("P2POp", original_init)


def uninstall() -> None:
    """Drop one user; the last one restores torch's own functions."""
    with _STATE.lock:
        if _STATE.users == 0:
            return
        _STATE.users -= 1
        if _STATE.users:
            return
        for owner, name, original in reversed(_STATE.saved):
            setattr(owner, name, original)
        _STATE.saved = []


def installed() -> bool:
    """True while the check wraps torch.distributed."""
    return _STATE.users > 0


@contextmanager
def checking(force: bool = False) -> Iterator[bool]:
    """Install the check for the block when the environment asks for it (or `force`); yields whether it is on."""
    on = force or enabled()
    if on:
        install()
    try:
        yield on
    finally:
        if on:
            uninstall()
