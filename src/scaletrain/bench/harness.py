"""The timed MLPerf protocol around a training Engine: init -> run_start -> blocks/evals -> run_stop; N runs; score.

Event protocol (gpt3, ruleset 4.1.0; ../shared/docs/benchmarks.md):
    cache_clear, init_start, submission_* and hparams, [engine.init: untimed], init_stop, run_start,
    { block_start, ceil(eval_interval/GBS) train steps, block_stop, eval_start, eval_accuracy, eval_stop }*,
    run_stop(status), train_samples.
`epoch_num`/`first_epoch_num`/`epoch_count` are training TOKENS since the start checkpoint (steps * GBS * seq_len),
which is also what the RCP checker reads as "epochs to converge". Time to train = run_stop - run_start, both read
from the log's own time_ms stamps.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from scaletrain.config import Config

from .checker import RULESET, check_log
from .mllog import C, MLLogWriter
from .rules import (eval_every_steps, max_benchmark_steps, mllog_hparams, official_rule_violations,
                    tokens_per_step)
from .score import olympic_score

__all__ = ["Engine", "NonFiniteLoss", "run_once", "run_benchmark", "derive_seeds", "default_platform"]


class NonFiniteLoss(RuntimeError):
    """A training loss was NaN or Inf; the run ends with status "aborted"."""

    def __init__(self, step: int, value: float) -> None:
        self.step = int(step)
        self.value = float(value)
        super().__init__(f"non-finite training loss {self.value} at step {self.step}")


@runtime_checkable
class Engine(Protocol):
    """What the harness drives. Steps count from the start checkpoint (step 1 is the first timed step)."""

    seq_len: int
    global_batch_size: int
    eval_tokens: int
    """Validation label-token count, logged as eval_samples; read before init() if set then, else after it."""

    def init(self) -> None:
        """UNTIMED: build the model, warm up, then reset model/optimizer/data/RNG to the seed's initial state."""

    def train_step(self) -> dict:
        """One optimizer step on the next global batch; at least {"loss": float, "lr": float}.

        Raises NonFiniteLoss(step, value) when the loss is NaN/Inf."""

    def evaluate(self) -> float:
        """Token-weighted mean cross-entropy over the WHOLE validation set."""

    def finish(self, result: dict) -> None:
        """Close writers; `result` is what went into result.json."""


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


def _eval_tokens(engine: Any) -> int | None:
    value = getattr(engine, "eval_tokens", None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def _check_engine(cfg: Config, engine: Any) -> None:
    # Token counts in the log come from the config; an engine built with other shapes would make them lie.
    for attr, want in (("seq_len", cfg.model.seq_len), ("global_batch_size", cfg.train.global_batch_size)):
        have = getattr(engine, attr, None)
        if have != want:
            raise ValueError(f"engine.{attr}={have!r} does not match the config's {want}")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a result


def run_once(cfg: Config, engine: Engine, run_dir: str | Path, dp_size: int = 1,
             platform: str | None = None, writer: bool = True) -> dict:
    """One timed run of cfg.bench.benchmark with `engine`; writes run_dir/mllog.txt and run_dir/result.json.

    Stops with status "success" at the first evaluation <= cfg.train.target_eval_loss, or "aborted" on a
    non-finite training/eval loss or when the step budget (train.max_steps, 0 = until the decay ends) runs out.
    Returns the result dict (also passed to engine.finish). Other exceptions are logged as an aborted run,
    recorded in result.json under "error", passed to engine.finish, and re-raised.
    `writer=False` (every rank but 0 of a distributed run) steps the engine in lockstep and writes no file.
    """
    run_dir = Path(run_dir)
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    _check_engine(cfg, engine)
    platform = platform or cfg.bench.platform or default_platform(cfg, dp_size)
    every, limit, tps = eval_every_steps(cfg), max_benchmark_steps(cfg), tokens_per_step(cfg)
    target = cfg.train.target_eval_loss
    state: dict[str, Any] = {"status": None, "reason": None, "steps": 0, "evals": [], "last": {},
                             "t_start": None, "t_stop": None, "error": None}
    resume = (getattr(engine, "resume_info", None) or {}).get("harness") or None
    log_path = run_dir / "mllog.txt" if writer else None
    if resume and writer:
        # Back to where the checkpoint was taken: events after it (the crashed part of the run) are dropped,
        # and the log continues the same run_start; the restart's time stays inside time to train.
        with open(log_path, "r+b") as f:
            f.truncate(int(resume["mllog_bytes"]))
    log = MLLogWriter(log_path, mode="a" if resume else "w")
    try:
        try:
            _protocol(cfg, engine, log, state, dp_size, platform, every, limit, tps, target, resume)
        except BaseException as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
            if state["t_start"] is not None and state["t_stop"] is None:
                state["status"], state["reason"] = C.ABORTED, f"crashed: {state['error']}"
                state["t_stop"] = log.end(C.RUN_STOP, metadata={"status": C.ABORTED, "reason": state["reason"]})
            result = _result(cfg, state, tps, run_dir)
            if writer:
                _write_json(run_dir / "result.json", result)
            try:  # let the engine close its writers; its own failure must not hide the original one
                engine.finish(result)
            except Exception:
                pass
            raise
    finally:
        log.close()
    result = _result(cfg, state, tps, run_dir)
    if writer:
        _write_json(run_dir / "result.json", result)
    engine.finish(result)
    return result


def _protocol(cfg, engine, log, state, dp_size, platform, every, limit, tps, target, resume=None) -> None:
    # Events are logged on their own lines here, on purpose: mllog stamps each with this file and line number.
    if resume:
        state.update(steps=int(resume["steps"]), evals=list(resume["evals"]), t_start=int(resume["t_start"]))
        engine.init()  # rebuilds and loads the checkpoint
        if getattr(engine, "step", state["steps"]) != state["steps"]:
            raise RuntimeError(f"checkpoint step {engine.step} does not match the harness state {state['steps']}")
        _train_loop(engine, log, state, every, limit, tps, target)
        return
    early_tokens = _eval_tokens(engine)
    hparams = mllog_hparams(cfg, early_tokens or 1, platform, dp_size)  # validates before anything is logged
    log.event(C.CACHE_CLEAR, True)
    log.start(C.INIT_START)
    if early_tokens is not None:
        for key, value in hparams[1:]:
            log.event(key, value)
    engine.init()
    if early_tokens is None:
        tokens = _eval_tokens(engine)
        if tokens is None:
            raise ValueError(f"engine.eval_tokens={getattr(engine, 'eval_tokens', None)!r} after init(): "
                             "must be the positive validation label-token count")
        for key, value in mllog_hparams(cfg, tokens, platform, dp_size)[1:]:
            log.event(key, value)
    log.end(C.INIT_STOP)
    state["t_start"] = log.start(C.RUN_START)
    _train_loop(engine, log, state, every, limit, tps, target)


def _train_loop(engine, log, state, every, limit, tps, target) -> None:
    while state["status"] is None:
        n = min(every, limit - state["steps"])
        block = {"first_epoch_num": state["steps"] * tps, "epoch_count": n * tps}
        log.start(C.BLOCK_START, metadata=block)
        try:
            for _ in range(n):
                out = engine.train_step()
                loss = float(out["loss"])
                if not math.isfinite(loss):  # an engine that forgot its own check
                    raise NonFiniteLoss(state["steps"] + 1, loss)
                state["steps"] += 1
                state["last"] = out
        except NonFiniteLoss as exc:
            log.end(C.BLOCK_STOP, metadata=block)
            state["status"], state["reason"] = C.ABORTED, str(exc)
            break
        log.end(C.BLOCK_STOP, metadata=block)

        tokens = state["steps"] * tps
        log.start(C.EVAL_START, metadata={"epoch_num": tokens})
        eval_loss = float(engine.evaluate())
        log.event(C.EVAL_ACCURACY, eval_loss, metadata={"epoch_num": tokens})
        t_eval = log.end(C.EVAL_STOP, metadata={"epoch_num": tokens})
        last = state["last"]
        state["evals"].append({"step": state["steps"], "tokens": tokens, "eval_loss": eval_loss,
                               "train_loss": _num(last.get("loss")), "lr": _num(last.get("lr")),
                               "time_s": (t_eval - state["t_start"]) / 1000.0})
        if not math.isfinite(eval_loss):
            state["status"], state["reason"] = C.ABORTED, f"non-finite eval loss {eval_loss} at step {state['steps']}"
        elif eval_loss <= target:
            state["status"] = C.SUCCESS
        elif state["steps"] >= limit:
            state["status"] = C.ABORTED
            state["reason"] = (f"step budget of {limit} steps used up with eval loss {eval_loss:.4f} "
                               f"above the target {target}")
        elif hasattr(engine, "checkpoint_due") and engine.checkpoint_due():
            log.flush()
            engine.save_checkpoint({"steps": state["steps"], "evals": state["evals"], "t_start": state["t_start"],
                                    "mllog_bytes": log.size()})

    stop_meta = {"status": state["status"]}
    if state["reason"]:
        stop_meta["reason"] = state["reason"]
    state["t_stop"] = log.end(C.RUN_STOP, metadata=stop_meta)
    log.event(C.TRAIN_SAMPLES, state["steps"] * tps)


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def _result(cfg: Config, state: dict, tps: int, run_dir: Path) -> dict:
    evals = state["evals"]
    t0, t1 = state["t_start"], state["t_stop"]
    return {
        "status": state["status"] or C.ABORTED,
        "time_to_train_s": None if t0 is None or t1 is None else (t1 - t0) / 1000.0,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "steps": state["steps"],
        "tokens": state["steps"] * tps,
        "seed": cfg.train.seed,
        "benchmark": cfg.bench.benchmark,
        "evals": evals,
        "reason": state["reason"],
        "error": state["error"],
        "target_eval_loss": cfg.train.target_eval_loss,
        "rule_violations": official_rule_violations(cfg),
        "mllog": str(run_dir / "mllog.txt"),
    }


# ---------------------------------------------------------------- N runs


def derive_seeds(base: int, n: int) -> list[int]:
    """Distinct per-run seeds from the config's seed: base + 1000*i.

    Distinct on purpose: the package checker rejects two runs that log the same seed from the same file and line.
    """
    return [base + 1000 * i for i in range(n)]


def run_benchmark(cfg: Config, make_engine: Callable[[Config, int, Path], Engine], out_dir: str | Path,
                  seeds: list[int] | None = None, console: Any = None, *, dp_size: int = 1,
                  platform: str | None = None, writer: bool = True) -> dict:
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
        finished = _finished_result(run_dir) if cfg.checkpoint.resume == "auto" else None
        if finished is not None:
            # A restarted benchmark keeps the runs that already ended and resumes the one that was cut short.
            result = finished
            if writer:
                console.print(f"[bold]run {i}[/bold] seed {seed}: already finished ({result['status']}), kept")
        else:
            if writer:
                run_cfg.save(run_dir)
                console.print(f"[bold]run {i}[/bold] seed {seed} -> {run_dir}")
            result = run_once(run_cfg, make_engine(run_cfg, int(seed), run_dir), run_dir,
                              dp_size=dp_size, platform=platform, writer=writer)
        compliance: dict[str, Any] = {"ok": None, "command": None}
        if cfg.bench.check and writer:
            check = check_log(run_dir / "mllog.txt", cfg.bench.benchmark)
            (run_dir / "compliance.txt").write_text(check.output)
            compliance = {"ok": check.ok, "command": check.command}
        runs.append({"run": i, **result, "compliance": compliance})

    if not writer:
        return {"benchmark": cfg.bench.benchmark, "runs": runs, "writer": False,
                "converged_all": all(r["status"] == C.SUCCESS for r in runs)}
    score = olympic_score([(r["time_to_train_s"], r["status"] == C.SUCCESS) for r in runs])
    seed_check = _seed_check([r["mllog"] for r in runs]) if cfg.bench.check else None
    compliant_all = (all(r["compliance"]["ok"] for r in runs) and bool(seed_check)) if cfg.bench.check else None
    summary = {
        "benchmark": cfg.bench.benchmark,
        "runs": runs,
        "score_s": score.score_s,
        "score_min": score.score_min,
        "score_reason": score.reason,
        "dropped": score.dropped,
        "n_runs": score.n_runs,
        "n_converged": score.n_converged,
        "converged_all": all(r["status"] == C.SUCCESS for r in runs),
        "compliant_all": compliant_all,
        "seed_check_ok": seed_check,
        "seeds": [int(s) for s in seeds],
        "ruleset": RULESET,
    }
    _write_json(out_dir / "summary.json", summary)
    _print_summary(console, summary)
    return summary


def _finished_result(run_dir: Path) -> dict | None:
    """result.json of a run that ended on its own (success or aborted, not crashed), else None."""
    path = Path(run_dir) / "result.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if result.get("error") is None and result.get("status") in (C.SUCCESS, C.ABORTED):
        return result
    return None


def _seed_check(logs: list[str]) -> bool:
    """The 4.1 package checker's own seed rule: every run logs a seed, and no two runs log the same seed from the
    same file:line (ours all log from one harness line, hence distinct seeds). Failures go to the root logger."""
    from mlperf_logging.package_checker.seed_checker import SeedChecker

    return bool(SeedChecker(RULESET).check_seeds(logs))


def _print_summary(console: Any, summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"MLPerf {summary['benchmark']} (ruleset {summary['ruleset']})")
    for col in ("run", "seed", "status", "evals", "steps", "time to train", "eval loss", "checker", "score"):
        table.add_column(col, justify="right" if col not in ("status", "checker", "score") else "left",
                         no_wrap=True)
    dropped = set(summary["dropped"])
    for r in summary["runs"]:
        ok = r["compliance"]["ok"]
        verdict = "skipped" if ok is None else ("[green]pass[/green]" if ok else "[red]FAIL[/red]")
        status = "[green]success[/green]" if r["status"] == C.SUCCESS else f"[red]{r['status']}[/red]"
        ttt = "-" if r["time_to_train_s"] is None else f"{r['time_to_train_s']:.1f} s"
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        counted = "dropped" if r["run"] in dropped else "counted"
        table.add_row(str(r["run"]), str(r["seed"]), status, str(len(r["evals"])), str(r["steps"]), ttt, loss,
                      verdict, counted)
    console.print(table)
    for r in summary["runs"]:
        if r.get("reason"):
            console.print(f"run {r['run']}: {r['reason']}")
    if summary["score_s"] is None:
        console.print(f"[bold]score:[/bold] n/a ({summary['score_reason']})")
    else:
        console.print(f"[bold]score:[/bold] {summary['score_s']:.1f} s = {summary['score_min']:.2f} min "
                      f"(olympic mean of {summary['n_runs']} runs, {summary['n_converged']} converged)")
    if summary["compliant_all"] is False:
        console.print("[red]not compliant:[/red] see run_<i>/compliance.txt"
                      + ("" if summary["seed_check_ok"] else " and the seed check"))
