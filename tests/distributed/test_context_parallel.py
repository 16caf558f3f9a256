"""Context parallelism: zigzag sharding, all-gather attention and a CP GPT against single-process references.

Each launch runs every check for its world size in one set of processes (spawning ranks dominates the cost);
workers return {check name: (max abs diff or None for a yes/no check, passed)} and the tests assert on that.
"""

from __future__ import annotations

import pytest
import torch
from launch import run_ranks

from scaletrain.parallel.context_parallel import (
    AllGatherCausalAttention,
    apply_context_parallel,
    cp_positions,
    shard_sequence,
)

TOL = 1e-5  # |cp - reference| <= TOL + TOL * |reference|, elementwise


# ---------------------------------------------------------------- zigzag sharding (no processes)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_positions_cover_every_position_once(cp):
    seq_len = 2 * cp * 3
    held = torch.cat([cp_positions(seq_len, cp, r) for r in range(cp)])
    assert held.dtype == torch.long
    assert sorted(held.tolist()) == list(range(seq_len))
    assert all(len(cp_positions(seq_len, cp, r)) == seq_len // cp for r in range(cp))


def test_cp_positions_chunk_order():
    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(8, 4, 1).tolist() == [1, 6]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seq_len,cp,rank", [(30, 4, 0), (6, 2, 0), (12, 2, 2), (12, 2, -1)])
def test_cp_positions_rejects_bad_arguments(seq_len, cp, rank):
    with pytest.raises(ValueError):
        cp_positions(seq_len, cp, rank)


def test_shard_sequence_selects_positions_along_dim():
    t = torch.arange(16).repeat(3, 1)  # [3, 16], value = position
    for r in range(2):
        assert torch.equal(shard_sequence(t, 2, r), cp_positions(16, 2, r).repeat(3, 1))
        assert torch.equal(shard_sequence(t.T, 2, r, dim=0), cp_positions(16, 2, r).repeat(3, 1).T)
    assert shard_sequence(t, 1, 0) is t


# ---------------------------------------------------------------- workers (run on every rank)
def _close(name, got, want, out):
    diff = (got - want).abs()
    out[name] = (diff.max().item(), bool((diff <= TOL + TOL * want.abs()).all()))


def _unshard(t, cp_mesh, dim):
    """Gather every CP rank's shard of t and put it back in global order (fails if a position is missing)."""
    import torch.distributed as dist

    cp, group = cp_mesh.size(), cp_mesh.get_group()
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    shape = list(t.shape)
    shape[dim] *= cp
    full = torch.full(shape, float("nan"))
    for r, part in enumerate(parts):
        full.index_copy_(dim, cp_positions(shape[dim], cp, r), part)
    return full


def _attention_check(cp_mesh, seed, out, tag):
    from scaletrain.model.common import causal_attention

    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    g = torch.Generator().manual_seed(seed)
    seq = 2 * cp * 5
    q, k, v, dy = (torch.randn(2, 3, seq, 8, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    y_ref = causal_attention(*ref)
    y_ref.backward(dy)
    local = [shard_sequence(t, cp, rank, dim=2).requires_grad_(True) for t in (q, k, v)]
    y = AllGatherCausalAttention(cp_mesh.get_group(), seq, cp, rank)(*local)
    y.backward(shard_sequence(dy, cp, rank, dim=2))
    _close(f"{tag}.out", _unshard(y.detach(), cp_mesh, 2), y_ref.detach(), out)
    for name, t, r in zip("qkv", local, ref):
        _close(f"{tag}.grad_{name}", _unshard(t.grad, cp_mesh, 2), r.grad, out)


def _gloo_contract_check(cp_mesh, out):
    """Every collective the CP attention issues (forward all-gather, backward reduce-scatter) gets a contiguous,
    dense input that nothing modifies until the collective is waited on, and none is left in flight.

    Gloo reads and writes the buffers on its own thread until wait(); breaking this corrupts data or the heap.
    The functional-collective ops are wrapped where torch's Python layer looks them up, on this rank only.
    """
    ops = torch.ops._c10d_functional
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    orig = {n: getattr(ops, n) for n in (*names, "wait_tensor")}
    inflight, problems, issued = {}, [], []

    def issue(name):
        def call(inp, *args, **kwargs):
            if not inp.is_contiguous():  # contiguous: dense and non-overlapping
                problems.append(f"{name}: input with strides {inp.stride()} is not contiguous")
            res = orig[name](inp, *args, **kwargs)
            inflight[res.untyped_storage().data_ptr()] = (name, inp, inp._version)
            issued.append(name)
            return res

        return call

    def wait(t):
        rec = inflight.pop(t.untyped_storage().data_ptr(), None)
        if rec is not None and rec[1]._version != rec[2]:
            problems.append(f"{rec[0]}: input modified while the collective was in flight")
        return orig["wait_tensor"](t)

    for n in names:
        setattr(ops, n, issue(n))
    ops.wait_tensor = wait
    try:
        cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        q, k, v = (torch.randn(2, 4, 8, 8, requires_grad=True) for _ in range(3))
        AllGatherCausalAttention(cp_mesh.get_group(), 8 * cp, cp, rank)(q, k, v).square().sum().backward()
    finally:
        for n, f in orig.items():
            setattr(ops, n, f)
    problems += [f"{name}: never waited" for name, *_ in inflight.values()]
    out["gloo_contract"] = (None, {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(issued) and not problems)
    if problems:  # a worker exception reaches the test with this rank's traceback and the list
        raise AssertionError("CP collectives broke gloo's buffer contract: " + "; ".join(problems))


def _tiny_cfg():
    from scaletrain.config import resolve

    return resolve(
        "gpt3-proxy",
        overrides=[
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=4",
            "model.seq_len=32",
            "model.vocab_size=300",
        ],
    ).model


def _model_check(cp_mesh, seed, out, tag):
    import torch.distributed as dist

    from scaletrain.model.gpt import GPT
    from scaletrain.model.loss import IGNORE_INDEX, loss_sum

    cp, rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()
    cfg = _tiny_cfg()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    labels[0, ::3] = IGNORE_INDEX
    labels[1, -5:] = IGNORE_INDEX

    ref = GPT(cfg, seed=0)
    ref_loss = loss_sum(ref(tokens), labels)
    ref_loss.backward()

    model = GPT(cfg, seed=0)
    apply_context_parallel(model, cp_mesh)
    loss = loss_sum(model(shard_sequence(tokens, cp, rank)), shard_sequence(labels, cp, rank))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    _close(f"{tag}.loss", total, ref_loss.detach(), out)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        _close(f"{tag}.grad.{name}", p.grad, ref_grads[name].grad, out)

    # Explicit positions win over the hook's: all-zero positions must change the logits.
    with torch.no_grad():
        local = shard_sequence(tokens, cp, rank)
        same = torch.equal(model(local), model(local, torch.zeros(local.shape[1], dtype=torch.long)))
    out[f"{tag}.explicit_positions_used"] = (None, not same)


def _structure_check(mesh_2x1, cp_mesh, out):
    """cp == 1 leaves the model alone; a pipeline stage without embedding gets cores but no hook."""
    from scaletrain.model.common import causal_attention
    from scaletrain.model.gpt import GPT

    model = GPT(_tiny_cfg(), seed=0)
    apply_context_parallel(model, mesh_2x1["cp"])
    untouched = all(b.attn.core is causal_attention for b in model.blocks.values()) and not model._forward_pre_hooks
    out["noop_cp1"] = (None, untouched)
    stage = GPT(_tiny_cfg(), seed=0)
    stage.embed = None
    apply_context_parallel(stage, cp_mesh)
    swapped = all(isinstance(b.attn.core, AllGatherCausalAttention) for b in stage.blocks.values())
    out["stage_cores_no_hook"] = (None, swapped and not stage._forward_pre_hooks)


def _two_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    out = {}
    _attention_check(cp_mesh, 0, out, "attn_cp2")
    _model_check(cp_mesh, 1, out, "model_cp2")
    _structure_check(init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp")), cp_mesh, out)
    _gloo_contract_check(cp_mesh, out)
    return out


def _four_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    _attention_check(init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)), 0, out, "attn_cp4")
    # CP groups {0,1} and {2,3}: group ranks differ from global ranks; each dp replica has its own data.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh["dp"].get_local_rank()
    _attention_check(mesh["cp"], 10 + dp_rank, out, "attn_dp2_cp2")
    _model_check(mesh["cp"], 20 + dp_rank, out, "model_dp2_cp2")
    return out


# ---------------------------------------------------------------- tests on ranks
def _assert_all_ok(results, prefix=""):
    bad = [
        f"rank {r}: {name} " + ("check failed" if diff is None else f"max|diff|={diff:.3g}")
        for r, res in enumerate(results)
        for name, (diff, ok) in sorted(res.items())
        if name.startswith(prefix) and not ok
    ]
    checked = [name for name in results[0] if name.startswith(prefix)]
    assert checked, f"no checks named {prefix}*"
    assert not bad, "context parallel differs from the single-process reference:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_two_ranks, 2, timeout=120)


def test_attention_matches_full_sequence_on_2_ranks(two_rank_results):
    _assert_all_ok(two_rank_results, "attn_cp2.")


def test_gpt_loss_and_grads_match_full_sequence_on_2_ranks(two_rank_results):
    _assert_all_ok(two_rank_results, "model_cp2.")
    assert len([n for n in two_rank_results[0] if n.startswith("model_cp2.grad.")]) > 10


def test_cp1_is_noop_and_pipeline_stage_gets_no_hook(two_rank_results):
    _assert_all_ok(two_rank_results, "noop_cp1")
    _assert_all_ok(two_rank_results, "stage_cores_no_hook")


def test_cp_collectives_keep_gloo_buffers_contiguous_and_untouched_until_waited(two_rank_results):
    _assert_all_ok(two_rank_results, "gloo_contract")


def test_attention_and_gpt_on_4_ranks_with_cp_subgroups():
    _assert_all_ok(run_ranks(_four_ranks, 4, timeout=120))
