"""The collective check (SCALETRAIN_CHECK_COLLECTIVES=1): a tensor gloo would read or write through `data_ptr()` for
`numel` elements (non-contiguous, expanded, freed storage) is refused with one line before it reaches the backend;
contiguous tensors pass and reduce as before; uninstalling gives torch its own functions back."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from scaletrain.parallel import collective_check
from scaletrain.parallel.collective_check import CollectiveTensorError, check_tensor, checking


def _freed() -> torch.Tensor:
    t = torch.ones(8)
    t.untyped_storage().resize_(0)  # what FSDP does to an unsharded parameter between uses
    return t


def _shrunk_view() -> torch.Tensor:
    base = torch.ones(16)
    view = base[8:]
    base.untyped_storage().resize_(10 * base.element_size())
    return view


BAD = {
    "transposed": (lambda: torch.ones(3, 4).t(), "not contiguous"),
    "column_slice": (lambda: torch.ones(3, 4)[:, 1:3], "not contiguous"),
    "strided_rows": (lambda: torch.ones(8)[::2], "not contiguous"),
    "expanded_stride_0": (lambda: torch.ones(1).expand(64), "not contiguous"),
    "expanded_rows": (lambda: torch.ones(4, 1).expand(4, 16), "not contiguous"),
    "permuted_3d": (lambda: torch.ones(2, 3, 4).permute(2, 0, 1), "not contiguous"),
    "channels_last": (lambda: torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last), "not contiguous"),
    "diagonal": (lambda: torch.ones(5, 5).diagonal(), "not contiguous"),
    "freed_storage": (_freed, "extends past its storage"),
    "shrunk_storage_view": (_shrunk_view, "extends past its storage"),
    "int64_transposed": (lambda: torch.ones(4, 2, dtype=torch.int64).t(), "not contiguous"),
    "bf16_column": (lambda: torch.ones(4, 4, dtype=torch.bfloat16)[:, 0], "not contiguous"),
}


@pytest.mark.hostile
@pytest.mark.parametrize("name", list(BAD))
def test_check_tensor_refuses_what_gloo_would_mishandle(name):
    make, why = BAD[name]
    with pytest.raises(CollectiveTensorError) as info:
        check_tensor(make(), "all_reduce", "tensor")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("collective all_reduce: argument tensor (shape ") and why in msg


GOOD = {
    "contiguous": lambda: torch.ones(3, 4),
    "row_slice": lambda: torch.ones(6, 4)[2:4],  # a contiguous view at an offset: data_ptr is right
    "scalar": lambda: torch.tensor(3.0),
    "empty_transposed": lambda: torch.ones(0, 4).t(),  # nothing to read or write
    "size_one_dims": lambda: torch.ones(1, 5, 1),
    "parameter": lambda: torch.nn.Parameter(torch.ones(4)),
    "meta": lambda: torch.empty(4, 4, device="meta").t(),
    "not_a_tensor": lambda: [1, 2],
}


@pytest.mark.parametrize("name", list(GOOD))
def test_check_tensor_passes_what_gloo_handles(name):
    check_tensor(GOOD[name](), "all_reduce", "tensor")


@pytest.fixture(scope="module")
def gloo_group():
    """A one-rank gloo group in this process (torch's own store; destroyed after the module)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _calls():
    out2 = torch.zeros(4, 2).t()  # [2, 4], not contiguous
    return {
        "all_reduce": (lambda t: dist.all_reduce(t), "all_reduce: argument tensor"),
        "broadcast": (lambda t: dist.broadcast(t, src=0), "broadcast: argument tensor"),
        "reduce": (lambda t: dist.reduce(t, dst=0), "reduce: argument tensor"),
        "all_gather_into_tensor_input": (
            lambda t: dist.all_gather_into_tensor(torch.zeros(t.shape), t),
            "argument input_tensor",
        ),
        "all_gather_into_tensor_output": (
            lambda t: dist.all_gather_into_tensor(out2, torch.zeros(4)),
            "argument output_tensor",
        ),
        "all_gather_list": (lambda t: dist.all_gather([t], torch.zeros(t.shape)), "argument tensor_list[0]"),
        "reduce_scatter_tensor": (lambda t: dist.reduce_scatter_tensor(torch.zeros(t.shape), t), "argument input"),
        "keyword_argument": (lambda t: dist.all_reduce(tensor=t), "all_reduce: argument tensor"),
        "p2p_op": (lambda t: dist.P2POp(dist.isend, t, 0), "P2POp: argument tensor"),
    }


@pytest.mark.hostile
@pytest.mark.parametrize("call", list(_calls()))
def test_a_collective_refuses_a_bad_tensor_and_leaves_it_alone(call, gloo_group):
    run, names = _calls()[call]
    base = torch.arange(12.0).reshape(3, 4)
    t = base[:, 1:3]  # on 2 gloo ranks all_reduce of this doubles elements 1..6 of the storage, not the columns
    before = base.clone()
    with checking(force=True), pytest.raises(CollectiveTensorError, match=re.escape(names)) as info:
        run(t)
    assert "\n" not in str(info.value)
    assert torch.equal(base, before)


def test_contiguous_tensors_reduce_as_before(gloo_group):
    t = torch.arange(6.0)
    view = torch.arange(12.0)[6:]  # a contiguous view at an offset
    out = torch.zeros(6)
    with checking(force=True) as on:
        assert on and collective_check.installed()
        dist.all_reduce(t)
        dist.all_reduce(view)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, t)
        dist.broadcast(t, src=0)
    assert torch.equal(t, torch.arange(6.0)) and torch.equal(view, torch.arange(6.0, 12.0))
    assert torch.equal(out, t)


def test_uninstall_restores_torch_and_nests():
    originals = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "all_gather_into_tensor")}
    init = c10d.P2POp.__init__
    with checking(force=True):
        with checking(force=True):
            assert dist.all_reduce is not originals["all_reduce"]
            assert c10d.all_reduce is dist.all_reduce  # torch's internal calls are checked too
        assert collective_check.installed()  # the outer user still holds it
    assert not collective_check.installed()
    assert {n: getattr(dist, n) for n in originals} == originals and c10d.P2POp.__init__ is init


def test_the_environment_turns_it_on(monkeypatch):
    monkeypatch.delenv(collective_check.ENV, raising=False)
    with checking() as on:
        assert not on and not collective_check.installed()
    monkeypatch.setenv(collective_check.ENV, "1")
    with checking() as on:
        assert on and collective_check.installed()
    assert not collective_check.installed()


@pytest.mark.parametrize("value, hooked", [("0", False), ("1", True), ("", True)])
def test_comm_timing_switch(monkeypatch, value, hooked):
    """SCALETRAIN_COMM_TIMING=0 leaves torch's Work.wait and wait_tensor as they are (to rule the hooks out)."""
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import Work

    from scaletrain.train.perf import TIMING_ENV, CommWaits

    monkeypatch.setenv(TIMING_ENV, value)
    wait, wait_tensor = Work.wait, funcol.wait_tensor
    waits = CommWaits()
    waits.install()
    try:
        assert (Work.wait is not wait) == hooked and (funcol.wait_tensor is not wait_tensor) == hooked
    finally:
        waits.uninstall()
    assert Work.wait is wait and funcol.wait_tensor is wait_tensor
