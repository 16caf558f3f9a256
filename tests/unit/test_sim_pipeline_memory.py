"""Pipeline memory as the schedule holds it (the op-order walk, uneven chunks, stage outputs kept or freed) and
ZeRO-2 (bytes per parameter, and a reduce-scatter after every micro-batch in the DP timing)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scaletrain.sim import schedule, step
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.memory import (
    activation_bytes_per_layer,
    bytes_per_param,
    held_activations,
    in_flight_microbatches,
    memory_per_gpu,
    stage_io_bytes,
    stage_memory,
    walk_peak,
)
from scaletrain.sim.workload import ClusterLayout, load_workload

GPT3 = load_workload("gpt3")
L405 = load_workload("llama31_405b")
CAT = load_catalog()


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_walk_equals_the_in_flight_formula_for_even_chunks(kind):
    # Every chunk holding the same bytes, the walk's peak is the schedule's count (Megatron's warm-up formula) times
    # them, on every rank, including m < p (1F1B) and warm-ups that cover every op (interleaved, m == p).
    for p in (1, 2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p, 5 * p) + ((max(1, p - 1),) if kind == "1f1b" else ()):
            for v in (1, 2, 3, 4) if kind == "interleaved_1f1b" else (1,):
                lay = ClusterLayout(gpus=p, pp=p, vp=v, gbs=m, schedule=kind)
                for r in range(p):
                    act, other = walk_peak(lay, r, [3.0] * v, [0.5] * v)
                    n = in_flight_microbatches(lay, r)
                    assert act == pytest.approx(3.0 * v * n, rel=1e-12), (p, m, v, r)
                    assert other == pytest.approx(0.5 * v * n, rel=1e-12), (p, m, v, r)


def test_even_mlperf_layout_is_unchanged_by_the_walk():
    # GPT-3's MLPerf layout (96 blocks in pp8 x vp12: 1 per chunk): the walk over the real chunk bytes gives what
    # the count formula gave, to the bit where the shortcut is taken.
    lay = ClusterLayout(gpus=512, tp=4, pp=8, vp=12, mbs=1, gbs=2048, fp8=True)
    per_layer = activation_bytes_per_layer(GPT3, lay, dropout=False)
    for r in (0, 3, 7):
        walked = walk_peak(lay, r, [per_layer] * 12, [0.0] * 12)
        assert walked[0] == pytest.approx(12 * per_layer * in_flight_microbatches(lay, r), rel=1e-12)
        assert stage_memory(GPT3, lay, r).activations == 12 * per_layer * in_flight_microbatches(lay, r)


def test_uneven_405b_chunks_by_hand():
    # 126 blocks in pp8 x vp8 (Megatron's embedding/loss accounting): rank 0 holds chunks (1, 2, ..., 2), rank 7
    # (2, ..., 2, 1), ranks 1-6 two blocks in every chunk. m = 1536 / 64 = 24.
    lay = ClusterLayout(gpus=8192, tp=8, pp=8, vp=8, cp=2, mbs=1, gbs=1536, fp8=True, bf16_grads=True)
    assert lay.chunks(L405)[0] == (1, 2, 2, 2, 2, 2, 2, 2)
    a = activation_bytes_per_layer(L405, lay, dropout=False)
    # Rank 0 peaks after its warm-up of (8-1)*2 + 7*8 = 70 chunk forwards plus one: chunks 0..7 with 8
    # micro-batches each, then 7 more of chunk 0, i.e. 15 of the 1-block chunk and 8 of each 2-block chunk:
    # 15 + 7*8*2 = 127 blocks (the count formula: 15 blocks x 71/8 = 133.125).
    assert held_activations(L405, lay, 0)[0] == pytest.approx(127 * a, rel=1e-12)
    # Rank 7: its 7*8 = 56 warm-up forwards hold chunks 0..6, 8 micro-batches each of 2 blocks (112); each of the
    # 1-block last chunk's forwards is then followed by its backward, and the peak comes with the next forward of
    # chunk 0: 9*2 + 6*8*2 = 114 (the count formula: 15 blocks x 57/8 = 106.875).
    assert held_activations(L405, lay, 7)[0] == pytest.approx(114 * a, rel=1e-12)
    # Rank 1: 16 blocks x (6*2 + 56 + 1)/8 in flight = 138: more than either end, so it is the rank reported.
    assert held_activations(L405, lay, 1)[0] == pytest.approx(138 * a, rel=1e-12)
    worst = memory_per_gpu(L405, lay)
    assert worst.activations == pytest.approx(138 * a, rel=1e-12)
    assert worst.total == max(stage_memory(L405, lay, r).total for r in range(8))
    assert worst.total > max(stage_memory(L405, lay, r).total for r in (0, 7))


def test_a_zero_block_first_chunk_holds_nothing_but_its_outputs():
    # 3 blocks as (0, 1 | 1, 1) over pp2 x vp2: rank 0's chunks are (0, 1), rank 1's (1, 1). m = 4.
    w = replace(GPT3, shape=replace(GPT3.shape, layers=3))
    lay = ClusterLayout(gpus=2, pp=2, vp=2, gbs=4, pp_first_layers=0)
    assert lay.chunks(w) == ((0, 1), (1, 1))
    a = activation_bytes_per_layer(w, lay, dropout=False)
    # Rank 0 warms up 1*2 + 1*2 = 4 forwards (chunk 0 mb 0-1, chunk 1 mb 0-1) and runs chunk 0 mb 2: chunk 1 holds 2
    # micro-batches of its 1 block, chunk 0 three of nothing. The count formula said 1 block x 5/2.
    assert held_activations(w, lay, 0) == pytest.approx((2 * a, 0.0))
    assert in_flight_microbatches(lay, 0) == 2.5
    # Kept outputs: every chunk of rank 0 sends one, so the same peak holds 5 of them.
    kept = replace(lay, free_stage_outputs=False)
    assert held_activations(w, kept, 0) == pytest.approx((2 * a, 5 * stage_io_bytes(w, kept)))


def test_stage_outputs_freed_after_send_or_kept_to_backward():
    lay = ClusterLayout(gpus=32, tp=8, pp=4, gbs=8)  # 1F1B, m = 8: rank 0 holds 4 micro-batches, rank 3 one
    io = GPT3.seq_len * GPT3.shape.hidden * 2 / 8  # bf16, the SP shard of one TP rank
    assert stage_io_bytes(GPT3, lay) == io
    freed, kept = stage_memory(GPT3, lay, 0), stage_memory(GPT3, replace(lay, free_stage_outputs=False), 0)
    assert freed.other == 0.0
    assert kept.other == pytest.approx(4 * io)
    assert kept.activations == freed.activations
    # The last stage's output is the head's input, counted there already: nothing more is kept.
    last_freed = stage_memory(GPT3, lay, 3)
    assert stage_memory(GPT3, replace(lay, free_stage_outputs=False), 3).total == last_freed.total
    # Without SP every TP rank holds the whole output.
    assert stage_io_bytes(GPT3, replace(lay, sp=False)) == 8 * io


def test_zero2_bytes_per_parameter():
    assert bytes_per_param(2, 16) == (2.0, 4.0 / 16, 12.0 / 16)
    assert bytes_per_param(2, 16, bf16_grads=True) == (2.0, 2.0 / 16, 12.0 / 16)
    one = memory_per_gpu(GPT3, ClusterLayout(gpus=64, tp=4, pp=2, gbs=64, zero=1))  # d = 8
    two = memory_per_gpu(GPT3, ClusterLayout(gpus=64, tp=4, pp=2, gbs=64, zero=2))
    layer_grads = 4 * GPT3.inventory.layer_matrix_params / 4  # one layer's unsharded fp32 gradients, TP 4
    assert two.weights == one.weights
    assert two.optimizer == one.optimizer
    assert two.activations == one.activations
    assert two.grads == pytest.approx(one.grads / 8 + layer_grads)
    assert ClusterLayout(gpus=8, gbs=8, zero=2).problems(GPT3) == []
    assert "zero=4 must be 0, 1, 2 or 3" in ClusterLayout(gpus=8, zero=4).problems(GPT3)


def _dp(lay: ClusterLayout, event: bool = True) -> tuple[float, float, float]:
    """(exposed, hidden, one micro-batch's reduce-scatter seconds over the rank's chunks) of the DP timing."""
    cl = Cluster(*CAT.system("h100", None, None), lay.gpus)
    eff = Efficiency()
    fwd, bwd, _ = step.stage_costs(GPT3, lay, cl, eff)
    p, m, v = lay.pp, lay.microbatches, lay.vp
    res = schedule.simulate(lay.pipeline_schedule, p, m, v, fwd, bwd)
    rs = sum(sum(step._dp_buckets(GPT3, lay, cl, 0, c)[0]) for c in range(v)) / max(eff.dp_overlap, 1e-3)
    e, h = step._dp_timing(
        GPT3,
        lay,
        cl,
        eff,
        [0],
        fwd,
        bwd,
        res.last_backward_end,
        res.first_forward_start,
        res.makespan,
        res.backward_end,
    )
    return e, h, rs


def test_zero2_reduce_scatters_every_microbatch():
    base = ClusterLayout(gpus=256, tp=8, pp=4, vp=2, gbs=64)  # d = 8, m = 8
    e1, h1, rs = _dp(base)
    e2, h2, rs2 = _dp(replace(base, zero=2))
    assert rs2 == rs  # one micro-batch's buckets are ZeRO-1's
    # Exposed plus hidden is all the traffic: ZeRO-2 adds m - 1 more reduce-scatters of every chunk.
    assert (e2 + h2) - (e1 + h1) == pytest.approx((base.microbatches - 1) * rs, rel=1e-9)
    assert e2 >= e1
    # One micro-batch: the same single reduce-scatter as ZeRO-1.
    single = ClusterLayout(gpus=64, tp=8, gbs=8)  # m = 1
    assert _dp(replace(single, zero=2))[:2] == pytest.approx(_dp(single)[:2], rel=1e-12)


def test_zero2_step_prices_with_and_without_the_event_simulation():
    cl = Cluster(*CAT.system("h100", None, None), 256)
    lay = ClusterLayout(gpus=256, tp=8, pp=4, vp=2, gbs=64)
    for event in (True, False):
        one = step.step_time(GPT3, lay, cl, Efficiency(), event=event)
        two = step.step_time(GPT3, replace(lay, zero=2), cl, Efficiency(), event=event)
        assert two.breakdown["compute"] == one.breakdown["compute"]
        assert two.breakdown["dp_exposed"] >= one.breakdown["dp_exposed"]
        assert two.step_time_s > one.step_time_s


def test_zero2_in_the_cli(capsys):
    import json

    from scaletrain.cli.main import main

    args = ["predict", "--model", "gpt3", "--gpu", "h100", "--gpus", "512", "--tp", "4", "--pp", "8", "--json"]
    main([*args, "--zero", "2"])
    two = json.loads(capsys.readouterr().out)
    main([*args, "--zero", "1"])
    one = json.loads(capsys.readouterr().out)
    assert two["layout"]["zero"] == 2
    assert "free_stage_outputs" not in two["layout"]  # only a layout keeping stage outputs carries the key
    assert two["memory"]["grads"] < one["memory"]["grads"]
    assert two["memory"]["weights"] == one["memory"]["weights"]


def test_the_trainer_keeps_stage_outputs():
    # torch.distributed.pipelining's PipelineStage holds each micro-batch's output in fwd_cache until its backward.
    from scaletrain.config import resolve
    from scaletrain.parallel.sim_layout import sim_inputs

    small = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=256"]
    cfg = resolve(
        "gpt3-proxy", overrides=[*small, "train.global_batch_size=8", "train.micro_batch_size=1", "parallel.pp=2"]
    )
    w, lay = sim_inputs(cfg, 4)
    assert lay.free_stage_outputs is False
    assert stage_memory(w, lay, 0).other == pytest.approx(2 * stage_io_bytes(w, lay))  # 1F1B: 2 in flight on rank 0


# ---------------------------------------------------------------------------------------------------------------
# ZB-H1 (Qi et al. 2023, arXiv:2401.10241): backward split into input gradient B and weight gradient W.


def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_passes():
    for p in (1, 2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p + 1, 5 * p):
            res = schedule.simulate("zb_h1", p, m, fwd=1.0, bwd=2.0)  # T_F = T_B = T_W = 1
            cf = schedule.bubble_closed_form("zb_h1", p, m)
            assert cf == pytest.approx(schedule.bubble_closed_form("1f1b", p, m) / 3)
            assert res.makespan == pytest.approx(3 * m * (1 + cf), rel=1e-12), (p, m)
            assert res.busy == pytest.approx([3.0 * m] * p)


@pytest.mark.parametrize("f, b, w", [(1.0, 2.0, 0.5), (1.0, 3.0, 1.0), (2.0, 2.0, 1.0), (1.0, 1.0, 0.2)])
def test_zb_h1_bubble_is_the_papers_for_other_costs(f, b, w):
    # Qi et al. §3.1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W), with T_B = b - w the input-gradient part.
    p, m = 4, 8
    res = schedule.simulate("zb_h1", p, m, fwd=f, bwd=b, wgrad=w)
    assert res.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + (b - w) - w), rel=1e-12)


def test_zb_h1_holds_what_1f1b_holds_at_its_peak():
    # Every rank holds p micro-batches from forward to W: 1F1B's first-stage peak, on every rank.
    p, m = 4, 12
    res = schedule.simulate("zb_h1", p, m)
    assert res.max_in_flight == [4.0] * p
    assert max(res.max_in_flight) == max(schedule.simulate("1f1b", p, m).max_in_flight)
    lay = ClusterLayout(gpus=p, pp=p, gbs=m, schedule="zb_h1")
    assert [walk_peak(lay, r, [1.0], [0.0])[0] for r in range(p)] == [4.0] * p
    # The gradients are final when the last W ends, on every rank at or after its last B.
    assert all(res.last_backward_end[r][0] == max(res.backward_end[r][0]) for r in range(p))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"v": 2}, "v must be 1"),
        ({"bwd": 2.0, "wgrad": 3.0}, "wgrad must not exceed bwd"),
    ],
)
def test_zb_h1_bad_inputs(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        schedule.simulate("zb_h1", 4, 8, **kwargs)
    with pytest.raises(ValueError, match="zb_h1 only"):
        schedule.simulate("1f1b", 4, 8, wgrad=1.0)
