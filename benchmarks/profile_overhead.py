"""Profiling overhead: CPU time per train_step with and without a train.profile_steps trace, and the trace's size.

One process trains one model and alternates windows of steps without and with a StepProfiler trace (the loop's
own hook), so both halves see the same machine. It counts CPU time (time.process_time), not wall time: on a shared
machine other processes move wall times by far more than the profiler does. The export after each traced window
is counted separately. `--model tiny` is the 2-layer d64 test model on the packaged excerpt (seconds);
`--model proxy` the gpt3-proxy preset on the default corpus (`scaletrain data fetch`; about a minute).

    python3 benchmarks/profile_overhead.py [--model tiny|proxy] [--windows 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scaletrain.config import TrainConfig, resolve
from scaletrain.train.engine import Trainer
from scaletrain.train.profiling import StepProfiler

TINY = [
    "model.vocab_size=1024",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "proxy"), default="tiny")
    ap.add_argument("--windows", type=int, default=8, help="windows of each kind (plain, profiled)")
    ap.add_argument("--steps", type=int, default=4, help="steps per window")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="profile_overhead_"))
    overrides = ["train.threads=1", "train.progress=false", "train.max_steps=100000", f"train.run_dir={tmp}/run"]
    if args.model == "tiny":
        from scaletrain.data.corpus import prepare_excerpt

        corpus = prepare_excerpt(tmp / "excerpt", 1024)
        data = [f"data.train_prefix={corpus.train_prefix}", f"data.valid_prefix={corpus.valid_prefix}"]
        overrides += [*TINY, *data, f"data.tokenizer={corpus.tokenizer}"]
    cfg = resolve("gpt3-proxy", overrides=overrides)
    engine = Trainer(cfg, tmp / "run")
    engine.init()
    if engine.metrics is not None:
        engine.metrics.close()  # the measurement, not metrics.jsonl, is the output
        engine.metrics = None
    cpu: dict[str, list[float]] = {"plain": [], "profiled": []}
    export, size = [], 0
    for w in range(args.windows):
        for kind in cpu:
            first, last = engine.step + 1, engine.step + args.steps
            steps = f"{first}-{last}" if kind == "profiled" else ""
            prof = StepProfiler(TrainConfig(profile_steps=steps), tmp / f"window{w}")
            for n in range(first, last + 1):
                t0 = time.process_time()
                with prof.step(n):
                    engine.train_step()
                    t1 = time.process_time()
                cpu[kind].append(t1 - t0)
                if prof.files:
                    export.append(time.process_time() - t1)
                    size = prof.files[0].stat().st_size
    plain, profiled = statistics.median(cpu["plain"]), statistics.median(cpu["profiled"])
    print(
        f"{args.model}: median CPU time per step {plain * 1e3:.1f} ms plain, {profiled * 1e3:.1f} ms profiled "
        f"({100 * (profiled / plain - 1):+.1f}%); export {statistics.median(export):.2f} s CPU; trace "
        f"{size / 1e6:.1f} MB for {args.steps} steps ({args.windows} windows of {args.steps} steps each)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
