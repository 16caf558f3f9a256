"""`predict --tokens` / `plan --tokens`: a pretraining run to a token budget, printed the way a pretraining lead
reads it (days, tokens/s, MFU, the step breakdown, the batch ramp), or as JSON (the prediction's keys plus
"pretraining"). The pricing is `sim.pretrain`; this file only turns flags into it and it into text."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from scaletrain.config_bounds import int_flag
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.predict import Prediction
from scaletrain.sim.pretrain import Pretraining, RampStage, layout_of, parse_count, parse_ramp, price_pretraining
from scaletrain.sim.workload import ClusterLayout, Workload

SEQ_MAX = 2**22
"""Longest --seq: 4M tokens, 32x the longest context any published pretraining run used (128K)."""


def token_flags(p) -> None:
    """The token-budget flags predict and plan share."""
    p.add_argument(
        "--tokens",
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


def resolve(args) -> tuple[float | None, tuple[RampStage, ...]]:
    """(--tokens as a count or None, the --gbs-ramp stages or ()); ValueError (one line) for a bad value or a flag
    that needs --tokens."""
    tokens = parse_count(args.tokens) if getattr(args, "tokens", None) is not None else None
    ramp = parse_ramp(args.gbs_ramp) if getattr(args, "gbs_ramp", None) else ()
    if tokens is None and (ramp or getattr(args, "seq", None)):
        raise ValueError("--seq and --gbs-ramp need --tokens (they describe a pretraining run)")
    if ramp and args.gbs is not None:
        raise ValueError("give --gbs or --gbs-ramp, not both (the ramp's stages are the batches)")
    return tokens, ramp


def with_seq(w: Workload, args) -> Workload:
    """`w` at --seq tokens per sequence, when given."""
    return replace(w, seq_len=args.seq) if getattr(args, "seq", None) else w


def predict_tokens(args, w: Workload, layout: ClusterLayout, show: Callable[[Prediction], None]) -> int:
    """`predict --tokens`: print the run (text or JSON; `show` prints the prediction at the largest batch); 0 when
    feasible, 1 when not."""
    tokens, ramp = resolve(args)
    assert tokens is not None
    w = with_seq(w, args)
    main, run = price_pretraining(
        w,
        layout,
        tokens,
        args.gpu,
        args.node,
        args.fabric,
        args.calibration,
        ramp=ramp,
        catalog=load_catalog(args.catalog),
    )
    if args.json:
        print(json.dumps({**main.to_dict(), "pretraining": run.to_dict()}, indent=2))
    else:
        show(main)
        print_pretraining(run)
    return 0 if main.feasible and run.feasible else 1


def print_pretraining(run: Pretraining, out=None) -> None:
    """The run to its token budget: days, throughput, MFU, the ramp, the step breakdown."""
    if run.days is None:
        print("  pretraining run: NOT FEASIBLE: " + "; ".join(run.reasons), file=out)
        return
    print(
        f"  pretraining {_count(run.tokens)} tokens of {run.seq_len:,}: {run.steps:,.0f} steps, "
        f"{run.days:.2f} days without failures | {run.tokens_per_s / 1e6:.2f}M tokens/s "
        f"({run.tokens_per_s_per_gpu:,.0f}/GPU) | MFU {100 * run.mfu:.1f}%",
        file=out,
    )
    if len(run.stages) > 1:
        for s in run.stages:
            print(
                f"    GBS {s.gbs:>6,}: {_count(s.tokens)} tokens, {s.steps:,.0f} steps x {s.step_time_s:.3f} s = "
                f"{s.seconds / 86400:.2f} days, MFU {100 * s.mfu:.1f}%",
                file=out,
            )
    if not run.feasible:
        print("  NOT FEASIBLE: " + "; ".join(run.reasons), file=out)


def _count(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if x >= div:
            return f"{x / div:.4g}{suffix}"
    return f"{x:,.0f}"


__all__ = ["token_flags", "resolve", "with_seq", "predict_tokens", "print_pretraining", "plan_tokens"]


def plan_tokens(
    args, w: Workload, show: Callable[[Prediction], None], run_lines: Callable, show_lines: Callable
) -> int:
    """`plan --tokens`: the layout search at the run's largest batch by throughput, then each of the best priced as
    the whole run (its batch ramp too) and ranked by the run's days; text or JSON (the prediction's keys plus
    "pretraining" and the run lines). 0 when something fits, 1 when nothing does."""
    from scaletrain.sim.plan import plan

    tokens, ramp = resolve(args)
    assert tokens is not None
    if args.gbs is None and not ramp:
        raise ValueError("plan --tokens needs --gbs or --gbs-ramp: the batch is a training choice the search keeps")
    w = with_seq(w, args)
    cat = load_catalog(args.catalog)
    res = plan(
        w,
        args.gpu,
        args.gpus,
        args.node,
        args.fabric,
        args.calibration,
        top=args.top,
        gbs=args.gbs if args.gbs is not None else max(s.gbs for s in ramp),
        catalog=cat,
        fp4=args.fp4,
        as_trained=args.as_trained,
        moe_imbalance=args.moe_imbalance,
        fp8_attention=args.fp8_attention,
        fp4_healing_step=args.fp4_healing_step,
        objective="throughput",
        mlperf_run=False,
    )
    runs = []
    for p in res.best:
        main, run = price_pretraining(
            w, layout_of(p), tokens, p.gpu, p.node, p.fabric, args.calibration, ramp=ramp, catalog=cat
        )
        runs.append((main, run, run_lines(main)))
    runs.sort(key=lambda r: (r[1].train_s is None, r[1].train_s or 0.0))
    if args.json:
        print(json.dumps([{**m.to_dict(), "pretraining": r.to_dict(), **lines} for m, r, lines in runs], indent=2))
        return 0 if runs else 1
    print(f"searched {res.searched:,} layouts, {res.feasible:,} feasible, in {res.seconds:.2f} s")
    if not runs:
        reasons = res.rejected or {}
        print("nothing fits; most common reasons: " + "; ".join(f"{r} ({n})" for r, n in list(reasons.items())[:3]))
        return 1
    for i, (main, run, lines) in enumerate(runs, 1):
        print(f"#{i}", end=" ")
        show(main)
        print_pretraining(run)
        show_lines(lines)
    return 0
