"""`predict --tokens` / `plan --tokens`: a pretraining run to a token budget, printed the way a pretraining lead
reads it (days, tokens/s, MFU, the step breakdown, the batch ramp), or as JSON (the prediction's keys plus
"pretraining"). The pricing is `sim.pretrain`; this file only turns flags into it and it into text."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from scaletrain.cli.cost_args import cost_args, cost_from_args, cost_lines
from scaletrain.config_bounds import float_flag, int_flag
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.cost import RunCost, busy_share
from scaletrain.sim.efficiency import efficiency_for
from scaletrain.sim.goodput import (
    INTERRUPTIONS_PER_GPU_HOUR,
    LLAMA3_GPUS,
    LLAMA3_SNAPSHOT_DAYS,
    LLAMA3_UNEXPECTED_INTERRUPTIONS,
    RELAUNCH_S,
    Goodput,
    goodput_for,
)
from scaletrain.sim.plan import PlanResult
from scaletrain.sim.predict import Prediction, benchmark_of
from scaletrain.sim.pretrain import TOKENS_MAX, Pretraining, RampStage, layout_of, parse_ramp, price_pretraining
from scaletrain.sim.units import count_flag, format_count
from scaletrain.sim.workload import ClusterLayout, Workload

SEQ_MAX = 2**22
"""Longest --seq: 4M tokens, 32x the longest context any published pretraining run used (128K)."""


def token_flags(p) -> None:
    """The token-budget flags predict, plan and `sim goodput` share: the budget, the sequence and the batch ramp,
    the failure model's and the cost's."""
    p.add_argument(
        "--tokens",
        type=count_flag(TOKENS_MAX),
        metavar="N",
        help="price a pretraining run to N tokens (300B, 15.6T, 2.5e12) instead of an MLPerf run: days, tokens/s, "
        "MFU and the step breakdown (--json adds a 'pretraining' key; the MLPerf keys are null)",
    )
    p.add_argument(
        "--seq",
        type=int_flag(1, SEQ_MAX),
        metavar="N",
        help="with --tokens: tokens per sequence (default: the model's model.seq_len)",
    )
    p.add_argument(
        "--gbs-ramp",
        metavar="GBS@TOKENS,...",
        help="with --tokens: a global-batch ramp, each stage's batch from its token count on, e.g. "
        "3072@0,9216@200B,15360@469B (DeepSeek-V3 grew 3,072 to 15,360 over its first 469B tokens); replaces --gbs",
    )
    failure_flags(p)
    cost_args(p)


def failure_flags(p) -> None:
    """With --tokens: the failure model's flags (`sim.goodput`)."""
    p.add_argument(
        "--interruptions-per-gpu-hour",
        type=float_flag(1e-12, 1.0),
        default=None,
        metavar="X",
        help=f"job interruptions per GPU-hour, Poisson (default {INTERRUPTIONS_PER_GPU_HOUR:.3g}: Llama 3's "
        f"{LLAMA3_UNEXPECTED_INTERRUPTIONS} unexpected interruptions in {LLAMA3_SNAPSHOT_DAYS} days on "
        f"{LLAMA3_GPUS:,} H100s, arXiv:2407.21783 §3.3.4)",
    )
    p.add_argument(
        "--storage-gbps",
        type=float_flag(1e-6, 1e6),
        default=None,
        metavar="GB/S",
        help="checkpoint write/read bandwidth per node, GB/s (default: the node's storage_gbps in the catalog, "
        "0.98: Llama 3's 2 TB/s Tectonic over 2,048 nodes)",
    )
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="asynchronous checkpoints: only the device-to-host copy blocks (the node's host_copy_gbps per GPU); "
        "the write goes on in the background",
    )
    p.add_argument(
        "--checkpoint-interval-min",
        type=float_flag(1e-6, 1e7),
        default=None,
        metavar="MIN",
        help="price this checkpoint interval (minutes of training) instead of Daly's optimum",
    )
    p.add_argument(
        "--relaunch-min",
        type=float_flag(0.0, 1e5),
        default=RELAUNCH_S / 60,
        metavar="MIN",
        help=f"minutes from a failure to the job's processes running again, before the restore and the warm-up "
        f"(default {RELAUNCH_S / 60:g}, Daly 2006's R)",
    )


RUN_ONLY = (
    "interruptions_per_gpu_hour",
    "storage_gbps",
    "async_checkpoint",
    "checkpoint_interval_min",
    "price_per_gpu_hour",
    "pue",
    "grid_gco2_per_kwh",
)
"""The failure and cost flags (argparse names): a run to a token budget is what they price."""


def resolve(args) -> tuple[float | None, tuple[RampStage, ...]]:
    """(--tokens as a count or None, the --gbs-ramp stages or ()); ValueError (one line) for a bad value or a flag
    that needs --tokens."""
    tokens = float(args.tokens) if getattr(args, "tokens", None) is not None else None
    ramp = parse_ramp(args.gbs_ramp) if getattr(args, "gbs_ramp", None) else ()
    if tokens is None and (ramp or getattr(args, "seq", None)):
        raise ValueError("--seq and --gbs-ramp need --tokens (they describe a pretraining run)")
    given = [f"--{name.replace('_', '-')}" for name in RUN_ONLY if getattr(args, name, None) not in (None, False)]
    if tokens is None and getattr(args, "relaunch_min", RELAUNCH_S / 60) != RELAUNCH_S / 60:
        given.append("--relaunch-min")
    if tokens is None and given:
        verb = "needs" if len(given) == 1 else "need"
        raise ValueError(f"{', '.join(given)} {verb} --tokens: a pretraining run's failures, cost and energy")
    if ramp and args.gbs is not None:
        raise ValueError("give --gbs or --gbs-ramp, not both (the ramp's stages are the batches)")
    return tokens, ramp


def with_seq(w: Workload, args) -> Workload:
    """`w` at --seq tokens per sequence, when given."""
    return replace(w, seq_len=args.seq) if getattr(args, "seq", None) else w


def price_run(args, w: Workload, layout: ClusterLayout, cat=None) -> tuple[Prediction, Pretraining, Goodput | None]:
    """The run the flags describe: `w` (at --seq) in `layout` to --tokens over the --gbs-ramp, with its failures and
    checkpoints (`sim.goodput`, from the failure flags) and its money and energy (`sim.cost`, over the expected wall
    time at the step's busy share) filled in; the Goodput is None when the run cannot be priced."""
    tokens, ramp = resolve(args)
    assert tokens is not None, "price_run needs --tokens"
    cat = cat or load_catalog(args.catalog)
    w = with_seq(w, args)
    main, run = price_pretraining(
        w, layout, tokens, args.gpu, args.node, args.fabric, args.calibration, ramp=ramp, catalog=cat
    )
    if run.train_s is None:
        return main, run, None
    g, n, _ = cat.system(main.gpu, main.node, main.fabric)
    _, eff = efficiency_for(args.calibration, g.key, benchmark_of(w.name), cat)
    interval = getattr(args, "checkpoint_interval_min", None)
    good = goodput_for(
        w,
        layout,
        n,
        eff,
        run.train_s,
        main.step_time_s,
        storage_gbps=getattr(args, "storage_gbps", None),
        async_save=bool(getattr(args, "async_checkpoint", False)),
        interruptions_per_gpu_hour=getattr(args, "interruptions_per_gpu_hour", None),
        interval_s=None if interval is None else 60.0 * interval,
        relaunch_s=60.0 * getattr(args, "relaunch_min", RELAUNCH_S / 60),
    )
    run.goodput = good.to_dict()
    # The cluster is held for the expected wall time; its GPUs are busy the step's busy share of it.
    rc = cost_from_args(
        args, g, n, layout.gpus, good.expected_days * 24, busy_share(main.breakdown, main.step_time_s), cat
    )
    run.cost = rc.to_dict()
    return main, run, good


def predict_tokens(args, w: Workload, layout: ClusterLayout, show: Callable[[Prediction], None]) -> int:
    """`predict --tokens`: print the run (text or JSON; `show` prints the prediction at the largest batch); 0 when
    feasible, 1 when not."""
    main, run, _ = price_run(args, w, layout)
    if args.json:
        print(json.dumps({**main.to_dict(), "pretraining": run.to_dict()}, indent=2))
    else:
        show(main)
        print_pretraining(run, shown=tuple(main.reasons))
    return 0 if main.feasible and run.feasible else 1


def print_pretraining(run: Pretraining, out=None, shown: tuple = ()) -> None:
    """The run to its token budget: days, throughput, MFU, the ramp, failures and checkpoints, cost and energy;
    reasons it cannot run beyond `shown` (those the prediction above printed already)."""
    new = [r for r in run.reasons if r not in shown]
    if run.days is None:
        if new:
            print("  pretraining run: NOT FEASIBLE: " + "; ".join(new), file=out)
        return
    print(
        f"  pretraining {format_count(run.tokens)} tokens of {run.seq_len:,}: {run.steps:,.0f} steps, "
        f"{run.days:.2f} days without failures | {run.tokens_per_s / 1e6:.2f}M tokens/s "
        f"({run.tokens_per_s_per_gpu:,.0f}/GPU) | MFU {100 * run.mfu:.1f}%",
        file=out,
    )
    if len(run.stages) > 1:
        for s in run.stages:
            print(
                f"    GBS {s.gbs:>6,}: {format_count(s.tokens)} tokens, {s.steps:,.0f} steps x {s.step_time_s:.3f} s = "
                f"{s.seconds / 86400:.2f} days, MFU {100 * s.mfu:.1f}%",
                file=out,
            )
    g = run.goodput
    if g:
        print(
            f"  failures: {g['interruptions_per_gpu_hour']:.3g} interruptions per GPU-hour, MTBF {g['mtbf_h']:.2f} h"
            f" | checkpoint {g['ckpt_bytes'] / 1e12:.3g} TB, save {g['save_s']:.3g} s"
            f"{' blocking (async)' if g['async_save'] else ''}, every {g['interval_steps']:,} steps "
            f"({g['interval_s'] / 60:.1f} min) | restart {g['restart_s'] / 60:.1f} min",
            file=out,
        )
        print(
            f"  goodput {100 * g['goodput']:.1f}%: expected {g['expected_days']:.2f} days, "
            f"{g['expected_failures']:,.0f} interruptions",
            file=out,
        )
    if run.cost:
        for line in cost_lines(RunCost(**run.cost)):
            print("  " + line, file=out)
    if new:
        print("  NOT FEASIBLE: " + "; ".join(new), file=out)


RANK_BY = ("time", "cost", "energy")
"""What `plan --tokens --rank-by` orders the best layouts by: expected days, dollars, or facility MWh."""


def rank_key(run: Pretraining, by: str) -> tuple:
    """Sort key of a priced run under `by` (RANK_BY): unpriceable runs last, then the expected days (with failures),
    the cost (runs without a price after those with one) or the energy; ties by the expected days."""
    g, c = run.goodput or {}, run.cost or {}
    days = g.get("expected_days", run.days)
    if days is None:
        return (2, 0.0, 0.0)
    value = {"time": days, "cost": c.get("usd"), "energy": c.get("energy_mwh")}[by]
    return (0 if value is not None else 1, value or 0.0, days)


def plan_inputs(args, w: Workload) -> tuple[Workload, int, dict]:
    """`plan --tokens`: (the workload at --seq, the batch the search keeps: --gbs or the ramp's largest, the plan()
    options of a run that is no MLPerf run: ranked by throughput, priced without the benchmark's run); ValueError
    (one line) without a batch."""
    _, ramp = resolve(args)
    if args.gbs is None and not ramp:
        raise ValueError("plan --tokens needs --gbs or --gbs-ramp: the batch is a training choice the search keeps")
    gbs = args.gbs if args.gbs is not None else max(s.gbs for s in ramp)
    return with_seq(w, args), gbs, {"objective": "throughput", "mlperf_run": False}


def plan_tokens(
    args,
    w: Workload,
    res: PlanResult,
    show: Callable[[Prediction], None],
    run_lines: Callable,
    show_lines: Callable,
) -> int:
    """`plan --tokens`: each of the search's best layouts (`res`, from `plan_inputs`) priced as the whole run (its
    batch ramp too) and ranked by --rank-by; text or JSON (the prediction's keys plus "pretraining" and the run
    lines). 0 when something fits, 1 when nothing does."""
    cat = load_catalog(args.catalog)
    runs = []
    for p in res.best:
        main, run, _ = price_run(args, w, layout_of(p), cat)
        runs.append((main, run, run_lines(main)))
    runs.sort(key=lambda r: rank_key(r[1], args.rank_by))
    if args.json:
        print(json.dumps([{**m.to_dict(), "pretraining": r.to_dict(), **lines} for m, r, lines in runs], indent=2))
        return 0 if runs else 1
    if not print_search(res):
        return 1
    for i, (main, run, lines) in enumerate(runs, 1):
        print(f"#{i}", end=" ")
        show(main)
        print_pretraining(run, shown=tuple(main.reasons))
        show_lines(lines)
    return 0


def print_search(res: PlanResult) -> bool:
    """The search's summary line, and why nothing fits when nothing does; False then."""
    print(f"searched {res.searched:,} layouts, {res.feasible:,} feasible, in {res.seconds:.2f} s")
    if not res.best:
        reasons = res.rejected or {}
        print("nothing fits; most common reasons: " + "; ".join(f"{r} ({n})" for r, n in list(reasons.items())[:3]))
        return False
    return True


__all__ = [
    "token_flags",
    "resolve",
    "with_seq",
    "predict_tokens",
    "print_pretraining",
    "plan_inputs",
    "plan_tokens",
    "print_search",
]
