"""Checkpoint I/O on CPU: save/load throughput of a ~1.2 GB checkpoint, and what async saving costs a training step.

The model is the gpt3 architecture at 12 layers, d768, 12 heads, seq 256, vocab 8192 (91.5M parameters, GPT-3
Small's body with a small vocabulary). Its checkpoint holds fp32 parameters (4 B/param) and AdamW's exp_avg and
exp_avg_sq (8 B/param), ~12 B/param, plus the tied embedding/head weight and its optimizer state filed a second
time under the head's name (see scaletrain.checkpoint.checkpointer); the exact byte count is taken from the
manifest of the files written. GB/s below = checkpoint bytes / seconds, with GB = 1e9 bytes.

    python benchmarks/checkpoint_io.py [--repeats 3] [--baseline-steps 3] [--micro-batch 4] [--dir DIR]
                                       [--wait-quiet 600]

Takes about 2.5 minutes on an idle 2-core machine. On a shared box, --wait-quiet S waits before each measurement
(up to S seconds in all) until other processes leave the cores idle: they slow CPU training several-fold and
swamp the effect measured. Every measurement records how busy the rest of the machine was meanwhile.

One process, one Trainer (bf16 autocast, 2 threads, micro-batch 4 x 256 tokens, data from the packaged excerpt
tokenized at vocab 8192). `trainer.init()` and two training steps come first, so AdamW's moments exist. Then:

1. Checkpoint I/O, with training idle. Each measurement is repeated `--repeats` times; the median is reported.
   - sync save: wall time of `Checkpointer.save()` from call to published directory: state dict, sidecars,
     DCP write with fsync, sha256 of every file (read back), manifest, atomic rename, directory fsyncs.
     The table splits it into the DCP write (incl. fsync) and the hashing.
   - async save: `save()` with checkpoint.async_save=True returns after building the state dict, writing the
     small sidecars and staging (a blocking copy of every tensor into fresh CPU memory); "blocked" is that
     time. `finish()` is then called at once; "total" is the time from the save() call until finish() has
     published. The hash and publish run in finish(), on the caller's thread.
   - load: `Checkpointer.find(path)` (verification: sha256 of every file, or only presence and sizes with
     checkpoint.verify="size") followed by `Checkpointer.load()` into the live model and optimizer.
     The checkpoint was just written, so "warm" loads read from the page cache. Dropping the whole page cache
     needs root; instead the "cold" rows evict this checkpoint's own pages with posix_fadvise(DONTNEED), which
     any user may do for clean pages of a file it can open (checked with util-linux `fincore` when present).
     On a virtual machine the host may still cache the disk, so "cold" is an upper bound on disk speed.
   Checkpoints are written into a temporary directory under /tmp unless --dir is given; the filesystem is
   reported. checkpoint.keep=0 and old checkpoints are deleted by this script outside the timed regions.

2. Step-time cost of async saving, `--repeats` rounds of: `--baseline-steps` plain steps; an async save via
   `trainer.save_checkpoint({})`, then training steps until the background write has completed, then
   `trainer.checkpointer.finish()` (timed: it hashes and publishes on the training thread); one plain step;
   a sync save (timed: training is stopped for all of it).
   Reported (medians over rounds): the step time without a save in flight; the first step after save()
   returned (the write is in flight for all of it) and all steps taken until the write was done, each against
   the baseline in s and %; how long the background write took while training ran (vs idle, from section 1);
   the training time lost to one async checkpoint = blocked in save() + sum over those steps of
   (step time - baseline) + finish(); and to one sync checkpoint = its whole wall time. The step during which
   the write finishes is only partly overlapped, so it is counted whole: the write's cost is all in there.

On CPU, the background writer competes with training for the same 2 cores (and the GIL, and memory bandwidth
for the staging copy and the page-cache copy), so the overlapped steps are slower; on a GPU node training runs
on the accelerator and the writer only needs host CPU. Other processes on the machine disturb all of this;
the CPU time the rest of the machine used during each measurement is recorded ("other cores busy") so a noisy
run can be recognised.

Memory state matters on a VM: this one (Firecracker, free page reporting) hands memory freed for a few seconds
back to the host, and touching it again is slow (high system time). A save needs ~1.2 GB of fresh memory (page
cache, and the staging copy for async), so a save right after another one (reusing just-freed pages) was
measured up to 2x faster than one after a pause. Every timed save therefore starts after `--pause` idle seconds
(default 3), like checkpoints that are minutes apart in a real run.

Prints two tables and writes benchmarks/results/checkpoint_io.json with every raw timing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"
GB = 1e9


# ---------------------------------------------------------------- machine helpers

def filesystem_of(path: Path) -> dict:
    """Mount point, filesystem type and device holding `path` (longest matching mount in /proc/mounts)."""
    path = Path(path).resolve()
    best = {"mount": "?", "fstype": "?", "device": "?"}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        dev, mnt, fstype = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
            best, best_len = {"mount": mnt, "fstype": fstype, "device": dev}, len(mnt)
    return best


class CpuMeter:
    """CPU time the rest of the machine used over an interval, in cores (from /proc/stat minus this process)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._machine_busy(), self._own()

    @staticmethod
    def _machine_busy() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def other_cores(self) -> float:
        dt = time.perf_counter() - self.t0
        other = (self._machine_busy() - self.busy0) - (self._own() - self.own0)
        return max(0.0, other / dt) if dt > 0 else float("nan")


def wait_quiet(max_wait_s: float, threshold: float = 0.25, window_s: float = 3.0) -> float:
    """Wait (up to max_wait_s) until other processes use under `threshold` cores; returns the last reading."""
    t0, last_note = time.perf_counter(), None
    while True:
        meter = CpuMeter()
        time.sleep(window_s)
        other = meter.other_cores()
        if other < threshold or time.perf_counter() - t0 >= max_wait_s:
            return other
        if last_note is None or time.perf_counter() - last_note >= 60:
            print(f"  machine busy ({other:.2f} other cores); waiting for it to quiet down", flush=True)
            last_note = time.perf_counter()


class Quiet:
    """Before each measurement, wait for a quiet machine, spending at most `budget_s` seconds in all (0: never)."""

    def __init__(self, budget_s: float):
        self.left = budget_s
        self.waited = 0.0

    def settle(self) -> float | None:
        if self.left <= 0:
            return None
        t = time.perf_counter()
        other = wait_quiet(self.left)
        spent = time.perf_counter() - t
        self.left -= spent
        self.waited += spent
        return other


def cached_fraction(directory: Path) -> float | None:
    """Fraction of the checkpoint's bytes in the page cache (util-linux fincore), None when unavailable."""
    if shutil.which("fincore") is None:
        return None
    files = [p for p in Path(directory).iterdir() if p.is_file()]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                              *map(str, files)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    res = size = 0
    for line in out.split("\n"):
        if line.strip():
            r, s = line.split()
            res, size = res + int(r), size + int(s)
    return res / size if size else None


def evict(directory: Path) -> None:
    """Ask the kernel to drop this checkpoint's (clean, fsynced) pages from the page cache."""
    for p in Path(directory).iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------- instrumentation

class Phases:
    """Times store.hash_files (the sha256 pass of _publish) and, while `sync_write` is active, dcp.save.

    Wraps module attributes that Checkpointer looks up at call time; restores them on close(). The async writer
    thread calls DCP's internal save function directly, so only sync saves are split this way.
    """

    def __init__(self):
        import torch.distributed.checkpoint as dcp

        from scaletrain.checkpoint import store
        self.hash_s: list[float] = []
        self.write_s: list[float] = []
        self._store, self._dcp = store, dcp
        self._hash_orig, self._save_orig = store.hash_files, dcp.save

        def hash_files(*a, **k):
            t = time.perf_counter()
            try:
                return self._hash_orig(*a, **k)
            finally:
                self.hash_s.append(time.perf_counter() - t)
        store.hash_files = hash_files

    @contextlib.contextmanager
    def sync_write(self):
        def save(*a, **k):
            t = time.perf_counter()
            try:
                return self._save_orig(*a, **k)
            finally:
                self.write_s.append(time.perf_counter() - t)
        self._dcp.save = save
        try:
            yield
        finally:
            self._dcp.save = self._save_orig

    def close(self) -> None:
        self._store.hash_files = self._hash_orig
        self._dcp.save = self._save_orig


def pending_future(ck):
    """The Future of the async save in flight (Checkpointer keeps it in _pending[0]; private, read-only use)."""
    pending = getattr(ck, "_pending", None)
    return pending[0] if pending else None


def checkpoint_bytes(path: Path) -> tuple[int, dict]:
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    files = {name: meta["bytes"] for name, meta in manifest["files"].items()}
    files["manifest.json"] = (Path(path) / "manifest.json").stat().st_size
    return sum(files.values()), files


def drop_older(root: Path, keep: Path | None = None) -> None:
    """Untimed cleanup: remove every checkpoint under root except `keep`."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- measurements

def build_trainer(args, work: Path):
    from scaletrain.checkpoint.checkpointer import Checkpointer
    from scaletrain.config import resolve
    from scaletrain.data.corpus import prepare_excerpt
    from scaletrain.train.engine import Trainer
    corpus = prepare_excerpt(work / "excerpt", args.vocab)  # the excerpt trains an 8192-piece tokenizer fine
    mbs = args.micro_batch
    over = [f"data.train_prefix={corpus.train_prefix}", f"data.valid_prefix={corpus.valid_prefix}",
            f"data.tokenizer={corpus.tokenizer}", f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
            f"model.n_heads={args.heads}", f"model.seq_len={args.seq}", f"model.vocab_size={args.vocab}",
            f"train.global_batch_size={mbs}", f"train.micro_batch_size={mbs}", "train.dtype=bf16",
            f"train.threads={args.threads}", "train.progress=false", f"train.run_dir={work / 'run'}",
            "checkpoint.keep=0", "checkpoint.async_save=true", f"checkpoint.dir={work / 'ck_async'}"]
    cfg = resolve("gpt3-proxy", overrides=over)
    trainer = Trainer(cfg, work / "run")
    cfg_sync = copy.deepcopy(cfg)
    cfg_sync.checkpoint.async_save = False
    cfg_sync.checkpoint.dir = str(work / "ck_sync")
    sync_ck = Checkpointer(cfg_sync, work / "run")
    cfg_size = copy.deepcopy(cfg_sync)
    cfg_size.checkpoint.verify = "size"
    size_ck = Checkpointer(cfg_size, work / "run")  # same root as sync_ck; only used to find/load
    return cfg, trainer, trainer.checkpointer, sync_ck, size_ck


def io_phase(args, trainer, async_ck, sync_ck, size_ck, phases: Phases, quiet: Quiet) -> tuple[dict, Path]:
    """Section 1: save/load timings with training idle."""
    from scaletrain.checkpoint.checkpointer import trainer_state
    parts, opts = trainer.pm.parts, trainer.optimizers
    state = trainer_state(trainer.step, trainer.cfg, trainer.layout, {})
    out = {"sync_save": [], "async_save": [], "load": {}}
    latest = None
    for i in range(args.repeats):
        step = 1000 + i
        quiet.settle()
        meter = CpuMeter()
        # sync: call to published
        time.sleep(args.pause)
        n_hash, n_write = len(phases.hash_s), len(phases.write_s)
        with phases.sync_write():
            t0 = time.perf_counter()
            latest = sync_ck.save(step, parts, opts, {**state, "step": step})
            wall = time.perf_counter() - t0
        out["sync_save"].append({"wall_s": wall, "dcp_write_fsync_s": sum(phases.write_s[n_write:]),
                                 "sha256_s": sum(phases.hash_s[n_hash:])})
        drop_older(sync_ck.root, keep=latest)
        # async: blocked in save(), then finish() at once
        time.sleep(args.pause)
        n_hash = len(phases.hash_s)
        done = []
        t0 = time.perf_counter()
        final = async_ck.save(step, parts, opts, {**state, "step": step})
        blocked = time.perf_counter() - t0
        cpu0 = CpuMeter._own()
        fut = pending_future(async_ck)
        if fut is not None:
            fut.add_done_callback(lambda _f: done.append((time.perf_counter(), CpuMeter._own())))
        async_ck.finish()
        total = time.perf_counter() - t0
        # While finish() waits on the future this thread sleeps, so the process's CPU time in between is the
        # background writer's (DCP torch.save()s each tensor, CRC32 included, and fsyncs).
        out["async_save"].append({"blocked_in_save_s": blocked,
                                  "background_write_done_s": (done[0][0] - t0) if done else None,
                                  "writer_cpu_s": (done[0][1] - cpu0) if done else None,
                                  "total_to_published_s": total, "sha256_s": sum(phases.hash_s[n_hash:])})
        out["sync_save"][-1]["other_cores_busy"] = out["async_save"][-1]["other_cores_busy"] = meter.other_cores()
        assert (final / "manifest.json").is_file(), f"{final} was not published"
        drop_older(async_ck.root)
        print(f"  save {i + 1}/{args.repeats}: sync {wall:.2f}s, async blocked {blocked:.2f}s / total {total:.2f}s",
              flush=True)

    def load(ck, cold: bool) -> dict:
        meter = CpuMeter()
        if cold:
            evict(latest)
        cached = cached_fraction(latest)
        t0 = time.perf_counter()
        found = ck.find(str(latest))
        t1 = time.perf_counter()
        ck.load(found, parts, opts)
        t2 = time.perf_counter()
        return {"verify_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "cached_fraction_before": cached,
                "other_cores_busy": meter.other_cores()}

    modes = [("sha256_warm", sync_ck, False), ("size_warm", size_ck, False), ("sha256_cold", sync_ck, True),
             ("size_cold", size_ck, True)]
    for name, ck, cold in modes:
        quiet.settle()
        out["load"][name] = [load(ck, cold) for _ in range(args.repeats)]
        print(f"  load {name}: " + ", ".join(f"{r['total_s']:.2f}s" for r in out["load"][name]), flush=True)
    return out, latest


def training_phase(args, trainer, async_ck, sync_ck, quiet: Quiet) -> dict:
    """Section 2: step times without a save, with an async save in flight, and a sync save's stall."""
    out = {"baseline_step_s": [], "rounds": []}
    trainer.train_step()  # untimed: the loads above replaced the optimizer's tensors
    for r in range(args.repeats):
        quiet.settle()
        meter = CpuMeter()
        base = [trainer.train_step()["step_time_s"] for _ in range(args.baseline_steps)]
        out["baseline_step_s"].extend(base)
        # async save, then train until the background write is done
        time.sleep(args.pause)
        trainer.checkpointer = async_ck
        done = []
        t0 = time.perf_counter()
        trainer.save_checkpoint({})
        blocked = time.perf_counter() - t0
        fut = pending_future(async_ck)
        if fut is not None:
            fut.add_done_callback(lambda _f: done.append(time.perf_counter()))
        overlap = []
        while fut is not None and not fut.done() and len(overlap) < args.max_overlap_steps:
            overlap.append(trainer.train_step()["step_time_s"])
        t1 = time.perf_counter()
        trainer.checkpointer.finish()
        finish_s = time.perf_counter() - t1
        write_done = (done[0] - t0) if done else None
        after = trainer.train_step()["step_time_s"]
        drop_older(async_ck.root)
        # sync save: training stops for all of it
        time.sleep(args.pause)
        trainer.checkpointer = sync_ck
        t0 = time.perf_counter()
        trainer.save_checkpoint({})
        sync_s = time.perf_counter() - t0
        drop_older(sync_ck.root)
        trainer.checkpointer = async_ck
        out["rounds"].append({"baseline_step_s": base, "async_blocked_in_save_s": blocked,
                              "overlapped_step_s": overlap, "background_write_done_s": write_done,
                              "finish_s": finish_s, "step_after_publish_s": after, "sync_save_s": sync_s,
                              "other_cores_busy": meter.other_cores()})
        print(f"  round {r + 1}/{args.repeats}: base {med(base):.2f}s, async blocked {blocked:.2f}s, "
              f"{len(overlap)} overlapped steps {[round(x, 2) for x in overlap]}, finish {finish_s:.2f}s, "
              f"sync save {sync_s:.2f}s; {out['rounds'][-1]['other_cores_busy']:.2f} other cores busy", flush=True)
    return out


def summarize(nbytes: int, io: dict, tr: dict) -> dict:
    s = {}
    sync = [x["wall_s"] for x in io["sync_save"]]
    s["sync_save"] = {"median_s": med(sync), "GB_per_s": nbytes / GB / med(sync),
                      "dcp_write_fsync_median_s": med([x["dcp_write_fsync_s"] for x in io["sync_save"]]),
                      "sha256_median_s": med([x["sha256_s"] for x in io["sync_save"]])}
    blocked = [x["blocked_in_save_s"] for x in io["async_save"]]
    total = [x["total_to_published_s"] for x in io["async_save"]]
    s["async_save"] = {"blocked_median_s": med(blocked), "staging_GB_per_s": nbytes / GB / med(blocked),
                       "total_median_s": med(total), "GB_per_s": nbytes / GB / med(total),
                       "sha256_median_s": med([x["sha256_s"] for x in io["async_save"]]),
                       "background_write_median_s": med([x["background_write_done_s"] - x["blocked_in_save_s"]
                                                         for x in io["async_save"] if x["background_write_done_s"]]),
                       "writer_cpu_median_s": med([x["writer_cpu_s"] for x in io["async_save"]
                                                   if x["writer_cpu_s"] is not None])}
    s["load"] = {}
    for name, runs in io["load"].items():
        t = med([x["total_s"] for x in runs])
        s["load"][name] = {"median_s": t, "GB_per_s": nbytes / GB / t,
                           "verify_median_s": med([x["verify_s"] for x in runs]),
                           "load_median_s": med([x["load_s"] for x in runs])}
    base = med(tr["baseline_step_s"])
    rounds = tr["rounds"]
    first = [r["overlapped_step_s"][0] for r in rounds if r["overlapped_step_s"]]
    n_over = [len(r["overlapped_step_s"]) for r in rounds]
    over_sum = [sum(r["overlapped_step_s"]) for r in rounds]
    over_extra = [t - n * base for t, n in zip(over_sum, n_over)]
    over_pct = [100 * (t / (n * base) - 1) for t, n in zip(over_sum, n_over) if n]
    costs = [r["async_blocked_in_save_s"] + x + r["finish_s"] for r, x in zip(rounds, over_extra)]
    sync_stall = med([r["sync_save_s"] for r in rounds])
    s["training"] = {
        "baseline_step_median_s": base,
        "first_step_after_async_save_median_s": med(first),
        "first_step_overhead_s": med(first) - base,
        "first_step_overhead_pct": 100 * (med(first) / base - 1),
        "steps_with_write_in_flight_per_save": n_over,
        "steps_with_write_in_flight_total_s": over_sum,
        "steps_with_write_in_flight_total_median_s": med(over_sum),
        "overlap_extra_median_s": med(over_extra),
        "overlap_extra_median_pct": med(over_pct),
        "background_write_while_training_median_s": med([r["background_write_done_s"] - r["async_blocked_in_save_s"]
                                                          for r in rounds if r["background_write_done_s"]]),
        "async_blocked_in_save_median_s": med([r["async_blocked_in_save_s"] for r in tr["rounds"]]),
        "async_finish_median_s": med([r["finish_s"] for r in tr["rounds"]]),
        "async_cost_per_checkpoint_s": costs,
        "async_cost_per_checkpoint_median_s": med(costs),
        "sync_cost_per_checkpoint_median_s": sync_stall,
        "async_cost_in_steps": med(costs) / base,
        "sync_cost_in_steps": sync_stall / base,
    }
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4, help="also the global batch (one micro-batch a step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each I/O measurement and training rounds")
    ap.add_argument("--baseline-steps", type=int, default=3, help="plain steps per training round")
    ap.add_argument("--pause", type=float, default=3.0, metavar="S",
                    help="untimed idle seconds before every timed save, so each starts from the same memory state")
    ap.add_argument("--max-overlap-steps", type=int, default=20, help="safety cap on steps with a save in flight")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each measurement wait for other processes to leave the cores idle, "
                         "up to S seconds in all")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the scratch directory (default: system tmp)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    quiet = Quiet(args.wait_quiet)
    quiet_start = quiet.settle()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="checkpoint_io_", dir=args.dir) as tmp:
        work = Path(tmp)
        fs = filesystem_of(work)
        cfg, trainer, async_ck, sync_ck, size_ck = build_trainer(args, work)
        t = time.perf_counter()
        trainer.init()
        init_s = time.perf_counter() - t
        warm = [trainer.train_step()["step_time_s"] for _ in range(2)]  # creates AdamW's moments
        n_params = sum(p.numel() for part in trainer.pm.parts for p in part.parameters())
        print(f"model {args.layers}L d{args.d_model} vocab {args.vocab}: {n_params:,} params; init {init_s:.1f}s, "
              f"warm-up steps {[round(x, 2) for x in warm]}; scratch {work} on {fs['fstype']} ({fs['device']})",
              flush=True)
        phases = Phases()
        try:
            io, latest = io_phase(args, trainer, async_ck, sync_ck, size_ck, phases, quiet)
            nbytes, files = checkpoint_bytes(latest)
            tr = training_phase(args, trainer, async_ck, sync_ck, quiet)
        finally:
            phases.close()
        trainer.finish({})
    elapsed = time.perf_counter() - t_start
    s = summarize(nbytes, io, tr)

    import resource
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    m = cfg.model
    console = Console(width=120)
    t1 = Table(title=f"checkpoint I/O: {nbytes / GB:.3f} GB ({n_params / 1e6:.1f}M params, fp32 + AdamW), "
                     f"{fs['fstype']} at {fs['mount']}, median of {args.repeats}")
    for col in ("operation", "median s", "GB/s", "runs s", "of which"):
        t1.add_column(col, justify="right" if col not in ("operation", "of which") else "left")

    def runs(xs):
        return " ".join(f"{x:.2f}" for x in xs)
    ss, sa = s["sync_save"], s["async_save"]
    t1.add_row("sync save (to published)", f"{ss['median_s']:.2f}", f"{ss['GB_per_s']:.2f}",
               runs([x["wall_s"] for x in io["sync_save"]]),
               f"DCP write+fsync {ss['dcp_write_fsync_median_s']:.2f}s, sha256 {ss['sha256_median_s']:.2f}s")
    t1.add_row("async save: blocked in save()", f"{sa['blocked_median_s']:.2f}", f"{sa['staging_GB_per_s']:.2f}",
               runs([x["blocked_in_save_s"] for x in io["async_save"]]), "state dict, sidecars, staging copy")
    t1.add_row("async save: total to published", f"{sa['total_median_s']:.2f}", f"{sa['GB_per_s']:.2f}",
               runs([x["total_to_published_s"] for x in io["async_save"]]),
               f"background write {sa['background_write_median_s']:.2f}s using "
               f"{sa['writer_cpu_median_s']:.2f} CPU-s; sha256 in finish() {sa['sha256_median_s']:.2f}s")
    for name, label in (("sha256_warm", "load, verify sha256 (warm)"), ("size_warm", "load, verify size (warm)"),
                        ("sha256_cold", "load, verify sha256 (evicted)"), ("size_cold", "load, verify size (evicted)")):
        ls = s["load"][name]
        cached = [x["cached_fraction_before"] for x in io["load"][name]]
        note = f"verify {ls['verify_median_s']:.2f}s + load {ls['load_median_s']:.2f}s"
        if cached[0] is not None:
            note += f"; cached before: {min(cached):.0%}-{max(cached):.0%}"
        t1.add_row(label, f"{ls['median_s']:.2f}", f"{ls['GB_per_s']:.2f}", runs([x["total_s"] for x in
                                                                                 io["load"][name]]), note)
    console.print(t1)

    st = s["training"]
    t2 = Table(title=f"step-time cost of checkpointing, micro-batch {args.micro_batch} x seq {args.seq}, bf16, "
                     f"{args.threads} threads, {args.repeats} rounds")
    for col in ("", "seconds", "vs baseline"):
        t2.add_column(col, justify="left" if not col else "right")
    base = st["baseline_step_median_s"]
    t2.add_row("step, no save in flight (median)", f"{base:.2f}", "")
    t2.add_row("first step after async save() returned (write in flight)",
               f"{st['first_step_after_async_save_median_s']:.2f}",
               f"{st['first_step_overhead_s']:+.2f}s ({st['first_step_overhead_pct']:+.0f}%)")
    n_over = "/".join(str(n) for n in st["steps_with_write_in_flight_per_save"])
    t2.add_row(f"all steps until the write was done ({n_over} steps per save; total)",
               f"{st['steps_with_write_in_flight_total_median_s']:.2f}",
               f"{st['overlap_extra_median_s']:+.2f}s ({st['overlap_extra_median_pct']:+.0f}%)")
    t2.add_row("async: background write during training (idle: %.2f)" % s["async_save"]["background_write_median_s"],
               f"{st['background_write_while_training_median_s']:.2f}", "")
    t2.add_row("async: blocked in save() (staging)", f"{st['async_blocked_in_save_median_s']:.2f}", "")
    t2.add_row("async: finish() (sha256 + publish)", f"{st['async_finish_median_s']:.2f}", "")
    t2.add_row("async: training time lost per checkpoint", f"{st['async_cost_per_checkpoint_median_s']:.2f}",
               f"{st['async_cost_in_steps']:.1f} steps")
    t2.add_row("sync: training time lost per checkpoint", f"{st['sync_cost_per_checkpoint_median_s']:.2f}",
               f"{st['sync_cost_in_steps']:.1f} steps")
    console.print(t2)
    # The worst reading over the timed measurements of each phase (waits for quiet excluded).
    io_other = max([x["other_cores_busy"] for x in io["sync_save"]] +
                   [x["other_cores_busy"] for runs_ in io["load"].values() for x in runs_])
    tr_other = max(r["other_cores_busy"] for r in tr["rounds"])
    noisy = max(io_other, tr_other) > 0.25
    print(f"other processes kept up to {io_other:.2f} (I/O phase) and {tr_other:.2f} (training phase) of "
          f"{os.cpu_count()} cores busy{' -- NOISY: timings are disturbed' if noisy else ''}; "
          f"peak RSS {peak_rss_gib:.1f} GiB; total {elapsed:.0f}s (of which {quiet.waited:.0f}s waiting for quiet)")

    result = {
        "benchmark": "checkpoint_io", "torch": torch.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "filesystem": fs, "scratch_parent": str(args.dir or tempfile.gettempdir()),
        "model": {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "seq_len": m.seq_len,
                  "vocab_size": m.vocab_size, "padded_vocab": m.padded_vocab, "params": n_params},
        "train": {"micro_batch": args.micro_batch, "global_batch": args.micro_batch, "dtype": "bf16",
                  "threads": args.threads, "data": "packaged excerpt, tokenizer vocab %d" % args.vocab},
        "checkpoint_bytes": nbytes, "checkpoint_files": files, "bytes_12_per_param": 12 * n_params,
        "repeats": args.repeats, "baseline_steps_per_round": args.baseline_steps, "pause_s": args.pause,
        "init_s": init_s, "warmup_step_s": warm,
        "other_cores_busy": {"before_start": quiet_start, "io_phase_max": io_other, "training_phase_max": tr_other},
        "waited_for_quiet_s": quiet.waited,
        "peak_rss_gib": peak_rss_gib, "elapsed_s": elapsed,
        "io": io, "training": tr, "summary": s,
        "notes": [
            "GB = 1e9 bytes; GB/s = checkpoint_bytes / median seconds",
            "warm loads read the just-written checkpoint from the page cache; 'cold' loads first evict its pages "
            "with posix_fadvise(DONTNEED) (no root needed); a VM host may still cache the disk",
            "async 'blocked' = time save() holds the training thread (staging copy); 'total' = save() call to "
            "published by finish() called immediately",
            "training time lost per async checkpoint = blocked + sum(overlapped step - baseline median) + finish()",
            "on CPU the background writer shares the same cores with training",
            "every timed save starts after --pause idle seconds (this VM returns freed memory to the host after "
            "~2 s, and re-touching it is slow)",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
