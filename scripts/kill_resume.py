#!/usr/bin/env python3
"""Kill a tiny training job with SIGKILL at random moments, resume it each time, and prove nothing was lost.

The job is `python -m scaletrain train` on a tiny fp32 model (2 layers, d_model 64, seq 64, vocab 1024, GBS 16, one
thread) over the packaged Shakespeare excerpt, with an evaluation every few steps, a checkpoint after every
evaluation (`checkpoint.interval_steps=1`), `checkpoint.resume=auto` and an unreachable target, so it always runs
exactly `--max-steps` steps. The script

1. runs the job once uninterrupted (the reference, in <workdir>/reference), in the background: with one thread
   per process its numbers do not depend on the load, and the second core is otherwise idle;
2. starts the same command in <workdir>/killed and SIGKILLs it `--kills` times (seeded by `--seed`). Each attempt
   is killed in one of three ways:
     delay    at a uniformly random delay after the process started (it may land in the imports, the model
              build, the checkpoint load of a resume, a training step, an evaluation or a save);
     save     DURING a checkpoint save: the watcher polls checkpoints/ every 2 ms and kills the moment the k-th
              new `step_<N>.tmp/` directory of this attempt appears (k random, 1..3);
     publish  right after a checkpoint is published: the moment the k-th new `step_<N>/` appears, i.e. while the
              oldest checkpoint is being pruned;
   a guard kills at once (during that save) when a save starts beyond the attempt's pace, a linear share of the
   run plus two evaluation intervals, so the restarts resume from checkpoints spread over the whole run and the
   job never finishes during the kill phase;
3. after every kill checks that every `step_<N>` directory verifies (`store.verify`, sha256) and that nothing
   else under checkpoints/ could be mistaken for a checkpoint (partials exist only as `step_<N>.tmp`), and after
   every restart that it resumed from exactly the newest complete checkpoint (its first logged step is that
   checkpoint's step + 1; step 1 again would mean it started over);
4. lets the last attempt finish and asserts that result.json status and steps equal the reference's, that every
   evaluation loss and every step's training loss, lr and grad norm in metrics.jsonl are bitwise equal, that
   metrics.jsonl holds every step once (a resume cuts it back to its checkpoint's step), and that the killed
   run's MLLOG passes the MLCommons checker (gpt3-proxy rules) with exactly one run_start and one run_stop.

It prints a table of the attempts and a summary (kills that landed during a save, which step every restart
resumed from), writes `--json` if given, and exits 0 only when every check passed (1 on any mismatch, 2 when the
training command itself does not work).

Example:  python scripts/kill_resume.py --kills 20 --seed 0 --json kill_resume.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_DIR = re.compile(r"^step_(\d{8})\.tmp$")
POLL_S = 0.002  # a tiny model's save keeps step_<N>.tmp/ around for ~50-100 ms


# ---------------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kill_resume.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs before the job may finish (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    p.add_argument("--workdir", help="where the runs go (default: a new temporary directory, on /dev/shm when there "
                   "is one, removed on success unless --keep); a SIGKILL needs no durable storage, and on a busy "
                   "disk the checkpoints' fsyncs would dominate the run time")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory even on success")
    p.add_argument("--json", metavar="FILE", help="write the summary and every attempt as JSON to FILE")
    p.add_argument("--max-steps", type=int, default=96,
                   help="train.max_steps of the job: room for the progress made between kills, so restarts resume "
                        "from checkpoints spread over the run (default 96)")
    p.add_argument("--eval-every", type=int, default=2,
                   help="optimizer steps between evaluations (= checkpoints); eval_interval_samples = this x GBS "
                        "(default 2)")
    p.add_argument("--min-delay", type=float, default=1.0, help="shortest random kill delay in s (default 1.0)")
    p.add_argument("--max-delay", type=float, default=7.0,
                   help="longest random kill delay in s; startup (python, torch, build, resume) takes ~3-4 s on 2 "
                        "cores, so about half of these kills land in training (default 7.0)")
    p.add_argument("--save-fraction", type=float, default=0.4,
                   help="share of kills aimed at the middle of a save (default 0.4)")
    p.add_argument("--publish-fraction", type=float, default=0.1,
                   help="share of kills aimed right after a checkpoint is published, during pruning (default 0.1)")
    p.add_argument("--max-save-index", type=int, default=3,
                   help="a targeted kill hits the k-th save of its attempt, k uniform in 1..this (default 3)")
    p.add_argument("--attempt-timeout", type=float, default=120.0,
                   help="an attempt that runs longer than this is a hang: killed and reported (default 120 s)")
    p.add_argument("--train-prefix", help="train dataset prefix (default: prepare the packaged excerpt)")
    p.add_argument("--valid-prefix", help="validation dataset prefix (with --train-prefix)")
    p.add_argument("--tokenizer", help="sentencepiece model of the datasets (with --train-prefix)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for both runs (repeatable), e.g. --set checkpoint.keep=3")
    p.add_argument("--quiet", action="store_true", help="print only the summary, no line per attempt")
    return p


def prepare_data(args, workdir: Path) -> dict[str, str]:
    """Dataset paths: the ones given, or the packaged excerpt tokenized at vocab 1024 under workdir/excerpt."""
    given = [args.train_prefix, args.valid_prefix, args.tokenizer]
    if any(given):
        if not all(given):
            raise SystemExit("kill_resume.py: --train-prefix, --valid-prefix and --tokenizer go together")
        return {"train_prefix": args.train_prefix, "valid_prefix": args.valid_prefix, "tokenizer": args.tokenizer}
    from scaletrain.data.corpus import prepare_excerpt
    corpus = prepare_excerpt(workdir / "excerpt", 1024)
    return {"train_prefix": str(corpus.train_prefix), "valid_prefix": str(corpus.valid_prefix),
            "tokenizer": str(corpus.tokenizer)}


GBS = 16


def overrides(args, data: dict[str, str], run_dir: Path) -> list[str]:
    """The job's config: tests/e2e/test_train_e2e.py::tiny_overrides plus checkpoint-after-every-evaluation."""
    return [f"data.train_prefix={data['train_prefix']}", f"data.valid_prefix={data['valid_prefix']}",
            f"data.tokenizer={data['tokenizer']}", "model.vocab_size=1024", "model.n_layers=2", "model.d_model=64",
            "model.n_heads=2", "model.seq_len=64", f"train.global_batch_size={GBS}", "train.micro_batch_size=8",
            "train.dtype=fp32", "train.threads=1", "optim.lr=2e-3", "optim.warmup_samples=160",
            "optim.decay_samples=3200", "train.progress=false",
            "checkpoint.interval_steps=1", "checkpoint.resume=auto",
            f"train.eval_interval_samples={args.eval_every * GBS}", f"train.max_steps={args.max_steps}",
            "train.target_eval_loss=0.1", f"train.run_dir={run_dir}", *args.extra]


def command(args, data, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "scaletrain", "train"]
    for item in overrides(args, data, run_dir):
        cmd += ["--set", item]
    return cmd


# ---------------------------------------------------------------------------------------------------- run directory
def read_records(path: Path) -> tuple[list[dict], int]:
    """metrics.jsonl records and the number of torn lines (a line cut by a kill, continued by the next attempt)."""
    if not path.is_file():
        return [], 0
    records, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            torn += 1
            cut = line.rfind('{"time"')  # the next attempt's first record, appended to the cut line
            if cut > 0:
                try:
                    records.append(json.loads(line[cut:]))
                except ValueError:
                    pass
    return records, torn


def lines_of(path: Path) -> set[str]:
    """The lines of metrics.jsonl now (each carries its own time stamp, so a re-logged step is a new line)."""
    return set(path.read_text(errors="replace").splitlines()) if path.is_file() else set()


def read_new_records(path: Path, seen: set[str]) -> list[dict]:
    """Records written since `seen` was taken: a resume first cuts the file back to its checkpoint's step, so
    an offset into the old file would point into the middle of the new one."""
    out = []
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        if line in seen:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # torn by this attempt's kill
    return out


def last_per_step(records: list[dict], key: str) -> dict[int, dict]:
    """{step: the last record of that step carrying `key`}."""
    out = {}
    for r in records:
        if key in r:
            out[int(r["step"])] = r
    return out


def scan_checkpoints(root: Path) -> dict:
    """Everything under checkpoints/: verified complete ones, partial .tmp ones, and anything that looks wrong."""
    from scaletrain.checkpoint import store
    complete, partial, bad, other = [], [], [], []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if STEP_DIR.match(entry.name) and entry.is_dir():
                try:
                    store.verify(entry, "sha256")
                    complete.append(int(STEP_DIR.match(entry.name).group(1)))
                except store.CheckpointError as exc:
                    bad.append(f"{entry.name}: {exc}")
            elif TMP_DIR.match(entry.name) and entry.is_dir():
                partial.append(entry.name)
            elif entry.name == store.READERS_LOCK and entry.is_file():  # export's shared lock against the pruner
                continue
            else:
                other.append(entry.name)
    # What checkpoint.resume=auto would pick must be one of the verified ones (it never loads anything else).
    picked = store.complete_checkpoints(root)
    picked_step = int(STEP_DIR.match(picked[-1].name).group(1)) if picked else 0
    return {"complete": complete, "partial": partial, "bad": bad, "other": other, "auto_pick": picked_step}


def _tmp_keys(root: Path) -> dict[str, tuple]:
    """{name: (inode, ctime_ns)} of the step_<N>.tmp directories now (a recreated one gets a new ctime)."""
    out = {}
    try:
        with os.scandir(root) as it:
            for e in it:
                if TMP_DIR.match(e.name):
                    try:
                        st = e.stat(follow_symlinks=False)
                        out[e.name] = (st.st_ino, st.st_ctime_ns)
                    except FileNotFoundError:
                        pass
    except FileNotFoundError:
        pass
    return out


def _final_names(root: Path) -> set[str]:
    try:
        return {n for n in os.listdir(root) if STEP_DIR.match(n)}
    except FileNotFoundError:
        return set()


# ---------------------------------------------------------------------------------------------------- one attempt
def run_attempt(cmd: list[str], run_dir: Path, log_path: Path, plan: dict, guard_step: int | None,
                timeout: float) -> dict:
    """Start the job; kill it as `plan` says (None: let it finish). Returns what happened."""
    root = run_dir / "checkpoints"
    before_tmp = _tmp_keys(root)
    before_final = _final_names(root)
    seen_tmp: list[str] = []
    seen_final: list[str] = []
    t_start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    killed_by = None
    mode = plan["mode"] if plan else None
    deadline = t_start + plan["delay"] if mode == "delay" else None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t_start > timeout:
                killed_by = "timeout"
                break
            if deadline is not None and now >= deadline:
                killed_by = "delay"
                break
            if plan is not None:
                tmp = _tmp_keys(root)
                fresh = [n for n, key in tmp.items() if before_tmp.get(n) != key and n not in seen_tmp]
                for n in sorted(fresh):
                    seen_tmp.append(n)
                if fresh and mode == "save" and len(seen_tmp) >= plan["k"]:
                    killed_by = "save"
                    break
                if fresh and guard_step is not None and max(int(TMP_DIR.match(n).group(1)) for n in fresh) > guard_step:
                    killed_by = "guard"  # this save would leave too few steps for the remaining kills
                    break
                if mode == "publish":
                    final = sorted(_final_names(root) - before_final - set(seen_final))
                    seen_final += final
                    if final and len(seen_final) >= plan["k"]:
                        killed_by = "publish"
                        break
            time.sleep(POLL_S)
        if killed_by is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                killed_by = None  # it exited on its own a moment earlier
    finally:
        if proc.poll() is None and killed_by is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    t_end = time.monotonic()
    after_tmp = _tmp_keys(root)
    new_tmp = sorted(n for n, key in after_tmp.items() if before_tmp.get(n) != key)
    # A new .tmp newer than every published checkpoint is a save this kill interrupted; an older one is a
    # checkpoint that pruning had unpublished (renamed back to .tmp) and was deleting.
    newest = max((int(STEP_DIR.match(n).group(1)) for n in _final_names(root)), default=0)
    in_save = [n for n in new_tmp if int(TMP_DIR.match(n).group(1)) > newest]
    in_prune = [n for n in new_tmp if int(TMP_DIR.match(n).group(1)) < newest]
    tmp_files = {}
    for n in in_save + in_prune:
        try:
            tmp_files[n] = sorted(os.listdir(root / n))
        except OSError:
            pass
    return {"rc": rc, "killed_by": killed_by, "elapsed_s": round(t_end - t_start, 3),
            "landed_in_save": bool(in_save), "landed_in_prune": bool(in_prune), "interrupted_saves": in_save,
            "interrupted_prunes": in_prune, "tmp_files": tmp_files, "saves_started": len(seen_tmp)}


def _short(items: list, n: int = 4) -> str:
    """The first n items of a list, and how many more."""
    items = list(items)
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kills < 0 or args.eval_every < 1 or args.max_steps < 4 * args.eval_every:
        raise SystemExit("kill_resume.py: need --kills >= 0, --eval-every >= 1, --max-steps >= 4 x --eval-every")
    if args.max_steps % args.eval_every:
        raise SystemExit("kill_resume.py: --max-steps must be a multiple of --eval-every")
    own_tmp = args.workdir is None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kill_resume_", dir=shm))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    failures: list[str] = []
    out = lambda *a: None if args.quiet else print(*a, flush=True)  # noqa: E731

    data = prepare_data(args, workdir)
    ref_dir, run_dir, logs = workdir / "reference", workdir / "killed", workdir / "logs"
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    logs.mkdir(exist_ok=True)
    # 1. the reference, uninterrupted, in the background on the second core (threads=1: its numbers do not depend
    #    on the load); it is waited for after the kills.
    out(f"kill_resume: work directory {workdir}")
    ref_log = open(logs / "reference.log", "w")
    ref_proc = subprocess.Popen(command(args, data, ref_dir), stdout=ref_log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t_ref = time.monotonic()
    try:
        return _kill_and_compare(args, data, workdir, logs, ref_dir, run_dir, ref_proc, t_ref, rng, t0,
                                 failures, out, own_tmp)
    finally:
        if ref_proc.poll() is None:  # only on an early exit: the reference is waited for otherwise
            os.killpg(ref_proc.pid, signal.SIGKILL)
            ref_proc.wait()
        ref_log.close()


def _kill_and_compare(args, data, workdir, logs, ref_dir, run_dir, ref_proc, t_ref, rng, t0, failures,
                      out, own_tmp) -> int:
    every, max_steps = args.eval_every, args.max_steps
    # Newest checkpoint a kill-phase attempt may publish: one save (at max_steps - every) must stay ahead, so a
    # targeted kill always has a save to hit and the job never finishes before the last kill.
    guard_step = max_steps - 2 * every

    def reference_failed() -> bool:
        rc = ref_proc.poll()
        return rc is not None and rc not in (0, 1)

    # 2. the kills
    cmd = command(args, data, run_dir)
    attempts: list[dict] = []
    metrics = run_dir / "metrics.jsonl"
    final_rc = None
    reported: set[str] = set()  # damaged directories already reported
    for i in range(args.kills + 1):
        final = i == args.kills
        scan = scan_checkpoints(run_dir / "checkpoints")
        resume_from = scan["auto_pick"]
        if final:
            plan = None
        else:
            u = rng.random()
            # Saves this attempt can still start before the guard: the k-th one must be at most guard_step+every.
            saves_ok = max(1, (guard_step - resume_from) // every + 1)
            if u < args.save_fraction:
                plan = {"mode": "save", "k": rng.randint(1, max(1, min(args.max_save_index, saves_ok)))}
            elif u < args.save_fraction + args.publish_fraction and resume_from + every <= guard_step:
                plan = {"mode": "publish",
                        "k": rng.randint(1, max(1, min(args.max_save_index, (guard_step - resume_from) // every)))}
            else:
                plan = {"mode": "delay", "delay": round(rng.uniform(args.min_delay, args.max_delay), 3)}
        seen = lines_of(metrics)
        log_path = logs / f"attempt_{i:02d}.log"
        # Soft pacing: attempt i may publish up to its linear share of the run plus two evaluation intervals, so
        # that a fast machine does not use up the steps in a few attempts and leave the rest resuming from the
        # same checkpoint (a save past the pace is killed while it is written: one more kill during a save).
        pace = every * (math.ceil((i + 1) / max(args.kills, 1) * guard_step / every) + 2)
        if plan is not None and plan["mode"] in ("save", "publish"):
            pace = max(pace, resume_from + plan["k"] * every)
        res = run_attempt(cmd, run_dir, log_path, plan, None if final else min(pace, guard_step),
                          args.attempt_timeout * (3 if final else 1))
        new = read_new_records(metrics, seen)
        first_step = next((int(r["step"]) for r in new if "loss" in r), None)
        observed = None if first_step is None else first_step - 1
        after = scan_checkpoints(run_dir / "checkpoints")
        log_text = _tail(log_path, 200_000)
        phase = ("save" if res["landed_in_save"] else
                 "publish/prune" if res["landed_in_prune"] or res["killed_by"] == "publish" else
                 "init" if first_step is None else "train/eval")
        row = {"attempt": i, "plan": plan, **res, "resume_from": resume_from, "observed_resume": observed,
               "first_step": first_step, "last_step_logged": max((int(r["step"]) for r in new if "loss" in r),
                                                                  default=None),
               "phase": phase if not final else "finish", "checkpoints_after": after["complete"],
               "partials_after": after["partial"]}
        attempts.append(row)
        problems = []
        if res["killed_by"] == "timeout":
            problems.append(f"attempt {i} hung for {args.attempt_timeout:.0f} s")
        if not final and res["killed_by"] is None:
            problems.append(f"attempt {i} exited on its own (exit {res['rc']}) before its kill")
        if not final and res["killed_by"] is not None and res["rc"] != -signal.SIGKILL:
            problems.append(f"attempt {i} ended with {res['rc']}, not SIGKILL")
        if observed is not None and observed != resume_from:
            problems.append(f"attempt {i} resumed from step {observed}, but the newest complete checkpoint was "
                            f"step {resume_from}" + (" (it started over)" if observed == 0 else ""))
        new_bad = [b for b in after["bad"] + after["other"] if b not in reported]
        reported.update(new_bad)
        if [b for b in new_bad if b in after["bad"]]:
            problems.append(f"after attempt {i}: a step_<N> directory does not verify (a damaged or partial "
                            f"checkpoint under a final name): {[b for b in new_bad if b in after['bad']]}")
        if [b for b in new_bad if b in after["other"]]:
            problems.append(f"after attempt {i}: unexpected entries under checkpoints/: "
                            f"{[b for b in new_bad if b in after['other']]}")
        if after["complete"] and after["auto_pick"] != max(after["complete"]):
            problems.append(f"after attempt {i}: resume=auto would pick step {after['auto_pick']}, the newest "
                            f"verified checkpoint is {max(after['complete'])}")
        if "skipping damaged checkpoint" in log_text:
            problems.append(f"attempt {i} skipped a damaged checkpoint: see {log_path}")
        if "Traceback" in log_text or "scaletrain: error" in log_text:
            problems.append(f"attempt {i} raised an error before it was killed:\n{_tail(log_path)}")
        if final:
            final_rc = res["rc"]
            if res["rc"] not in (0, 1):
                problems.append(f"final attempt exited {res['rc']}:\n{_tail(log_path)}")
        failures += problems
        what = "finish" if final else (
            f"{plan['mode']}" + (f" {plan['delay']:.2f}s" if plan["mode"] == "delay" else f" #{plan['k']}"))
        out(f"  attempt {i:2d}: {what:14s} -> {res['killed_by'] or 'exit ' + str(res['rc']):8s} "
            f"after {res['elapsed_s']:5.2f} s in {row['phase']:13s} resumed from {resume_from:3d}"
            f" (observed {observed if observed is not None else '-'}); checkpoints {after['complete']}"
            + (f" partial {after['partial']}" if after["partial"] else "")
            + ("  <-- " + "; ".join(p.splitlines()[0] for p in problems) if problems else ""))
        if res["killed_by"] == "timeout" or (not final and res["killed_by"] is None):
            break  # the schedule cannot go on
        if reference_failed():
            print(f"kill_resume: the uninterrupted run failed (exit {ref_proc.returncode}):\n"
                  f"{_tail(logs / 'reference.log')}", file=sys.stderr)
            return 2

    try:
        ref_rc = ref_proc.wait(timeout=args.attempt_timeout * 3)
    except subprocess.TimeoutExpired:
        os.killpg(ref_proc.pid, signal.SIGKILL)
        ref_rc = ref_proc.wait()
    ref_result_path = ref_dir / "result.json"
    ref_time = (ref_result_path.stat().st_mtime - time.time() + time.monotonic() - t_ref
                if ref_result_path.is_file() else time.monotonic() - t_ref)
    if ref_rc not in (0, 1) or not ref_result_path.is_file():
        print(f"kill_resume: the uninterrupted run failed (exit {ref_rc}):\n{_tail(logs / 'reference.log')}",
              file=sys.stderr)
        return 2
    ref_result = json.loads(ref_result_path.read_text())
    out(f"kill_resume: reference: exit {ref_rc}, {ref_result['status']}, {ref_result['steps']} steps "
        f"in {ref_time:.1f} s")
    if final_rc != ref_rc:
        failures.append(f"the killed run finally exited {final_rc}, the uninterrupted one {ref_rc}")

    # 3. the comparison
    result_path = run_dir / "result.json"
    compare: dict = {}
    if not result_path.is_file():
        failures.append("the killed run has no result.json")
    else:
        result = json.loads(result_path.read_text())
        compare["status"] = (result["status"], ref_result["status"])
        compare["steps"] = (result["steps"], ref_result["steps"])
        if result["status"] != ref_result["status"] or result["steps"] != ref_result["steps"]:
            failures.append(f"result: {result['status']} after {result['steps']} steps, reference "
                            f"{ref_result['status']} after {ref_result['steps']}")
        ev, ev_ref = result["evals"], ref_result["evals"]
        if [e["step"] for e in ev] != [e["step"] for e in ev_ref]:
            failures.append(f"evaluation steps differ: {_short([e['step'] for e in ev])} vs "
                            f"{_short([e['step'] for e in ev_ref])}")
        # Bitwise: JSON round-trips a float exactly.
        diffs = [f"step {a['step']} {key} {a.get(key)!r} != {b.get(key)!r}" for a, b in zip(ev, ev_ref)
                 for key in ("eval_loss", "train_loss", "lr") if a.get(key) != b.get(key)]
        if diffs:
            failures.append(f"result.json evals differ from the reference's in {len(diffs)} values: {_short(diffs)}")
        compare["evals"] = len(ev)
        compare["evals_differing"] = len(diffs)
        if not (result.get("time_to_train_s") or 0) > 0:
            failures.append(f"time_to_train_s is {result.get('time_to_train_s')}")
        compare["time_to_train_s"] = (result.get("time_to_train_s"), ref_result.get("time_to_train_s"))
    recs, torn = read_records(metrics)
    ref_recs, _ = read_records(ref_dir / "metrics.jsonl")
    steps, ref_steps = last_per_step(recs, "loss"), last_per_step(ref_recs, "loss")
    evals, ref_evals = last_per_step(recs, "eval_loss"), last_per_step(ref_recs, "eval_loss")
    compare["metrics_steps"] = len(steps)
    compare["torn_metrics_lines"] = torn
    if sorted(steps) != sorted(ref_steps):
        failures.append(f"metrics.jsonl steps differ: missing {_short(sorted(set(ref_steps) - set(steps)))}, "
                        f"extra {_short(sorted(set(steps) - set(ref_steps)))}")
    diffs = [f"step {s} {key} {steps[s].get(key)!r} != {ref_steps[s].get(key)!r}"
             for s in sorted(set(steps) & set(ref_steps)) for key in ("loss", "lr", "grad_norm")
             if steps[s].get(key) != ref_steps[s].get(key)]
    compare["metrics_values_differing"] = len(diffs)
    if diffs:
        failures.append(f"metrics.jsonl training lines differ from the reference's in {len(diffs)} values: "
                        f"{_short(diffs)}")
    if {s: r["eval_loss"] for s, r in evals.items()} != {s: r["eval_loss"] for s, r in ref_evals.items()}:
        failures.append("metrics.jsonl evaluation losses differ from the reference's")
    relogged = sum(1 for r in recs if "loss" in r) - len(steps)
    compare["relogged_steps"] = relogged
    if relogged or torn:
        # A resume cuts metrics.jsonl back to its checkpoint's step: the lost attempt's lines must be gone.
        failures.append(f"metrics.jsonl has {relogged} re-logged step lines and {torn} torn lines (want each step "
                        f"once)")
    mllog = run_dir / "mllog.txt"
    if mllog.is_file():
        text = mllog.read_text()
        n_start, n_stop = text.count('"key": "run_start"'), text.count('"key": "run_stop"')
        compare["run_start"], compare["run_stop"] = n_start, n_stop
        if (n_start, n_stop) != (1, 1):
            failures.append(f"mllog.txt has {n_start} run_start and {n_stop} run_stop events (want 1 and 1)")
        from scaletrain.bench.checker import check_log
        verdict = check_log(mllog, "gpt3-proxy")
        compare["mllog_checker_ok"] = verdict.ok
        if not verdict.ok:
            failures.append(f"MLLOG checker failed on {mllog}:\n{verdict.output[-2000:]}")
    else:
        failures.append("the killed run has no mllog.txt")

    # 4. report
    killed = [a for a in attempts if a["killed_by"] not in (None, "timeout") and a["phase"] != "finish"]
    restarts = attempts[1:]
    resumed: dict[int, int] = {}
    for a in restarts:
        resumed[a["resume_from"]] = resumed.get(a["resume_from"], 0) + 1
    summary = {
        "ok": not failures,
        "failures": failures,
        "kills": len(killed),
        "kills_requested": args.kills,
        "kills_during_save": sum(a["landed_in_save"] for a in killed),
        "kills_during_prune": sum(a["landed_in_prune"] for a in killed),
        "kills_targeted_at_save": sum(a["plan"]["mode"] == "save" for a in killed),
        "kills_by_trigger": {k: sum(a["killed_by"] == k for a in killed) for k in ("delay", "save", "publish",
                                                                                   "guard")},
        "kills_by_phase": {k: sum(a["phase"] == k for a in killed) for k in ("init", "train/eval", "save",
                                                                            "publish/prune")},
        "restarts": len(restarts),
        "restarts_resumed_from": {str(k): v for k, v in sorted(resumed.items())},
        "restarts_from_checkpoint": sum(a["resume_from"] > 0 for a in restarts),
        "restarts_resume_observed": sum(a["observed_resume"] is not None for a in restarts),
        "compare": compare,
        "reference_s": round(ref_time, 2),
        "total_s": round(time.monotonic() - t0, 2),
        "seed": args.seed, "max_steps": max_steps, "eval_every": every,
        "workdir": str(workdir),
        "attempts": attempts,
    }
    _print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if failures:
        print("kill_resume: FAILED\n  " + "\n  ".join(failures) + f"\n  (runs kept in {workdir})", file=sys.stderr)
        return 1
    print(f"kill_resume: OK ({summary['kills']} kills, {summary['kills_during_save']} during a save; final losses "
          f"bitwise equal to the uninterrupted run) in {summary['total_s']:.0f} s")
    if own_tmp and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=120) if not sys.stdout.isatty() else Console()
    table = Table(title="kill/resume attempts")
    for col in ("#", "plan", "killed by", "after s", "phase", "resumed from", "observed", "steps logged",
                "checkpoints after", "partial left"):
        table.add_column(col, justify="right" if col in ("#", "after s", "resumed from", "observed") else "left")
    for a in s["attempts"]:
        plan = a["plan"]
        what = "-" if plan is None else (f"delay {plan['delay']:.2f}s" if plan["mode"] == "delay"
                                        else f"{plan['mode']} #{plan['k']}")
        logged = "-" if a["first_step"] is None else f"{a['first_step']}-{a['last_step_logged']}"
        table.add_row(str(a["attempt"]), what, a["killed_by"] or f"exit {a['rc']}", f"{a['elapsed_s']:.2f}",
                      a["phase"], str(a["resume_from"]), "-" if a["observed_resume"] is None
                      else str(a["observed_resume"]), logged, ",".join(map(str, a["checkpoints_after"])),
                      ",".join(n[5:13].lstrip("0") + ".tmp" for n in a["partials_after"]))
    console.print(table)
    c = s["compare"]
    console.print(f"kills: {s['kills']} of {s['kills_requested']} (by trigger {s['kills_by_trigger']}; by phase "
                  f"{s['kills_by_phase']}); landed during a save: {s['kills_during_save']}, during pruning: "
                  f"{s['kills_during_prune']}")
    console.print(f"restarts: {s['restarts']}, resumed from step -> count {s['restarts_resumed_from']} "
                  f"({s['restarts_from_checkpoint']} from a checkpoint, {s['restarts_resume_observed']} confirmed "
                  f"by their first logged step)")
    console.print(f"final: status/steps {c.get('status')} / {c.get('steps')}, {c.get('evals')} evals, "
                  f"{c.get('metrics_steps')} steps compared bitwise, {c.get('relogged_steps')} re-logged steps, "
                  f"run_start/run_stop {c.get('run_start')}/{c.get('run_stop')}, checker ok {c.get('mllog_checker_ok')}"
                  f", time to train {c.get('time_to_train_s')}")
    console.print(f"time: reference {s['reference_s']:.1f} s, total {s['total_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
