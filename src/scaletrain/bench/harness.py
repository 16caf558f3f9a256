"""The timed MLPerf protocol around a training Engine: init -> run_start -> blocks/evals -> run_stop; N runs; score.

Event protocol (ruleset 4.1.0; docs/benchmarks.md sections 1-3):
    cache_clear, init_start, submission_* and hparams, [engine.init: untimed], init_stop, run_start,
    { block_start, train steps up to the next evaluation, block_stop, eval_start, eval_accuracy, eval_stop }*,
    run_stop(status), and for gpt3 train_samples.
gpt3: an evaluation every ceil(eval_interval/GBS) steps; `epoch_num`/`first_epoch_num`/`epoch_count` are training
TOKENS since the start checkpoint (steps * GBS * seq_len), which the RCP checker reads as "epochs to converge".
llama2_70b_lora: the same cadence, but the first floor(0.125*GBS + 2) evaluations are neither run nor logged (the
first block is that much longer); every event carries `samples_count` = training samples since run_start
(steps * GBS), which the RCP checker reads as "samples to converge"; train_samples/eval_samples are the dataset
sizes, logged at init. Time to train = run_stop - run_start, both read from the log's own time_ms stamps.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from scaletrain.config import Config
from scaletrain.train.rundir import finished_result

from .checker import RULESET, check_log
from .mllog import C, MLLogWriter
from .preemption import PREEMPTED, Preempted, harness_state, stop_if_signalled
from .rules import Cadence, eval_skip, is_lora, mllog_hparams, official_rule_violations
from .score import olympic_score, required_runs
from .summary import print_summary

__all__ = ["Engine", "NonFiniteLoss", "Preempted", "run_once", "run_benchmark", "derive_seeds", "default_platform"]


class NonFiniteLoss(RuntimeError):
    """A training loss was NaN or Inf; the run ends with status "aborted"."""

    def __init__(self, step: int, value: float) -> None:
        self.step = int(step)
        self.value = float(value)
        super().__init__(f"non-finite training loss {self.value} at step {self.step}")


@runtime_checkable
class Engine(Protocol):
    """What the harness drives. Steps count from the start checkpoint (step 1 is the first timed step).

    llama2_70b_lora engines also carry `eval_samples` and `train_samples`: the validation and training sequence
    counts (173 and 3901 for GovReport), logged under those keys and read like eval_tokens. They are not members
    here so that a gpt3 engine without them still satisfies isinstance(engine, Engine).
    """

    seq_len: int
    global_batch_size: int
    eval_tokens: int
    """gpt3: validation label-token count, logged as eval_samples; read before init() if set then, else after it."""

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


def _positive(engine: Any, attr: str) -> int | None:
    value = getattr(engine, attr, None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def _dataset_sizes(cfg: Config, engine: Any) -> dict | None:
    """What the init phase logs from the engine: gpt3 eval_samples = engine.eval_tokens; llama2_70b_lora
    eval_samples/train_samples = engine.eval_samples/train_samples. None while any of them is still unknown."""
    if is_lora(cfg):
        sizes = {"eval_samples": _positive(engine, "eval_samples"), "train_samples": _positive(engine, "train_samples")}
    else:
        sizes = {"eval_samples": _positive(engine, "eval_tokens")}
    return None if None in sizes.values() else sizes


def _check_engine(cfg: Config, engine: Any) -> None:
    # Token counts in the log come from the config; an engine built with other shapes would make them lie.
    for attr, want in (("seq_len", cfg.model.seq_len), ("global_batch_size", cfg.train.global_batch_size)):
        have = getattr(engine, attr, None)
        if have != want:
            raise ValueError(f"engine.{attr}={have!r} does not match the config's {want}")


def _write_json(path: Path, data: dict) -> None:
    from scaletrain.train.rundir import dumps_strict

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps_strict(data, indent=2) + "\n")  # strict JSON: a NaN loss is null plus "non_finite"
    tmp.replace(path)  # atomic: a reader never sees half a result


def run_once(
    cfg: Config, engine: Engine, run_dir: str | Path, dp_size: int = 1, platform: str | None = None, writer: bool = True
) -> dict:
    """One timed run of cfg.bench.benchmark with `engine`; writes run_dir/mllog.txt and run_dir/result.json.

    Stops with status "success" at the first evaluation <= cfg.train.target_eval_loss, or "aborted" on a
    non-finite training/eval loss or when the step budget (train.max_steps, 0 = until the decay ends) runs out;
    result["outcome"] says which: "converged", "diverged", "budget_exhausted" (or "crashed" on an exception,
    "preempted" when a stop signal saved and ended it unfinished).
    Returns the result dict (also passed to engine.finish). Other exceptions are logged as an aborted run,
    recorded in result.json under "error", passed to engine.finish, and re-raised.
    `writer=False` (every rank but 0 of a distributed run) steps the engine in lockstep and writes no file.
    """
    run_dir = Path(run_dir)
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    _check_engine(cfg, engine)
    platform = platform or cfg.bench.platform or default_platform(cfg, dp_size)
    plan = Cadence(cfg)
    state: dict[str, Any] = {
        "status": None,
        "reason": None,
        "outcome": None,
        "steps": 0,
        "evals": [],
        "last": {},
        "t_start": None,
        "t_stop": None,
        "error": None,
    }
    resume = (getattr(engine, "resume_info", None) or {}).get("harness") or None
    log_path = run_dir / "mllog.txt" if writer else None
    if resume and writer:
        # Back to where the checkpoint was taken: events after it (the crashed part of the run) are dropped,
        # and the log continues the same run_start; the restart's time stays inside time to train. Resumed into
        # another run directory, the log is copied from the checkpoint's run.
        from scaletrain.checkpoint.resume import restore_mllog

        restore_mllog(log_path, getattr(engine, "resume_path", None), engine.resume_info)
    log = MLLogWriter(log_path, mode="a" if resume else "w")
    try:
        try:
            _protocol(cfg, engine, log, state, dp_size, platform, plan, resume)
        except Preempted as exc:
            _end_preempted(cfg, engine, state, plan, run_dir, writer, exc)
            raise
        except BaseException as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
            state["outcome"] = "crashed"
            if state["t_start"] is not None and state["t_stop"] is None:
                state["status"], state["reason"] = C.ABORTED, f"crashed: {state['error']}"
                state["t_stop"] = log.end(C.RUN_STOP, metadata={"status": C.ABORTED, "reason": state["reason"]})
            result = _result(cfg, state, plan, run_dir)
            if writer:
                _write_json(run_dir / "result.json", result)
            try:  # let the engine close its writers; its own failure must not hide the original one
                engine.finish(result)
            except Exception:
                pass
            raise
    finally:
        log.close()
    result = _result(cfg, state, plan, run_dir)
    if writer:
        _write_json(run_dir / "result.json", result)
    engine.finish(result)
    return result


def _protocol(cfg, engine, log, state, dp_size, platform, plan, resume=None) -> None:
    # Events are logged on their own lines here, on purpose: mllog stamps each with this file and line number.
    if resume:
        state.update(
            steps=int(resume["steps"]),
            evals=list(resume["evals"]),
            t_start=int(resume["t_start"]),
            last=dict(resume.get("last") or {}),
        )
        engine.init()  # rebuilds and loads the checkpoint
        if getattr(engine, "step", state["steps"]) != state["steps"]:
            raise RuntimeError(f"checkpoint step {engine.step} does not match the harness state {state['steps']}")
        _train_loop(engine, log, state, plan, open_block=resume.get("block_first"))
        return
    early = _dataset_sizes(cfg, engine)
    # Validates before anything is logged (placeholder sizes when the engine learns them in init()).
    hparams = mllog_hparams(cfg, platform=platform, dp_size=dp_size, **(early or _placeholder_sizes(plan)))
    log.event(C.CACHE_CLEAR, True)
    log.start(C.INIT_START)
    if early is not None:
        for key, value in hparams[1:]:
            log.event(key, value)
    engine.init()
    if early is None:
        sizes = _dataset_sizes(cfg, engine)
        if sizes is None:
            attrs = ("eval_samples", "train_samples") if plan.lora else ("eval_tokens",)
            have = {a: getattr(engine, a, None) for a in attrs}
            raise ValueError(
                f"engine {have} after init(): must be positive "
                + ("validation/training sequence counts" if plan.lora else "the validation label-token count")
            )
        for key, value in mllog_hparams(cfg, platform=platform, dp_size=dp_size, **sizes)[1:]:
            log.event(key, value)
    log.end(C.INIT_STOP)
    state["t_start"] = log.start(C.RUN_START)
    _train_loop(engine, log, state, plan)


def _placeholder_sizes(plan: Cadence) -> dict:
    return {"eval_samples": 1, "train_samples": 1} if plan.lora else {"eval_samples": 1}


def _train_loop(engine, log, state, plan: Cadence, open_block: int | None = None) -> None:
    """Blocks and evaluations until a status is set; `open_block`: resume inside the block that starts there."""
    limit, target = plan.limit, plan.target
    while state["status"] is None:
        if open_block is None:
            first, stop = state["steps"], plan.next_stop(state["steps"])
            log.start(C.BLOCK_START, metadata=plan.block_meta(first, stop, stop=False))
        else:  # a signal save inside this block: its block_start is already in the (truncated) log
            first, stop, open_block = int(open_block), plan.next_stop(int(open_block)), None
        try:
            while state["steps"] < stop:
                out = engine.train_step()
                loss = float(out["loss"])
                if not math.isfinite(loss):  # an engine that forgot its own check
                    raise NonFiniteLoss(state["steps"] + 1, loss)
                state["steps"] += 1
                state["last"] = out
                stop_if_signalled(engine, log, state, first)
        except NonFiniteLoss as exc:
            # gpt3 repeats block_start's metadata; lora counts the samples actually trained.
            log.end(C.BLOCK_STOP, metadata=plan.block_meta(first, state["steps"] if plan.lora else stop, stop=True))
            state["status"], state["reason"] = C.ABORTED, str(exc) + _resumed_from(engine)
            state["outcome"] = "diverged"
            break
        log.end(C.BLOCK_STOP, metadata=plan.block_meta(first, stop, stop=True))

        steps = state["steps"]
        log.start(C.EVAL_START, metadata=plan.point_meta(steps))
        eval_loss = float(engine.evaluate())
        log.event(C.EVAL_ACCURACY, eval_loss, metadata=plan.point_meta(steps))
        t_eval = log.end(C.EVAL_STOP, metadata=plan.point_meta(steps))
        last = state["last"]
        state["evals"].append(
            {
                "step": steps,
                "tokens": steps * plan.tps,
                "samples": steps * plan.gbs,
                "eval_loss": eval_loss,
                "train_loss": _num(last.get("loss")),
                "lr": _num(last.get("lr")),
                "time_s": (t_eval - state["t_start"]) / 1000.0,
            }
        )
        if not math.isfinite(eval_loss):
            state["status"], state["reason"] = (
                C.ABORTED,
                (f"non-finite eval loss {eval_loss} at step {state['steps']}" + _resumed_from(engine)),
            )
            state["outcome"] = "diverged"
        elif eval_loss <= target:
            state["status"], state["outcome"] = C.SUCCESS, "converged"
        elif state["steps"] >= limit:
            state["status"], state["outcome"] = C.ABORTED, "budget_exhausted"
            state["reason"] = (
                f"step budget of {limit} steps used up with eval loss {eval_loss:.4f} above the target {target}"
            )
        elif hasattr(engine, "checkpoint_due") and engine.checkpoint_due():
            engine.save_checkpoint(harness_state(state, log))

    stop_meta = {"status": state["status"]}
    if state["reason"]:
        stop_meta["reason"] = state["reason"]
    if plan.lora:
        stop_meta[C.SAMPLES_COUNT] = state["steps"] * plan.gbs
    state["t_stop"] = log.end(C.RUN_STOP, metadata=stop_meta)
    if not plan.lora:  # lora logged its training-set size at init, as its reference does
        log.event(C.TRAIN_SAMPLES, state["steps"] * plan.tps)


def _end_preempted(cfg, engine, state: dict, plan: Cadence, run_dir: Path, writer: bool, exc: Preempted) -> None:
    # Not an end of the run: no run_stop, and result.json says "preempted" so that a restart resumes it.
    state["status"], state["reason"], state["outcome"] = PREEMPTED, str(exc), PREEMPTED
    result = _result(cfg, state, plan, run_dir)
    if writer:
        _write_json(run_dir / "result.json", result)
    engine.finish(result)  # publishes an asynchronous save of the signal's checkpoint


def _resumed_from(engine) -> str:
    # A resumed run that diverges may have loaded damaged weights (checkpoint.verify="size" misses flipped bytes).
    path = getattr(engine, "resume_path", None)
    return f" (resumed from {path})" if path else ""


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def _result(cfg: Config, state: dict, plan: Cadence, run_dir: Path) -> dict:
    evals = state["evals"]
    t0, t1 = state["t_start"], state["t_stop"]
    return {
        "status": state["status"] or C.ABORTED,
        "outcome": state["outcome"] or "crashed",
        "time_to_train_s": None if t0 is None or t1 is None else (t1 - t0) / 1000.0,
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "steps": state["steps"],
        "tokens": state["steps"] * plan.tps,
        "samples": state["steps"] * plan.gbs,
        "skipped_evals": eval_skip(cfg),
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
            check = check_log(run_dir / "mllog.txt", cfg.bench.benchmark, log_output=run_dir / "compliance_checker.log")
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
        "runs_required": required_runs(cfg.bench.benchmark),
        "n_converged": score.n_converged,
        "converged_all": all(r["status"] == C.SUCCESS for r in runs),
        "compliant_all": compliant_all,
        "seed_check_ok": seed_check,
        "seeds": [int(s) for s in seeds],
        "ruleset": RULESET,
    }
    _write_json(out_dir / "summary.json", summary)
    print_summary(console, summary)
    return summary


def _seed_check(logs: list[str]) -> bool:
    """The 4.1 package checker's own seed rule: every run logs a seed, and no two runs log the same seed from the
    same file:line (ours all log from one harness line, hence distinct seeds). Failures go to the root logger."""
    from mlperf_logging.package_checker.seed_checker import SeedChecker

    return bool(SeedChecker(RULESET).check_seeds(logs))
