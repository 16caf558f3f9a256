"""The performance model calibrated on some layouts of a real run and scored on layouts it never saw (CPU, gloo).

Trains the gpt3-proxy model (4 layers, d256, seq 256, global batch 16) for a few steps in eight layouts on 1, 2
and 4 ranks: single, DDP, FSDP, TP, PP and their 4-rank combinations. Each is a `scaletrain train` launch (under
`torchrun` for more than one rank) whose run directory holds config.json, prediction.json (the simulator's
uncalibrated forecast, with the CPU's GEMM rate and memory bandwidth measured at start-up) and metrics.jsonl (the
measured step breakdown). Then `scaletrain sim calibrate` fits the efficiency terms on the "fit" half and predicts
the "held-out" half (`--held-out`); the table shows the prior and the calibrated prediction of every layout beside
its measurement, and benchmarks/results/cpu_calibration.json keeps the rows and the fitted terms.

    python3 benchmarks/cpu_calibration.py [--steps 8] [--keep DIR] [--reuse DIR]

About 3 minutes on the 2-core CI machine (each rank gets cores / ranks threads, so 4 ranks share 2 cores). On a GPU
node the same script measures GPU layouts (`--launcher` runs each under your torchrun/srun line).
`--reuse DIR` refits run directories a previous `--keep DIR` left, without training again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_calibration.json"
# A 0.3 s window per device figure (rather than 30 ms): a steadier reading of the host the whole table rests on.
BASE = ["train.global_batch_size=16", "train.micro_batch_size=8", "train.eval_interval_samples=1000000",
        "train.progress=false", "train.probe_window_s=0.3"]
# name -> (ranks, overrides, half): the fit half spans every term the calibration fits (GEMMs at two shape classes,
# FSDP and TP communication whose waits are all measured, the per-step overhead); the held-out half recombines them
# and adds DDP's overlapped all-reduce and pipelining, which no fitted run has: the simulator's structure must
# predict those on its own.
LAYOUTS = {
    "single": (1, [], "fit"),
    "fsdp2": (2, [], "fit"),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"], "fit"),
    "fsdp4": (4, ["train.micro_batch_size=4"], "fit"),
    "ddp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], "held-out"),
    "pp2": (2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b", "train.micro_batch_size=4"],
            "held-out"),
    "ddp2_tp2": (4, ["parallel.dp_replicate=2", "parallel.tp=2", "parallel.dp_shard=1"], "held-out"),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b",
                    "train.micro_batch_size=4"], "held-out"),
}


def train(name: str, run_dir: Path, steps: int, data: list[str], cores: int, launcher: str) -> None:
    """One `scaletrain train` run of layout `name` into `run_dir`; raises with the log's tail when it fails."""
    ranks, over, _ = LAYOUTS[name]
    sets = [*data, *BASE, f"train.max_steps={steps}", f"train.threads={cores}", f"train.run_dir={run_dir}", *over]
    args = [a for s in sets for a in ("--set", s)]
    if ranks == 1:
        cmd = [sys.executable, "-m", "scaletrain", "train", "--preset", "gpt3-proxy", *args]
    else:
        cmd = [*shlex.split(launcher.format(n=ranks, python=sys.executable)), "-m", "scaletrain", "train",
               "--preset", "gpt3-proxy", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode or not (run_dir / "prediction.json").is_file():
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def _data(tmp: str) -> list[str]:
    from scaletrain.data.corpus import default_or_excerpt
    return default_or_excerpt(tmp)


def calibrate(runs: Path, out: Path) -> dict:
    """`scaletrain sim calibrate FIT... --held-out HELD... --out` on the run directories; its JSON."""
    fit = [str(runs / n) for n, (_, _, half) in LAYOUTS.items() if half == "fit"]
    held = [a for n, (_, _, half) in LAYOUTS.items() if half == "held-out" for a in ("--held-out", str(runs / n))]
    cmd = [sys.executable, "-m", "scaletrain", "sim", "calibrate", *fit, *held, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print("".join(line for line in proc.stdout.splitlines(keepends=True) if not line.startswith("wrote ")), end="")
    if proc.returncode:
        raise RuntimeError(f"sim calibrate failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per layout (the first third is warm-up)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="CPU cores shared by the ranks")
    ap.add_argument("--keep", type=Path, help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--reuse", type=Path, help="refit the run directories of an earlier --keep; trains nothing")
    ap.add_argument("--launcher", default="{python} -m torch.distributed.run --standalone --nproc_per_node {n}",
                    help="command that starts N ranks ({n}, {python} are filled in)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error(f"--steps {args.steps}: at least 4 (the first third is warm-up)")
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.reuse or args.keep or Path(tmp) / "runs"
        if not args.reuse:
            data = _data(tmp)
            for name in LAYOUTS:
                print(f"training {name} ...", flush=True)
                train(name, runs / name, args.steps, data, args.cores, args.launcher)
        doc = calibrate(runs, Path(tmp) / "fit.json")
    import torch
    out = {"benchmark": "cpu_calibration", "model": "gpt3-proxy", "steps": args.steps, "cores": args.cores,
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "layouts": {n: {"ranks": r, "overrides": o, "half": h} for n, (r, o, h) in LAYOUTS.items()}, **doc}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    shown = os.path.relpath(args.out) if not os.path.relpath(args.out).startswith("..") else str(args.out)
    print(f"wrote {shown} (an efficiency file too: SCALETRAIN_EFFICIENCY={shown} prices later CPU runs with "
          "the fitted set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
