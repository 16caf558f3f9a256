"""Thin command line: parse -> resolve the one Config -> call one function per subcommand.

Every expected failure (bad config, bad data, missing file, a busy or occupied run directory, a full disk) ends as
ONE line on stderr and exit status 2. `train`/`bench` exit 0 when the run converged or used up its step budget as asked
(result.json says which), 1 when it diverged or crashed (train/run.py EXIT_CODES).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scaletrain import benchmarks, config_io
from scaletrain.config import Config, ConfigError, describe, list_presets, resolve
from scaletrain.config_bounds import DEGREE_MAX, RUNS_MAX, SEED_MAX, int_flag
from scaletrain.log import get_logger, setup_logging
from scaletrain.sim.catalog import DEFAULT_GPU, shipped_keys

log = get_logger(__name__)

DEFAULT_PRESET = "gpt3-proxy"

FIELD_FLAGS = (
    "Every config field is a flag too: --train.max_steps 5 (or --train.max_steps=5) is --set train.max_steps=5, and "
    "a boolean field alone is true (--train.compile); `scaletrain config --fields` lists the fields."
)
"""The `--section.field VALUE` shorthand (expand_field_flags), said where --help is read: the docs use it everywhere."""

EXIT_STDOUT_CLOSED = 141
"""Exit status when the reader of stdout left early (`scaletrain config | head`): 128 + SIGPIPE, what a shell reports
for any Unix tool stopped by a closed pipe, so `set -o pipefail` scripts see scaletrain as they see cat or git. Not 0:
the output was cut short, which only the reader knows was intended."""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"the preset to start from: {', '.join(list_presets())} (default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--config", metavar="FILE", help="TOML file applied over the preset, or a run directory's config.json"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set train.seed=7 (repeatable; see `scaletrain config --fields`); "
        "--train.seed 7 is the same",
    )


def _config(args) -> Config:
    from scaletrain.data.prepare import dataset_vocab

    # The vocabulary of a dataset `data prepare` made, unless the user sets one: a small corpus's is not the preset's.
    return resolve(args.preset, args.config, args.overrides, dataset_vocab=dataset_vocab)


def _apply_resume(cfg, args) -> None:
    if getattr(args, "resume", None):
        cfg.checkpoint.resume = args.resume


def cmd_export(args) -> int:
    """Export a checkpoint's weights (LoRA adapters merged) and the run's tokenizer as a Hugging Face GPT-2 or Llama
    directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).

    A run directory or checkpoints folder gives its newest complete checkpoint (after a finished run: its last step).
    DIR must be new or empty; --overwrite replaces an earlier export's files in it and keeps everything else. A run
    directory, a checkpoint, the current directory or one containing the checkpoint is never a target.
    """
    from scaletrain.train.export import export

    line = export(args.checkpoint, args.hf, overwrite=args.overwrite, tokenizer=args.tokenizer)
    if line:
        print(line)
    return 0


def cmd_train(args) -> int:
    """One training run with MLLOG, metrics and result.json in the run directory.

    Launch with torchrun for several ranks; --dry-run validates the layout for --world-size ranks instead.
    """
    cfg = _config(args)
    _apply_resume(cfg, args)
    if args.run_dir:
        cfg.train.run_dir = args.run_dir
    if args.dry_run:
        return _dry_run(cfg, args)
    from scaletrain.bench.harness import mlperf_observers
    from scaletrain.train.run import exit_code, train

    return exit_code(train(cfg, overwrite=args.overwrite, observers=mlperf_observers))


def _dry_run(cfg, args) -> int:
    import json

    from scaletrain.parallel.dry_run import check_fits, dry_run
    from scaletrain.train.distributed import launched_world_size
    from scaletrain.train.run import print_dry_run

    # None, not 0, means "not given": 0 is refused by the flag's type instead of read as the default.
    world_size = args.world_size if args.world_size is not None else launched_world_size()
    result = dry_run(cfg, world_size, args.gpu)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_dry_run(result)
    check_fits(result)
    return 0


def cmd_bench(args) -> int:
    """N MLPerf-style runs with distinct seeds, each log checked, olympic score, summary.json."""
    from scaletrain.bench.run import bench, bench_exit_code

    if args.benchmark:
        if args.benchmark not in benchmarks.names():
            raise ConfigError(f"--benchmark {args.benchmark}: must be one of {', '.join(benchmarks.names())}")
        if args.preset == DEFAULT_PRESET:  # `bench --benchmark NAME` without --preset runs that benchmark's preset
            args.preset = benchmarks.preset_for(args.benchmark)
        args.overrides = [f"bench.benchmark={args.benchmark}", *args.overrides]
    if args.runs is not None:  # last, so it wins over --set bench.runs, and is validated with the rest
        args.overrides = [*args.overrides, f"bench.runs={args.runs}"]
    cfg = _config(args)
    _apply_resume(cfg, args)
    last_seed = cfg.train.seed + 1000 * (cfg.bench.runs - 1)  # harness.derive_seeds: base + 1000*i
    if last_seed > SEED_MAX:
        raise ConfigError(
            f"train.seed={cfg.train.seed} with bench.runs={cfg.bench.runs}: the runs' seeds (seed + 1000*i) reach "
            f"{last_seed}, beyond {SEED_MAX}; lower train.seed"
        )
    name = cfg.bench.benchmark
    if benchmarks.is_proxy(name) and benchmarks.get(name).proxy_needs_base and not cfg.checkpoint.init_from:
        from scaletrain.bench.proxy_base import ensure_proxy_base
        from scaletrain.train.run import default_console

        cfg.checkpoint.init_from = ensure_proxy_base(cfg, default_console())
    return bench_exit_code(bench(cfg, Path(args.out), overwrite=args.overwrite))


def cmd_bench_check(args) -> int:
    """Run MLCommons' compliance checker on one MLLOG file with the rules of its benchmark.

    The rules file of a proxy benchmark is found inside the installed package, so this works from any directory.
    Exit 0 when the log passes, 1 when it fails, 2 for a missing log or an unknown benchmark.
    """
    from scaletrain.bench.checker import check_log, known, ruleset, run_benchmark, run_ruleset

    log = Path(args.log)
    if log.is_dir():
        log = log / "mllog.txt"  # a run directory
    if not log.is_file():
        raise ConfigError(f"bench check {args.log}: no such MLLOG file")
    try:
        # `bench --benchmark NAME check LOG` names it too: the flag belongs to the parent parser there.
        benchmark = args.check_benchmark or args.benchmark or run_benchmark(log.parent)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    known_names = known()
    if not benchmark:
        raise ConfigError(
            f"bench check {args.log}: no config.json next to the log names its benchmark; "
            f"pass --benchmark NAME ({', '.join(known_names)})"
        )
    if benchmark not in known_names:
        raise ConfigError(
            f"bench check: benchmark {benchmark!r} has no compliance rules; one of {', '.join(known_names)}"
        )
    # The checker's own log file goes next to the MLLOG, never into the current directory.
    # The run's own bench.ruleset when its config names one and is for this benchmark; else the benchmark's default.
    try:
        rules = run_ruleset(log.parent) if run_benchmark(log.parent) == benchmark else ""
        rules_name = ruleset(benchmark, rules)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check = check_log(log, benchmark, log_output=log.parent / "compliance_checker.log", rules=rules)
    if not check.ok:
        print(check.output.rstrip())
    print(f"{log}: {'pass' if check.ok else 'FAIL'} ({benchmark} rules, ruleset {rules_name})")
    return 0 if check.ok else 1


def cmd_report(args) -> int:
    """Draw loss.png (training and evaluation loss) from each run directory's metrics.jsonl, and perf.png (measured
    step time and breakdown beside prediction.json's) for the run, or overlaid for several; print the perf table."""
    from scaletrain.train.perf_report import RunPerf, perf_table, plot_perf
    from scaletrain.train.report import check_writable, draw_loss, loss_targets, read_loss

    dirs = [Path(d) for d in args.run_dir]
    # Everything is read and checked, and every output directory found writable, before the first plot is drawn:
    # a bad file or a read-only directory ends the report in one line with nothing written.
    losses = [(target, read_loss(runs)) for d in dirs for target, runs in loss_targets(d)]
    runs = sorted(p for p in dirs[0].glob("run_*") if (p / "metrics.jsonl").is_file()) if len(dirs) == 1 else []
    perf_runs = [RunPerf(d) for d in runs or dirs]
    out = Path(args.out) if args.out else (dirs[0] / "perf.png" if runs or len(dirs) == 1 else Path("perf.png"))
    for path in [target / "loss.png" for target, _ in losses] + [out]:
        check_writable(path)
    for target, data in losses:
        print(draw_loss(target, data))
    print(plot_perf(perf_runs, out))
    print(perf_table(perf_runs))
    return 0


def cmd_config(args) -> int:
    """Print the resolved config as JSON, or every field with its value in the chosen preset and its meaning."""
    cfg = _config(args)
    if args.fields:
        print(f"{'field':34s} {'value in ' + cfg.preset:>14s}  meaning")
        for name, value, doc in describe(values=cfg):
            print(f"{name:34s} {value:>14s}  {doc}")
        return 0
    print(cfg.to_json())
    return 0


def _add_bench_check_parser(bench: argparse.ArgumentParser) -> None:
    # An optional sub-command: `scaletrain bench [options]` still runs the benchmark when no `check` follows.
    sub = bench.add_subparsers(dest="bench_command", metavar="{check}", required=False)
    c = sub.add_parser(
        "check", help="run MLCommons' compliance checker on one MLLOG file", description=cmd_bench_check.__doc__
    )
    c.add_argument("log", help="an mllog.txt, or a run directory holding one")
    # A dest of its own: the parent `bench` parser has --benchmark too, and sub-parser defaults would overwrite it.
    c.add_argument(
        "--benchmark",
        dest="check_benchmark",
        metavar="NAME",
        help=f"{benchmarks.choices_text(benchmarks.names())} (default: bench.benchmark in "
        "the config.json next to the log)",
    )
    c.set_defaults(func=cmd_bench_check)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error form: one line on stderr, exit status 2 (no usage block: --help has it).

    Sub-parsers are built from the parent's class, so every subcommand gets it.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `scaletrain` argument parser (every subcommand has --help)."""
    parser = _Parser(
        prog="scaletrain",
        description="Train GPT-3/Llama-style models, benchmark them the MLPerf Training way, and predict time-to-train on GPU clusters.",
        epilog=FIELD_FLAGS,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print scaletrain's version and exit"
    )
    parser.add_argument(
        "--log-ranks",
        default="0",
        metavar="RANKS",
        help="ranks whose warnings and status lines are shown: 0 (default), a list like 0,3, or all",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_bench_parser(sub)
    _add_export_parser(sub)

    from scaletrain.cli.data import add_parser as add_data_parser

    add_data_parser(sub)
    _add_report_parser(sub)
    _add_config_parser(sub)

    from scaletrain.cli.goodput import add_parsers as add_goodput_parsers
    from scaletrain.cli.sim import add_parsers

    add_goodput_parsers(add_parsers(sub))
    return parser


def _add_train_parser(sub) -> None:
    """`scaletrain train`: one run, or its --dry-run layout and memory check."""
    p = sub.add_parser(
        "train", help="train one run to the quality target", description=cmd_train.__doc__, epilog=FIELD_FLAGS
    )
    _add_config_args(p)
    p.add_argument("--run-dir", metavar="DIR", help="where the run writes its files (default: train.run_dir)")
    p.add_argument(
        "--resume",
        metavar="auto|none|DIR",
        help="resume from: auto (the newest complete checkpoint), none, or a checkpoint directory",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="the run directory holds a previous run: delete its files first (default: refuse)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the parallel layout on a fake process group and estimate memory per GPU; no training",
    )
    p.add_argument(
        "--world-size",
        type=int_flag(1, DEGREE_MAX),
        metavar="N",
        help="number of ranks --dry-run lays out (default: $WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        metavar="GPU",
        help=f"device whose memory --dry-run checks against (default {DEFAULT_GPU}; a catalog GPU: "
        f"{', '.join(shipped_keys('gpus'))})",
    )
    p.add_argument("--json", action="store_true", help="--dry-run: print the report as JSON")
    p.set_defaults(func=cmd_train)


def _add_bench_parser(sub) -> None:
    """`scaletrain bench` and its `check` subcommand."""
    p = sub.add_parser(
        "bench",
        help="MLPerf-style benchmark: N runs, checked logs, olympic score",
        description=cmd_bench.__doc__,
        epilog=FIELD_FLAGS,
    )
    _add_config_args(p)
    p.add_argument(
        "--runs",
        type=int_flag(1, RUNS_MAX),
        metavar="N",
        help="number of runs, each with its own seed (default: bench.runs)",
    )
    p.add_argument(
        "--benchmark",
        metavar="NAME",
        help=f"{benchmarks.choices_text(benchmarks.names())}; without --preset it also picks that benchmark's preset",
    )
    p.add_argument(
        "--out", default="runs/bench", metavar="DIR", help="directory of the runs and summary.json (default runs/bench)"
    )
    p.add_argument(
        "--resume",
        metavar="auto",
        help="auto: keep the finished runs and resume the interrupted one from its checkpoint",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="--out holds a previous benchmark: delete its runs and summary first (default: refuse)",
    )
    p.set_defaults(func=cmd_bench)
    _add_bench_check_parser(p)


def _add_export_parser(sub) -> None:
    """`scaletrain export`: checkpoint weights to Hugging Face format."""
    p = sub.add_parser(
        "export",
        help="export checkpoint weights (LoRA merged) to Hugging Face GPT-2 or Llama format",
        description=cmd_export.__doc__,
    )
    p.add_argument("checkpoint", help="a checkpoint directory (step_N), a checkpoints/ folder or a run directory")
    p.add_argument("--hf", required=True, metavar="DIR", help="output directory: new or empty (written atomically)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="DIR holds an earlier export: replace its export files one by one, keep every other file",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="the SentencePiece .model or tokenizer.json to ship (default: the one the run trained with)",
    )
    p.set_defaults(func=cmd_export)


def _add_report_parser(sub) -> None:
    """`scaletrain report`: loss and performance plots of run directories."""
    p = sub.add_parser("report", help="draw loss.png and perf.png for run directories", description=cmd_report.__doc__)
    p.add_argument("run_dir", nargs="+", help="run directories (or one bench directory with run_*/)")
    p.add_argument(
        "--out",
        metavar="PNG",
        help="where perf.png goes (default: in the run directory; ./perf.png for several runs)",
    )
    p.set_defaults(func=cmd_report)


def _add_config_parser(sub) -> None:
    """`scaletrain config`: the resolved config, or every field."""
    p = sub.add_parser(
        "config", help="show the resolved config or all fields", description=cmd_config.__doc__, epilog=FIELD_FLAGS
    )
    _add_config_args(p)
    p.add_argument(
        "--fields",
        action="store_true",
        help="list every field with its value in the chosen preset (--preset, --set) and meaning",
    )
    p.set_defaults(func=cmd_config)


def version() -> str:
    """The installed scaletrain's version (its package metadata), or a word saying it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("scaletrain")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH, never installed
        return "(not installed: no package metadata)"


def subcommand_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every subcommand under `parser`, depth first: (("train",), p), (("bench",), p),
    (("bench", "check"), p), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subcommand_parsers(sub, (*path, name))


def expand_field_flags(argv: list[str]) -> list[str]:
    """`--section.field VALUE` -> `--set section.field=VALUE` for every field of the Config (config_io)."""
    return config_io.expand_field_flags(argv, Config())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `scaletrain` command (callable in-process: returns the exit code)."""
    return _main(argv)[0]


def entry() -> None:
    """The console script and `python -m scaletrain` (what torchrun starts): main(), then exit.

    After a distributed run the process leaves with os._exit once everything is written and the process groups
    are destroyed: interpreter teardown can still meet a gloo worker thread releasing its last work object, which
    needs the GIL while Python is finalizing and aborts the process ("terminate called without an active
    exception", SIGABRT) after a run that succeeded -- seen once in CI on a 2-rank TP bench. Nothing is left to
    flush by then but the standard streams and logging handlers, flushed here first.

    A reader of stdout that leaves early (`scaletrain config | head`) ends the command quietly with status 141.
    """
    try:
        code, distributed = _main(None)
        sys.stdout.flush()  # a reader that left early shows here at the latest, not in interpreter teardown
    except BrokenPipeError:
        # Whatever is still buffered can go nowhere: point stdout at /dev/null so the flush at exit cannot raise
        # again, and leave quietly (the Python docs' recipe for SIGPIPE, signal module notes).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code, distributed = EXIT_STDOUT_CLOSED, False
    if distributed:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """(exit code, whether this process was part of a process group)."""
    try:
        argv = expand_field_flags(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        log.error(str(exc))
        return 2, False
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_ranks)
    except ValueError as exc:
        log.error(str(exc))
        return 2, False
    code, clean = 1, False
    try:
        code = _run(args)
        clean = code in (0, 1)
    finally:
        # After an exception the other ranks may never reach a barrier: leave without one.
        distributed = _leave_process_group(clean)
    return code, distributed


def _leave_process_group(clean: bool) -> bool:
    """Destroy the process groups if this process joined one; True when it did."""
    if "torch" not in sys.modules:  # the simulator commands never import torch; don't pay for it at exit
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if clean:
        # Rank 0 still checks logs and writes the summary; tearing gloo down on the other ranks meanwhile
        # has aborted a process at exit ("terminate called without an active exception").
        dist.barrier()
    dist.destroy_process_group()
    return True


def _run(args) -> int:
    if args.command in ("train", "bench", "predict", "plan", "sim"):
        # Every one of these prices with $SCALETRAIN_EFFICIENCY; a train run would otherwise only note the bad
        # path inside prediction.json and go on with the shipped sets.
        from scaletrain.sim.efficiency import user_efficiencies

        try:
            user_efficiencies()
        except ValueError as exc:
            log.error(str(exc))
            return 2
    if args.command in ("predict", "plan", "sim"):
        return _run_sim(args)
    from scaletrain.checkpoint.store import CheckpointError
    from scaletrain.data.indexed import DataError
    from scaletrain.diskfull import DiskFullError
    from scaletrain.train.protocol import Preempted

    try:
        return args.func(args)
    except (ConfigError, DataError, CheckpointError, DiskFullError, FileNotFoundError) as exc:
        log.error(str(exc))
        return 2
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130
    except Preempted as exc:  # SIGTERM/SIGUSR1: saved, not finished (train/loop.py)
        print(f"scaletrain: {exc}", file=sys.stderr)
        return exc.exit_code


def _run_sim(args) -> int:
    # The simulator is pure Python: a wrong value anywhere (unknown GPU, layout, CSV, calibration) is a
    # ValueError subclass with a one-line message.
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        log.error(str(exc))
        return 2


if __name__ == "__main__":
    entry()
