"""Pipeline-parallel schedules as a discrete-event simulation: makespan, bubble, and the timing DP overlap needs.

Model. The network is cut into p*v virtual stages placed Megatron's way (stage k = chunk*p + rank), so a
micro-batch's forward visits rank 0..p-1 v times and its backward returns the same way. Each pipeline rank runs
its own fixed op order (the schedule) one op at a time; an op starts when its rank is free and its inputs have
arrived: F(k, mb) needs F(k-1, mb), B(k, mb) needs B(k+1, mb) and its own F(k, mb). Moving a tensor between stages
on different ranks costs `p2p` seconds of latency but no rank time, i.e. sends are asynchronous and buffered, which
is what Megatron's overlapped p2p achieves. Costs per (rank, chunk) may differ, so the embedding on the first stage
and the logits/loss on the last are priced where they live.

Since every op order is fixed, the times follow from one pass that settles each op once its rank's previous op and
its producers are settled; ranks blocked on a producer are woken by it, so the pass is linear in the op count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
W = 2
"""Op kind of a weight-gradient pass (zb_h1 only); forwards are False (0) and backwards True (1) in `op_order`."""
MAX_FORWARD_OPS = 2**20
"""Most forward ops (micro-batches x p x v) one simulation takes: time and memory grow with them (~5 s and 300 MB
at this many), and MLPerf's largest layouts need under 2**20 (GBS 8192 over 98 virtual stages, d = 1)."""


@dataclass
class ScheduleResult:
    """One training step's pipeline timing; times in the unit of `fwd`/`bwd`, measured from the first op's start."""

    makespan: float
    busy: list[float]
    """Per rank: sum of its op durations."""
    bubble_fraction: float
    """(makespan - mean(busy)) / makespan: share of the step an average rank idles."""
    last_backward_end: list[list[float]]
    """[rank][chunk]: when that chunk's gradients are final, so its DP reduce-scatter can start."""
    first_forward_start: list[list[float]]
    """[rank][chunk]: when that chunk's parameters are first needed, so its DP all-gather must be done."""
    max_in_flight: list[float]
    """[rank]: peak count of (micro-batch, chunk) forwards awaiting their backward, divided by v."""
    backward_end: list[list[list[float]]] = field(default_factory=list)
    """[rank][chunk][micro-batch]: when that micro-batch's backward of the chunk ends (ZeRO-2 reduce-scatters each
    micro-batch's gradients from there)."""


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if m * p * v > MAX_FORWARD_OPS:
        raise ValueError(
            f"{m} micro-batches x p={p} x v={v} = {m * p * v} forward ops per step: more than the pipeline "
            f"simulation's {MAX_FORWARD_OPS}; use a smaller global batch or a larger micro-batch"
        )
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"schedule {schedule!r} has one chunk per rank: v must be 1, got v={v}")
    if p > 1 and m < p:
        raise ValueError(f"m={m} micro-batches cannot fill p={p} pipeline stages: need m >= p")
    if schedule == "interleaved_1f1b" and m % p:
        raise ValueError(f"interleaved_1f1b needs m divisible by p (Megatron's constraint): m={m}, p={p}")


def _costs(name: str, x, p: int, v: int) -> list[list[float]]:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        grid = [[float(x)] * v for _ in range(p)]
    else:
        try:
            grid = [[float(c) for c in row] for row in x]
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number or a p x v list of lists, got {x!r}") from None
        if len(grid) != p or any(len(row) != v for row in grid):
            raise ValueError(f"{name} must have shape p x v = {p} x {v}, got {[len(r) for r in grid]}")
    if any(not c >= 0.0 or c == float("inf") for row in grid for c in row):
        raise ValueError(f"{name} durations must be finite and >= 0, got {x!r}")
    return grid


def op_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    """Pipeline rank `rank`'s ops as (kind, chunk, micro-batch), in the order it issues them: what the event
    simulation runs and what the memory model walks to find the activations a rank holds at its peak. Kind: False a
    forward, True a backward (under zb_h1 the input-gradient part only), `W` (2) zb_h1's deferred weight gradient,
    the op after which a micro-batch's activations are all freed. Checks only the schedule name (the memory model
    also walks m < p, which `simulate` refuses)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    return _op_order(schedule, p, m, v, rank)


def _op_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    """Rank's ops as (kind, chunk, micro-batch), in the order it issues them (see `op_order`)."""
    if schedule == "gpipe":
        return [(False, 0, i) for i in range(m)] + [(True, 0, i) for i in range(m)]
    if schedule == "zb_h1":
        return _zb_h1_order(p, m, rank)
    total = m * v
    if schedule == "1f1b":
        warm = min(p - rank - 1, m)

        def fwd(i):
            return (False, 0, i)

        def bwd(i):
            return (True, 0, i)
    else:
        # Two warmup ops per downstream rank, not one as in plain 1F1B: the extra op is slack that hides a p2p
        # round trip. Simulated, interleaved pays a fixed 2*(p*v-1)*p2p while p2p <= min(fwd, bwd), whereas plain
        # 1F1B has no slack and pays latency in every steady-state cycle, i.e. growing with m.
        warm = min((p - rank - 1) * 2 + (v - 1) * p, total)

        def mb(i):
            return (i // (p * v)) * p + i % p

        def fwd(i):
            return (False, (i // p) % v, mb(i))

        def bwd(i):
            return (True, v - 1 - (i // p) % v, mb(i))

    order = [fwd(i) for i in range(warm)]
    for i in range(total - warm):
        order += (fwd(warm + i), bwd(i))
    order += [bwd(i) for i in range(total - warm, total)]
    return order


def _zb_h1_order(p: int, m: int, rank: int) -> list[tuple]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, §3.1) on one chunk per rank, in
    the order torch.distributed.pipelining's zero-bubble schedules issue it (`_get_1f1b_rank_ops` with
    `enable_zero_bubble`, one local stage): 1F1B's warm-up of p - rank - 1 forwards, then forward, input-gradient
    backward B, and from the rank-th steady step on the oldest pending weight gradient W; the W the rank deferred
    fill its cool-down. A micro-batch is held from its forward to its W: at most p on every rank, 1F1B's peak."""
    warm = min(p - rank - 1, m)
    order: list[tuple] = [(False, 0, i) for i in range(warm)]
    done_w = 0
    for k in range(m):
        if k < m - warm:
            order.append((False, 0, warm + k))
        order.append((True, 0, k))
        if k >= rank:
            order.append((W, 0, done_w))
            done_w += 1
    order += [(W, 0, i) for i in range(done_w, m)]
    return order


def simulate(
    schedule: str, p: int, m: int, v: int = 1, fwd=None, bwd=None, p2p: float = 0.0, wgrad=None
) -> ScheduleResult:
    """Time one step of `schedule` over p ranks, m micro-batches and v chunks per rank.

    fwd/bwd: per-micro-batch duration of one chunk, a number or [rank][chunk] lists (defaults 1.0 and 2.0, the
    usual backward = 2x forward). wgrad (zb_h1 only): the weight-gradient part of bwd, run as its own deferred op
    (default bwd / 2: a linear layer's backward is two GEMMs of its forward's size, the input gradient and the weight
    gradient, so T_F = T_B = T_W as the ZB paper takes them). p2p: latency between stages on different ranks. Raises
    ValueError on a bad configuration and RuntimeError if the op orders deadlock.
    """
    _check(schedule, p, m, v)
    fc = _costs("fwd", 1.0 if fwd is None else fwd, p, v)
    bc = _costs("bwd", 2.0 if bwd is None else bwd, p, v)
    wc = [[0.0] * v for _ in range(p)]
    if schedule == "zb_h1":
        wc = [[b / 2 for b in row] for row in bc] if wgrad is None else _costs("wgrad", wgrad, p, v)
        if any(wc[r][c] > bc[r][c] for r in range(p) for c in range(v)):
            raise ValueError(f"wgrad must not exceed bwd (it is part of the backward), got {wgrad!r}")
    elif wgrad is not None:
        raise ValueError(f"wgrad splits the backward of zb_h1 only, not of {schedule!r}")
    # The input-gradient part every schedule's backward op runs (all of it but under zb_h1).
    ic = [[bc[r][c] - wc[r][c] for c in range(v)] for r in range(p)]
    if isinstance(p2p, bool) or not isinstance(p2p, (int, float)) or not 0.0 <= p2p < float("inf"):
        raise ValueError(f"p2p must be a finite number >= 0, got {p2p!r}")
    hop = float(p2p) if p > 1 else 0.0  # with p == 1 every stage shares the one rank
    nstage = p * v
    last = nstage - 1
    orders = [_op_order(schedule, p, m, v, r) for r in range(p)]
    # End times, flat-indexed by stage*m + micro-batch; None until settled.
    f_end: list = [None] * (nstage * m)
    b_end: list = [None] * (nstage * m)
    waiters: dict[tuple[bool, int], list[int]] = {}  # unsettled producer -> ranks blocked on it
    pos = [0] * p
    free = [0.0] * p
    first_f: list[list[float | None]] = [[None] * v for _ in range(p)]
    last_b = [[0.0] * v for _ in range(p)]
    b_ends: list[list[list[float]]] = [[[0.0] * m for _ in range(v)] for _ in range(p)]
    stack = list(range(p))
    while stack:
        r = stack.pop()
        order, t = orders[r], free[r]
        i = pos[r]
        while i < len(order):
            is_b, c, j = order[i]
            k = c * p + r
            idx = k * m + j
            if is_b == W:  # after this rank's own B of the same micro-batch, which its order ran before
                t += wc[r][c]
                last_b[r][c] = t
                b_ends[r][c][j] = t
            elif is_b:
                own = f_end[idx]
                if own is None:
                    waiters.setdefault((False, idx), []).append(r)
                    break
                if k == last:
                    ready = own
                else:
                    up = b_end[idx + m]
                    if up is None:
                        waiters.setdefault((True, idx + m), []).append(r)
                        break
                    ready = max(own, up + hop)
                start = t if t >= ready else ready
                t = start + ic[r][c]
                b_end[idx] = t
                last_b[r][c] = t
                b_ends[r][c][j] = t
            else:
                if k == 0:
                    ready = 0.0
                else:
                    down = f_end[idx - m]
                    if down is None:
                        waiters.setdefault((False, idx - m), []).append(r)
                        break
                    ready = down + hop
                start = t if t >= ready else ready
                t = start + fc[r][c]
                f_end[idx] = t
                if first_f[r][c] is None:
                    first_f[r][c] = start
            if is_b != W:
                stack += waiters.pop((bool(is_b), idx), ())
            i += 1
        pos[r], free[r] = i, t
    for r in range(p):
        if pos[r] < len(orders[r]):
            is_b, c, j = orders[r][pos[r]]
            need = [
                f"{'backward' if w else 'forward'} of stage {i // m}, micro-batch {i % m}"
                for (w, i), rs in waiters.items()
                if r in rs
            ]
            raise RuntimeError(
                f"{schedule} op order deadlocks: rank {r} is stuck at op {pos[r]} "
                f"({'backward' if is_b else 'forward'} of micro-batch {j}, chunk {c}) "
                f"waiting for the {', '.join(need)}, which never runs"
            )
    makespan = max(free)
    busy = [m * sum(fc[r]) + m * sum(bc[r]) for r in range(p)]
    in_flight = []
    frees = W if schedule == "zb_h1" else True  # the op after which a micro-batch holds nothing
    for order in orders:
        live = peak = 0
        for is_b, _, _ in order:
            live += -1 if is_b == frees else 0 if is_b else 1
            peak = max(peak, live)
        in_flight.append(peak / v)
    mean_busy = sum(busy) / p
    return ScheduleResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=(makespan - mean_busy) / makespan if makespan > 0 else 0.0,
        last_backward_end=last_b,
        # Past the deadlock check every forward has run, so no None is left.
        first_forward_start=cast(list[list[float]], first_f),
        max_in_flight=in_flight,
        backward_end=b_ends,
    )


def bubble_closed_form(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Narayanan et al.'s bubble time over ideal compute time: (p-1)/m, or (p-1)/(v*m) interleaved; ZB-H1's
    (p-1)(T_F + T_B - T_W) over m(T_F + T_B + T_W) (Qi et al. 2023, §3.1) at their T_F = T_B = T_W: (p-1)/(3m),
    a third of 1F1B's.

    Relative to ideal time m*v*(f+b), not to makespan. With uniform costs and p2p=0, `simulate` gives
    makespan = ideal * (1 + this) exactly for all four schedules, Megatron's interleaved order included (its extra
    warmup never delays anything when transfers are free), so bubble_fraction = this / (1 + this).
    """
    _check(schedule, p, m, v)
    if schedule == "zb_h1":
        return (p - 1) / (3 * m)
    return (p - 1) / (v * m if schedule == "interleaved_1f1b" else m)
