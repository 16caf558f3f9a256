"""Pipeline schedule simulation: closed-form bubbles, hand-timed small cases, memory in flight, and bad inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scaletrain.sim import schedule as sched
from scaletrain.sim.schedule import bubble_closed_form, simulate

GRID = [(p, k * p, v) for p in (1, 2, 3, 4, 8) for k in (1, 2, 3, 5) for v in (1, 2, 3, 4)]
COSTS = [(1.0, 2.0), (1.0, 1.0), (0.3, 1.7), (2.0, 1.0)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_uniform_makespan_is_closed_form_exactly(schedule):
    for p, m, v in GRID:
        if schedule != "interleaved_1f1b" and v > 1:
            continue
        for f, b in COSTS:
            res = simulate(schedule, p, m, v, f, b)
            ideal = m * v * (f + b)
            cf = bubble_closed_form(schedule, p, m, v)
            assert res.makespan == pytest.approx(ideal * (1 + cf), rel=1e-12), (p, m, v, f, b)
            assert res.busy == pytest.approx([ideal] * p)
            assert res.bubble_fraction == pytest.approx(cf / (1 + cf), abs=1e-12)


def test_closed_form_values_and_m_not_multiple_of_p():
    assert bubble_closed_form("gpipe", 4, 8) == 3 / 8
    assert bubble_closed_form("1f1b", 4, 8) == 3 / 8
    assert bubble_closed_form("interleaved_1f1b", 4, 8, 3) == 3 / 24
    # gpipe/1f1b do not need m % p == 0
    for schedule in ("gpipe", "1f1b"):
        assert simulate(schedule, 4, 7, fwd=1, bwd=2).makespan == pytest.approx(21 * (1 + 3 / 7))


def test_uneven_logits_stage_by_hand():
    # gpipe p=2 m=2, f=1 b=2. Uniform: rank 0 F 0-1,1-2; rank 1 F 1-2,2-3 B 3-5,5-7; rank 0 B 5-7,7-9.
    assert simulate("gpipe", 2, 2, fwd=1, bwd=2).makespan == 9
    # Last rank f=2 b=3: rank 1 F 1-3,3-5 B 5-8,8-11; rank 0 B 8-10, 11-13.
    res = simulate("gpipe", 2, 2, fwd=[[1], [2]], bwd=[[2], [3]])
    assert res.makespan == 13
    assert res.busy == [6, 10]
    assert res.first_forward_start == [[0], [1]]
    assert res.last_backward_end == [[13], [11]]
    assert res.bubble_fraction == pytest.approx((13 - 8) / 13)


def test_p2p_latency_by_hand():
    # gpipe p=2 m=2 f=1 b=2 p2p=.5: rank 1 F 1.5-2.5,2.5-3.5 B 3.5-5.5,5.5-7.5; rank 0 B 6-8, 8-10.
    assert simulate("gpipe", 2, 2, fwd=1, bwd=2, p2p=0.5).makespan == pytest.approx(10)
    # 1f1b p=2 m=4 p2p=.1: rank 1 waits for every forward, rank 0 for every gradient; 15 -> 15.4 by hand.
    assert simulate("1f1b", 2, 4, fwd=1, bwd=2, p2p=0.1).makespan == pytest.approx(15.4)
    # One rank: stages never cross ranks, so latency is free.
    assert simulate("interleaved_1f1b", 1, 3, 2, 1, 2, p2p=5).makespan == 18


def test_plain_1f1b_pays_latency_per_microbatch_interleaved_does_not():
    def extra(schedule, m, v=1, f=1.0, b=2.0, h=0.1):
        return simulate(schedule, 4, m, v, f, b, h).makespan - simulate(schedule, 4, m, v, f, b).makespan

    assert extra("1f1b", 16) > extra("1f1b", 8) > extra("1f1b", 4)
    assert extra("gpipe", 16) == pytest.approx(2 * 3 * 0.1)
    # Megatron's extra warmup hides a round trip while p2p <= min(fwd, bwd): cost is one pass over all boundaries.
    for p, m, v in GRID:
        if p == 1:
            continue
        for f, b in COSTS:
            for h in (0.05, min(f, b)):
                got = simulate("interleaved_1f1b", p, m, v, f, b, h).makespan
                assert got == pytest.approx(m * v * (f + b) * (1 + (p - 1) / (v * m)) + 2 * (p * v - 1) * h)
    assert extra("interleaved_1f1b", 8, 2, h=1.5) > 2 * 7 * 1.5


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 16), (8, 32)])
def test_in_flight_1f1b_is_p_gpipe_is_m(p, m):
    assert simulate("1f1b", p, m).max_in_flight == [float(p - r) for r in range(p)]
    assert simulate("gpipe", p, m).max_in_flight == [float(m)] * p


@pytest.mark.parametrize("p,m,v", [(8, 128, 12), (4, 8, 2), (4, 16, 3), (2, 8, 4)])
def test_interleaved_in_flight_matches_megatron(p, m, v):
    # Megatron holds warmup + 1 chunk activations on rank 0 (warmup forwards, then the steady state's forward).
    res = simulate("interleaved_1f1b", p, m, v)
    assert res.max_in_flight[0] == ((p - 1) * 2 + (v - 1) * p + 1) / v
    assert res.max_in_flight[-1] == ((v - 1) * p + 1) / v


def test_interleaved_in_flight_capped_when_warmup_covers_everything():
    assert simulate("interleaved_1f1b", 4, 4, 2).max_in_flight[0] == 4.0


def test_interleaved_op_order_is_megatrons():
    f, b = False, True
    assert sched._op_order("interleaved_1f1b", 2, 4, 2, 0) == [
        (f, 0, 0),
        (f, 0, 1),
        (f, 1, 0),
        (f, 1, 1),
        (f, 0, 2),
        (b, 1, 0),
        (f, 0, 3),
        (b, 1, 1),
        (f, 1, 2),
        (b, 0, 0),
        (f, 1, 3),
        (b, 0, 1),
        (b, 1, 2),
        (b, 1, 3),
        (b, 0, 2),
        (b, 0, 3),
    ]
    assert sched._op_order("1f1b", 3, 4, 1, 0)[:5] == [(f, 0, 0), (f, 0, 1), (f, 0, 2), (b, 0, 0), (f, 0, 3)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_dp_overlap_times_are_sane(schedule):
    v = 3 if schedule == "interleaved_1f1b" else 1
    res = simulate(schedule, 4, 8, v, fwd=[[1.0 + r / 10] * v for r in range(4)], bwd=2.0, p2p=0.05)
    assert res.first_forward_start[0][0] == 0
    for r in range(4):
        for c in range(v):
            assert 0 <= res.first_forward_start[r][c] < res.last_backward_end[r][c] <= res.makespan
    assert max(max(row) for row in res.last_backward_end) == res.makespan
    if v > 1:  # later chunks start later; the earliest layers' gradients finish last
        assert res.first_forward_start[0] == sorted(res.first_forward_start[0])
        assert res.last_backward_end[0] == sorted(res.last_backward_end[0], reverse=True)


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        (("zb", 2, 4), {}, "unknown pipeline schedule 'zb'"),
        (("1f1b", 0, 4), {}, "p must be a positive integer"),
        (("1f1b", 2, 0), {}, "m must be a positive integer"),
        (("1f1b", 2.0, 4), {}, "p must be a positive integer"),
        (("interleaved_1f1b", 2, 4, 0), {}, "v must be a positive integer"),
        (("1f1b", 4, 2), {}, "need m >= p"),
        (("gpipe", 2, 4, 2), {}, "v must be 1"),
        (("interleaved_1f1b", 4, 6, 2), {}, "m divisible by p"),
        (("1f1b", 2, 4), {"fwd": [[1.0]]}, "fwd must have shape p x v = 2 x 1"),
        (("1f1b", 2, 4), {"bwd": [[1.0], [-1.0]]}, "bwd durations must be finite and >= 0"),
        (("1f1b", 2, 4), {"fwd": "fast"}, "fwd must be"),
        (("1f1b", 2, 4), {"p2p": -1}, "p2p must be a finite number >= 0"),
    ],
)
def test_bad_inputs_name_the_problem(args, kwargs, needle):
    with pytest.raises(ValueError) as err:
        simulate(*args, **kwargs)
    assert needle in str(err.value)
    if not kwargs:
        with pytest.raises(ValueError):
            bubble_closed_form(*args)


def test_deadlocked_order_is_reported(monkeypatch):
    real = sched._op_order

    def broken(schedule, p, m, v, rank):  # rank 0 wants a backward before its forward
        order = real(schedule, p, m, v, rank)
        return order[::-1] if rank == 0 else order

    monkeypatch.setattr(sched, "_op_order", broken)
    with pytest.raises(RuntimeError) as err:
        simulate("1f1b", 2, 2)
    assert "deadlocks: rank 0 is stuck at op 0 (backward of micro-batch 1, chunk 0)" in str(err.value)
    assert "waiting for the forward of stage 0, micro-batch 1" in str(err.value)


def test_large_schedules_run_and_stdlib_only():
    # Sizes of real layouts (~0.1 s each idle); their speed is not asserted: a shared CI machine is no stopwatch.
    simulate("interleaved_1f1b", 8, 128, 12)
    simulate("1f1b", 16, 2048)
    code = "import sys, scaletrain.sim.schedule; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
