"""`scaletrain sim goodput` and `sim plot --goodput`: a token budget priced with failures, checkpoints and restarts.

The step is `predict`'s (the same flags); `sim/goodput.py` turns it into the checkpoint interval, the goodput and the
expected days, and samples the spread with a Monte-Carlo. Registered by `cli/main.py` into the `sim` subcommands that
`cli/sim.py` builds; the job and layout flags are predict's (`cli/job_args.py`). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math

from scaletrain.cli.job_args import job_flags, layout_flags, layout_from_args, split_flags
from scaletrain.cli.pretrain_report import price_run, with_seq
from scaletrain.config_bounds import SEED_MAX, int_flag
from scaletrain.sim.catalog import DEFAULT_GPU
from scaletrain.sim.goodput import (
    INTERRUPTIONS_PER_GPU_HOUR,
    LLAMA3_GPUS,
    LLAMA3_SNAPSHOT_DAYS,
    LLAMA3_UNEXPECTED_INTERRUPTIONS,
    Goodput,
    monte_carlo,
    plan_goodput,
)
from scaletrain.sim.predict import Prediction
from scaletrain.sim.pretrain import Pretraining
from scaletrain.sim.units import format_count
from scaletrain.sim.workload import ClusterLayout, Workload, load_workload

RUNS_MAX = 100_000
"""Largest --runs: each run samples every failure of a weeks-long job; 100,000 of them take about a minute."""
TOKENS_MAX = 1e16
"""Largest --tokens: 600x Llama 3's 15.6T, past any published pre-training budget."""


def price(args) -> tuple[Workload, ClusterLayout, Prediction, Goodput, Pretraining]:
    """The workload, layout, predicted step and goodput of the run the flags describe (ValueError: one line): the
    run `predict --tokens` prices (`pretrain_report.price_run`: --seq and --gbs-ramp included)."""
    if args.tokens is None:
        raise ValueError(f"sim {args.sim_command} needs --tokens N (e.g. 15.6T)")
    w, layout = load_workload(args.model, tuple(args.set)), layout_from_args(args)
    p, run, g = price_run(args, w, layout)
    if g is None:
        raise ValueError(f"{args.model} cannot run in this layout: {'; '.join(run.reasons or p.reasons)}")
    return with_seq(w, args), layout, p, g, run


def cmd_goodput(args) -> int:
    """Days to train --tokens with failures: the step from `predict`, interruptions at a per-GPU-hour rate, the
    checkpoint's save and restore times, restarts, the optimal (Young/Daly) checkpoint interval, the expected
    goodput and days, and a Monte-Carlo's p50/p90 days."""
    w, layout, p, g, run = price(args)
    mc = monte_carlo(g, args.runs, args.seed)
    steps = run.steps
    if args.json:
        doc = {
            "model": w.name,
            "tokens": args.tokens,
            "steps": steps,
            "train_s": g.ideal_days * 86400,
            "prediction": p.to_dict(),
            "goodput": g.to_dict(),
            "monte_carlo": mc,
        }
        print(json.dumps(doc, indent=2))
    else:
        print_goodput(w, layout, p, g, mc, args.tokens, int(steps))
    return 0 if p.feasible else 1


def print_goodput(w: Workload, layout: ClusterLayout, p: Prediction, g: Goodput, mc: dict, tokens: int, steps: int):
    """The closed form with its parts, then the Monte-Carlo spread."""
    print(f"{w.name} on {p.gpus:,} x {p.gpu} ({p.node}, {p.fabric}), {layout.describe()}, calibration {p.calibration}")
    if not p.feasible:
        print("  NOT FEASIBLE: " + "; ".join(p.reasons))
    print(
        f"  {format_count(tokens)} tokens = {steps:,} steps x {p.step_time_s:.3f} s = {g.ideal_days:.2f} days of steady "
        f"training (MFU {100 * p.mfu:.1f}%)"
    )
    default = math.isclose(g.interruptions_per_gpu_hour, INTERRUPTIONS_PER_GPU_HOUR)
    origin = (
        f" (Llama 3: {LLAMA3_UNEXPECTED_INTERRUPTIONS} unexpected in {LLAMA3_SNAPSHOT_DAYS} days on {LLAMA3_GPUS:,} "
        "GPUs)"
        if default
        else ""
    )
    print(
        f"  interruptions {g.interruptions_per_gpu_hour:.3g} per GPU-hour{origin}: MTBF M = {g.mtbf_h:.2f} h "
        f"for {g.gpus:,} GPUs"
    )
    per_node = g.ckpt_bytes / g.nodes
    save = (
        f"save {g.save_s:.3g} s blocking (device-to-host copy; the write takes {g.write_s:.3g} s in the background)"
        if g.async_save
        else f"save {g.save_s:.3g} s"
    )
    print(
        f"  checkpoint {g.ckpt_bytes / 1e12:.3g} TB, {per_node / 1e9:.3g} GB per node over {g.nodes:,} nodes at "
        f"{g.storage_gbps:.3g} GB/s: {save}, restore {g.restore_s:.3g} s"
    )
    print(
        f"  restart R = relaunch {g.relaunch_s:.0f} s + restore {g.restore_s:.3g} s + warm-up {g.warmup_s:.3g} s "
        f"= {g.restart_s:.0f} s"
    )
    chosen = "Daly's optimum" if g.interval_chosen == "daly" else "as asked"
    print(
        f"  interval {g.interval_steps:,} steps = {g.interval_s / 60:.2f} min ({chosen}; Young sqrt(2 delta M) = "
        f"{g.interval_young_s / 60:.2f} min, Daly {g.interval_daly_s / 60:.2f} min)"
    )
    bg = " + W" if g.async_save else ""
    print(
        f"  overhead, first order: save delta/tau {100 * g.save_fraction:.2f}% + rework (tau/2{bg})/M "
        f"{100 * g.rework_fraction:.2f}% + restart R/M {100 * g.restart_fraction:.2f}%"
    )
    print(
        f"  goodput {100 * g.goodput:.1f}% (first order {100 * g.goodput_first_order:.1f}%): expected "
        f"{g.expected_days:.2f} days, {g.expected_failures:,.0f} interruptions"
    )
    print(
        f"  Monte-Carlo, {mc['runs']:,} runs (seed {mc['seed']}): p50 {mc['p50_days']:.2f} days, p90 "
        f"{mc['p90_days']:.2f} days, mean {mc['mean_days']:.2f} days, goodput {100 * mc['mean_goodput']:.1f}%"
    )


# ---------------------------------------------------------------- sim plot --goodput


def plot_goodput(args, out: str) -> str:
    """PNG of goodput against the checkpoint interval (closed form, Monte-Carlo points) and against the cluster size
    (the same per-GPU work: the ideal days held, failures and each node's share of the checkpoint scaled), the
    chosen point marked on both; returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, layout, p, g, _ = price(args)
    train_s = g.ideal_days * 86400
    gpn = max(1, math.ceil(layout.gpus / g.nodes))

    def again(gpus: int = g.gpus, nodes: int = g.nodes, interval_s: float | None = g.interval_s) -> Goodput:
        """The same run priced at another interval (None: the optimum) or cluster size."""
        return plan_goodput(
            train_s,
            g.step_time_s,
            gpus,
            nodes,
            g.ckpt_bytes,
            g.storage_gbps,
            g.async_save,
            g.interruptions_per_gpu_hour,
            interval_s,
            host_copy_gbps=g.host_copy_gbps,
            relaunch_s=g.relaunch_s,
            warmup_s=g.warmup_s,
        )

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    factors = [2 ** (k / 4) for k in range(-14, 15)]
    xs = [g.interval_s * f for f in factors]
    curve = [again(interval_s=x) for x in xs]
    left.plot([c.interval_s / 60 for c in curve], [100 * c.goodput for c in curve], label="closed form (Daly)")
    left.plot(
        [c.interval_s / 60 for c in curve],
        [100 * c.goodput_first_order for c in curve],
        ls="--",
        lw=1,
        label="first order",
    )
    picks = [curve[i] for i in range(0, len(curve), 4)]
    sims = [monte_carlo(c, args.runs, args.seed) for c in picks]
    left.plot(
        [c.interval_s / 60 for c in picks],
        [100 * s["mean_goodput"] for s in sims],
        "o",
        ms=4,
        label=f"Monte-Carlo ({args.runs} runs)",
    )
    left.plot([g.interval_s / 60], [100 * g.goodput], "r*", ms=14, label=f"chosen: {g.interval_s / 60:.1f} min")
    left.set_xscale("log")
    left.set_xlabel("checkpoint interval (minutes of training)")
    left.set_ylabel("goodput (%)")
    left.set_title(f"{layout.gpus:,} GPUs, MTBF {g.mtbf_h:.2f} h, save {g.save_s:.3g} s")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    sizes = sorted({max(1, round(layout.gpus * 2 ** (k / 2))) for k in range(-10, 5)})
    scaled = [again(gpus=n, nodes=max(1, math.ceil(n / gpn)), interval_s=None) for n in sizes]
    right.plot(sizes, [100 * c.goodput for c in scaled], "-o", ms=3, label="at Daly's optimum interval")
    right.plot([layout.gpus], [100 * g.goodput], "r*", ms=14, label=f"chosen: {layout.gpus:,} GPUs")
    right.set_xscale("log", base=2)
    right.set_xlabel("GPUs (same per-GPU work)")
    right.set_ylabel("goodput (%)")
    right.set_title(f"{g.interruptions_per_gpu_hour:.3g} interruptions per GPU-hour")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{w.name}, {p.gpu}, {layout.describe()}: goodput under failures", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- parsers


class _Extra:
    """An argparse parser seen through `add_argument` only, adding the flags it does not have yet (and none of
    `skip`), none of them required: the goodput flags on `sim plot`, whose own --model, --gpu and --calibration
    stay as they are."""

    def __init__(self, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()):
        self.parser, self.skip = parser, skip

    def add_argument(self, *names, **kw):
        if any(n in self.skip or n in self.parser._option_string_actions for n in names):
            return None
        kw.pop("required", None)
        return self.parser.add_argument(*names, **kw)


def _goodput_flags(p, runs_default: int) -> None:
    """The Monte-Carlo's flags (the failure model's own come with predict's --tokens flags:
    `pretrain_report.token_flags`)."""
    p.add_argument(
        "--runs",
        type=int_flag(1, RUNS_MAX),
        default=runs_default,
        metavar="N",
        help=f"sampled runs of the Monte-Carlo that gives the p50/p90 days (default {runs_default})",
    )
    p.add_argument(
        "--seed",
        type=int_flag(0, SEED_MAX),
        default=0,
        metavar="N",
        help="the Monte-Carlo's random seed (default 0)",
    )


def cmd_plot(args) -> int:
    """`sim plot`: the goodput PNG with --goodput, else the scaling plot `cli/sim.py` draws."""
    if not args.goodput:
        return args.scaling_func(args)
    if args.tokens is None:
        raise ValueError("sim plot --goodput needs --tokens N (e.g. 15.6T)")
    if args.gpus is None:
        raise ValueError("sim plot --goodput needs --gpus N")
    gpus = args.gpu_list or []
    if len(gpus) > 1:
        raise ValueError(f"sim plot --goodput draws one GPU; got --gpu {' --gpu '.join(gpus)}")
    args.gpu = gpus[0] if gpus else args.gpu_default
    args.set, args.catalog = args.set or [], args.catalog or []
    out = "sim_goodput.png" if args.out == args.out_default else args.out
    print(f"wrote {plot_goodput(args, out)}")
    return 0


def add_parsers(ssub) -> None:
    """Attach `sim goodput` and `sim plot --goodput` to the `sim` subparsers (`cli/sim.add_parsers`' return)."""
    g = ssub.add_parser(
        "goodput", help="days to N tokens with failures, checkpoints and restarts", description=cmd_goodput.__doc__
    )
    job_flags(g)
    layout_flags(g)
    split_flags(g)
    _goodput_flags(g, runs_default=1000)
    g.set_defaults(func=cmd_goodput)

    plot = ssub.choices["plot"]
    scaling = plot.get_default("func")
    plot.add_argument(
        "--goodput",
        action="store_true",
        help="instead: goodput against the checkpoint interval and against the cluster size for one run (the "
        "`sim goodput` flags; --out defaults to sim_goodput.png)",
    )
    extra = _Extra(plot, skip=("--json",))
    job_flags(extra)
    layout_flags(extra)
    split_flags(extra)
    _goodput_flags(extra, runs_default=200)
    plot.set_defaults(
        func=cmd_plot,
        scaling_func=scaling,
        gpu_default=DEFAULT_GPU,
        out_default=plot.get_default("out"),
    )
