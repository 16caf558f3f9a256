"""The MLPerf side of a run: an Observer of the training loop (train/loop.py) that writes the timed protocol to
MLLOG, `run_once` (one timed run), and the N-run benchmark with its checks and score (`run_benchmark`).

Event protocol (ruleset 4.1.0 for gpt3, the newest for llama2_70b_lora; docs/benchmarks.md sections 1-3):
    cache_clear, init_start, submission_* and hparams, [engine.init: untimed], init_stop, run_start,
    { block_start, train steps up to the next evaluation, block_stop, eval_start, eval_accuracy, eval_stop }*,
    run_stop(status), and for gpt3 train_samples.
gpt3: an evaluation every ceil(eval_interval/GBS) steps; `epoch_num`/`first_epoch_num`/`epoch_count` are training
TOKENS since the start checkpoint (steps * GBS * seq_len), which the RCP checker reads as "epochs to converge".
llama2_70b_lora: the same cadence, but the first floor(0.125*GBS + 2) evaluations are neither run nor logged (the
first block is that much longer; train/schedule.py); every event carries `samples_count` = training samples since
run_start (steps * GBS), which the RCP checker reads as "samples to converge"; train_samples/eval_samples are the
dataset sizes, logged at init. llama31_405b / llama31_8b / gpt_oss_20b / deepseekv3_671b: gpt3's cadence (but
deepseekv3_671b's skipped first evaluations at ruleset 6.1.0) with lora's `samples_count` metadata; eval_samples
(validation sequences) at init, train_samples (samples trained) at the end, the keys bench/rules.py lists. Time to train = run_stop - run_start: the loop's own clock, which stamps both events.

A stop signal (the loop saves and raises Preempted) logs nothing: no block_stop or run_stop, and result.json says
"preempted". Each checkpoint records the log's length (`mllog_bytes`); a resume truncates the log there (just after
the saved step), continues the same run_start, trains the rest of an open block without a second block_start, and
from there logs exactly what the uninterrupted run would have (bench/mllog.py restore_mllog).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.config import Config
from scaletrain.train.loop import LoopState, run_loop
from scaletrain.train.protocol import PREEMPTED, Engine, Observer
from scaletrain.train.rundir import dumps_strict, finished_result
from scaletrain.train.schedule import tokens_per_step

from .checker import RULESET, check_log, check_rcp, ruleset
from .closed import official_rule_violations
from .mllog import MLLOG, C, MLLogWriter, restore_mllog
from .rules import counts_samples, is_lora, mllog_hparams
from .score import olympic_score, required_runs
from .summary import print_summary

__all__ = ["MLPerfObserver", "mlperf_observers", "run_once", "run_benchmark", "derive_seeds", "default_platform"]


def default_platform(cfg: Config, dp_size: int = 1) -> str:
    """submission_platform when bench.platform is empty: '<dp_size>x<device>', e.g. '1xCPU' or '8xNVIDIA-H100'."""
    name = "CPU"
    if cfg.train.device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                name = torch.cuda.get_device_name(0).replace(" ", "-")
        except Exception:  # no torch/CUDA driver trouble must not stop a benchmark from logging its platform
            pass
    return f"{dp_size}x{name}"


def _positive(engine: Any, attr: str) -> int | None:
    value = getattr(engine, attr, None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0:
        return int(value)
    return None


def _dataset_sizes(cfg: Config, engine: Any) -> dict | None:
    """What the init phase logs from the engine: gpt3 eval_samples = engine.eval_tokens; llama2_70b_lora
    eval_samples/train_samples = engine.eval_samples/train_samples; llama31 eval_samples = engine.eval_samples.
    None while any of them is still unknown."""
    if is_lora(cfg):
        sizes = {"eval_samples": _positive(engine, "eval_samples"), "train_samples": _positive(engine, "train_samples")}
    elif counts_samples(cfg):
        sizes = {"eval_samples": _positive(engine, "eval_samples")}
    else:
        sizes = {"eval_samples": _positive(engine, "eval_tokens")}
    return None if None in sizes.values() else sizes


class MLPerfObserver(Observer):
    """Writes run_dir/mllog.txt for one timed run and adds `rule_violations` and `mllog` to its result.

    Events are logged on their own lines in this file, on purpose: mllog stamps each with this file and line number.
    `writer=False` (every rank but 0) keeps the clock and the checks but writes nothing.
    """

    name = "mlperf"

    def __init__(
        self, cfg: Config, run_dir: str | Path, dp_size: int = 1, platform: str | None = None, writer: bool = True
    ) -> None:
        self.cfg, self.run_dir, self.dp_size, self.writer = cfg, Path(run_dir), dp_size, writer
        self.platform = platform or cfg.bench.platform or default_platform(cfg, dp_size)
        self.lora = is_lora(cfg)
        self.samples = counts_samples(cfg)  # samples_count metadata (lora, llama31), else gpt3's token epoch_num
        self.tps, self.gbs = tokens_per_step(cfg), cfg.train.global_batch_size
        self.log = MLLogWriter(None)  # replaced by the run's log in on_init_start
        self._sizes_logged = False
        self._running = False  # run_start is in the log: the run must end with run_stop

    def on_init_start(self, state: LoopState, engine: Engine) -> None:
        """Open the log (a resume continues the checkpoint's), then cache_clear, init_start and what is known."""
        path = self.run_dir / MLLOG if self.writer else None
        if state.resume is not None and path is not None:
            # Back to where the checkpoint was taken: events after it (the crashed part of the run) are dropped, and
            # the log continues the same run_start; the restart's time stays inside time to train. Resumed into
            # another run directory, the log is copied from the checkpoint's run.
            size = (state.observers.get(self.name) or {}).get("mllog_bytes")
            t_start = state.t_start or 0
            restore_mllog(path, state.resume.path, state.resume.info, size, t_start, state.step)
        self.log = MLLogWriter(path, mode="a" if state.resume is not None else "w")
        if state.resume is not None:
            self._running = True  # the restored log holds this run's run_start: even a crash in init ends it
            return
        try:
            early = _dataset_sizes(self.cfg, engine)
            # Validates before anything is logged (placeholder sizes when the engine learns them in init()).
            placeholder = {"eval_samples": 1, "train_samples": 1} if self.lora else {"eval_samples": 1}
            hparams = mllog_hparams(self.cfg, platform=self.platform, dp_size=self.dp_size, **(early or placeholder))
            self.log.event(C.CACHE_CLEAR, True)
            self.log.start(C.INIT_START)
            if early is not None:
                for key, value in hparams[1:]:
                    self.log.event(key, value)
                self._sizes_logged = True
        except BaseException:
            self.log.close()
            raise

    def on_run_start(self, state: LoopState, engine: Engine) -> None:
        """init_stop and run_start at the loop's start time (the dataset sizes first, when init() found them)."""
        if state.resume is not None:
            return
        if not self._sizes_logged:
            sizes = _dataset_sizes(self.cfg, engine)
            if sizes is None:
                attrs = (
                    ("eval_samples", "train_samples")
                    if self.lora
                    else ("eval_samples",)
                    if self.samples
                    else ("eval_tokens",)
                )
                have = {a: getattr(engine, a, None) for a in attrs}
                raise ValueError(
                    f"engine {have} after init(): must be positive "
                    + ("sequence counts" if self.samples else "the validation label-token count")
                )
            for key, value in mllog_hparams(self.cfg, platform=self.platform, dp_size=self.dp_size, **sizes)[1:]:
                self.log.event(key, value, time_ms=state.t_start)
        self.log.end(C.INIT_STOP, time_ms=state.t_start)
        self.log.start(C.RUN_START, time_ms=state.t_start)
        self._running = True

    def on_block_start(self, state: LoopState, first: int, stop: int) -> None:
        self.log.start(C.BLOCK_START, metadata=self._block_meta(first, stop, stop=False))

    def on_block_end(self, state: LoopState, first: int, stop: int) -> None:
        # gpt3 repeats block_start's metadata; samples_count is the samples trained (fewer when a NaN cut the block).
        self.log.end(C.BLOCK_STOP, metadata=self._block_meta(first, state.step if self.samples else stop, stop=True))

    def on_eval_start(self, state: LoopState) -> None:
        self.log.start(C.EVAL_START, metadata=self._point_meta(state.step))

    def on_eval(self, state: LoopState, record: dict) -> None:
        meta = self._point_meta(state.step)
        self.log.event(C.EVAL_ACCURACY, record["eval_loss"], metadata=meta, time_ms=state.t_eval)
        self.log.end(C.EVAL_STOP, metadata=meta, time_ms=state.t_eval)

    def on_checkpoint(self, state: LoopState) -> dict:
        """The log's length at the save: a resume cuts the log back to it."""
        self.log.flush()
        return {"mllog_bytes": self.log.size()}

    def on_run_end(self, state: LoopState, result: dict) -> dict:
        """run_stop (and gpt3's train_samples) unless the run was preempted or never started; closes the log."""
        try:
            if self._running and state.outcome != PREEMPTED:
                crashed = state.outcome == "crashed"
                meta = {"status": result["status"]}
                if state.reason:
                    meta["reason"] = state.reason
                if self.samples and not crashed:
                    meta[C.SAMPLES_COUNT] = state.step * self.gbs
                self.log.end(C.RUN_STOP, metadata=meta, time_ms=state.t_stop)
                if not self.lora and not crashed:  # lora logged its training-set size at init, as its reference does
                    # gpt3: training tokens; llama31: training samples (its RCPs count samples)
                    self.log.event(C.TRAIN_SAMPLES, state.step * (self.gbs if self.samples else self.tps))
        finally:
            self.log.close()
        return {"rule_violations": official_rule_violations(self.cfg), "mllog": str(self.run_dir / MLLOG)}

    def _block_meta(self, first: int, last: int, stop: bool) -> dict:
        """block_start/block_stop metadata for steps first+1..last: tokens (gpt3) or samples now (lora, llama31)."""
        if self.samples:
            return {C.SAMPLES_COUNT: (last if stop else first) * self.gbs}
        return {"first_epoch_num": first * self.tps, "epoch_count": (last - first) * self.tps}

    def _point_meta(self, steps: int) -> dict:
        """eval_start/eval_accuracy/eval_stop metadata after `steps` steps."""
        return {C.SAMPLES_COUNT: steps * self.gbs} if self.samples else {"epoch_num": steps * self.tps}


def mlperf_observers(cfg: Config, engine: Any, run_dir: Path, writer: bool) -> list[Observer]:
    """What `scaletrain train` attaches to the loop: the MLPerf log of a Trainer's run (train/run.py `observers`)."""
    platform = cfg.bench.platform or engine.platform
    return [MLPerfObserver(cfg, run_dir, dp_size=engine.layout.dp, platform=platform, writer=writer)]


def run_once(
    cfg: Config, engine: Engine, run_dir: str | Path, dp_size: int = 1, platform: str | None = None, writer: bool = True
) -> dict:
    """One timed run of cfg.bench.benchmark with `engine`: the training loop with the MLPerf observer attached.

    Writes run_dir/mllog.txt and run_dir/result.json and returns the result (train/loop.py run_loop: "status",
    "outcome", exceptions), plus "rule_violations" and "mllog". `writer=False` (every rank but 0 of a distributed
    run) steps the engine in lockstep and writes no file.
    """
    observer = MLPerfObserver(cfg, run_dir, dp_size=dp_size, platform=platform, writer=writer)
    return run_loop(cfg, engine, run_dir, [observer], writer=writer)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps_strict(data, indent=2) + "\n")  # strict JSON: a NaN loss is null plus "non_finite"
    tmp.replace(path)  # atomic: a reader never sees half a result


# ---------------------------------------------------------------- N runs


def derive_seeds(base: int, n: int) -> list[int]:
    """Distinct per-run seeds from the config's seed: base + 1000*i.

    Distinct on purpose: the package checker rejects two runs that log the same seed from the same file and line.
    """
    return [base + 1000 * i for i in range(n)]


def run_benchmark(
    cfg: Config,
    make_engine: Callable[[Config, int, Path], Engine],
    out_dir: str | Path,
    seeds: list[int] | None = None,
    console: Any = None,
    *,
    dp_size: int = 1,
    platform: str | None = None,
    writer: bool = True,
) -> dict:
    """cfg.bench.runs timed runs (or one per given seed) in out_dir/run_<i>/, each checked and then scored.

    Each run gets a copy of cfg with its seed and run_dir set, saved as run_<i>/config.json before
    `make_engine(run_cfg, seed, run_dir)` builds its engine. Prints a rich table and the olympic score;
    writes out_dir/summary.json and returns it. With `writer=False` (ranks other than 0) the runs are stepped
    in lockstep but nothing is written, checked or printed, and the summary is not scored.
    """
    from rich.console import Console

    console = console or Console()
    out_dir = Path(out_dir)
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(seeds) if seeds is not None else derive_seeds(cfg.train.seed, cfg.bench.runs)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")

    runs = []
    for i, seed in enumerate(seeds):
        run_dir = out_dir / f"run_{i}"
        run_cfg = copy.deepcopy(cfg)
        run_cfg.train.seed = int(seed)
        run_cfg.train.run_dir = str(run_dir)
        if cfg.checkpoint.dir:
            run_cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir) / f"run_{i}")  # runs must not share checkpoints
        elif not (cfg.checkpoint.interval_steps or cfg.checkpoint.interval_minutes):
            run_cfg.checkpoint.final = False  # a benchmark measures runs; N final models are asked for, not default
        finished = finished_result(run_dir) if cfg.checkpoint.resume == "auto" else None
        if finished is not None:
            # A restarted benchmark keeps the runs that already ended and resumes the one that was cut short.
            result = finished
            if writer:
                console.print(f"[bold]run {i}[/bold] seed {seed}: already finished ({result['status']}), kept")
        else:
            if writer:
                run_cfg.save(run_dir)
                console.print(f"[bold]run {i}[/bold] seed {seed} -> {run_dir}")
            result = run_once(
                run_cfg,
                make_engine(run_cfg, int(seed), run_dir),
                run_dir,
                dp_size=dp_size,
                platform=platform,
                writer=writer,
            )
        compliance: dict[str, Any] = {"ok": None, "command": None}
        if cfg.bench.check and writer:
            check = check_log(
                run_dir / "mllog.txt",
                cfg.bench.benchmark,
                log_output=run_dir / "compliance_checker.log",
                rules=cfg.bench.ruleset,
            )
            (run_dir / "compliance.txt").write_text(check.output)
            compliance = {"ok": check.ok, "command": check.command}
        runs.append({"run": i, **result, "compliance": compliance})

    if not writer:
        return {
            "benchmark": cfg.bench.benchmark,
            "runs": runs,
            "writer": False,
            "converged_all": all(r["status"] == C.SUCCESS for r in runs),
        }
    score = olympic_score([(r["time_to_train_s"], r["status"] == C.SUCCESS) for r in runs])
    rules = ruleset(cfg.bench.benchmark, cfg.bench.ruleset)
    seed_check = _seed_check([r["mllog"] for r in runs], rules) if cfg.bench.check else None
    compliant_all = (all(r["compliance"]["ok"] for r in runs) and bool(seed_check)) if cfg.bench.check else None
    rcp = _rcp_check(cfg, runs, out_dir, score.n_converged) if cfg.bench.check else None
    summary = {
        "benchmark": cfg.bench.benchmark,
        "runs": runs,
        "score_s": score.score_s,
        "score_min": score.score_min,
        "score_reason": score.reason,
        "dropped": score.dropped,
        "n_runs": score.n_runs,
        "runs_required": required_runs(cfg.bench.benchmark),
        "n_converged": score.n_converged,
        "converged_all": all(r["status"] == C.SUCCESS for r in runs),
        "compliant_all": compliant_all,
        "seed_check_ok": seed_check,
        "seeds": [int(s) for s in seeds],
        "ruleset": rules,
        "rcp_ok": None if rcp is None else rcp.ok,
    }
    _write_json(out_dir / "summary.json", summary)
    print_summary(console, summary)
    return summary


def _rcp_check(cfg: Config, runs: list[dict], out_dir: Path, n_converged: int):
    """MLCommons' RCP checker over a complete, converged submission of an official benchmark (the runs it requires,
    all converged): do they, olympic-averaged, converge no faster than the reference convergence points allow at
    their GBS? Output in out_dir/rcp_checker.txt. None where it does not apply (proxies have no RCPs)."""
    from scaletrain import benchmarks

    name = cfg.bench.benchmark
    if name not in benchmarks.BENCHMARKS or len(runs) != required_runs(name) or n_converged != len(runs):
        return None
    result = check_rcp([r["mllog"] for r in runs], name, cfg.bench.ruleset)
    (out_dir / "rcp_checker.txt").write_text(result.output)
    return result


def _seed_check(logs: list[str], rules: str = RULESET) -> bool:
    """The 4.1 package checker's own seed rule: every run logs a seed, and no two runs log the same seed from the
    same file:line (ours all log from one harness line, hence distinct seeds). Failures go to the root logger."""
    from mlperf_logging.package_checker.seed_checker import SeedChecker

    return bool(SeedChecker(rules).check_seeds(logs))
