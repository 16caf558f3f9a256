"""Weak and strong scaling of training throughput on 1, 2 and 4 ranks (gloo on CPU, NCCL on GPU).

Strong scaling keeps the global batch fixed and splits it over more ranks; weak scaling keeps the per-rank
batch fixed, so the global batch grows with the ranks. Each point is a torchrun launch of this file in worker
mode: the gpt3-proxy model (4 layers, d256, seq 256) is built for the layout, warmed up (untimed, as in an MLPerf
run), then `--steps` optimizer steps are timed; the median step time gives tokens/s. Prints a table and writes
benchmarks/results/scaling.json.

    python benchmarks/scaling.py [--ranks 1 2 4] [--layouts fsdp ddp tp] [--steps 8]

On the 2-core CI box 2 and 4 ranks share two cores (threads per rank = cores / ranks), so the numbers show the
overhead of splitting a fixed amount of compute, not a speed-up; on a GPU node each rank has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "scaling.json"
LAYOUTS = {
    "fsdp": lambda n: [],
    "ddp": lambda n: [f"parallel.dp_replicate={n}", "parallel.dp_shard=1"],
    "tp": lambda n: [f"parallel.tp={n}", "parallel.dp_shard=1"],
    "pp": lambda n: [f"parallel.pp={n}", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b"],
}


def worker(args) -> None:
    """One measurement on this torchrun rank; rank 0 prints a JSON line."""
    import torch.distributed as dist

    from scaletrain.config import resolve
    from scaletrain.train.engine import Trainer
    cfg = resolve("gpt3-proxy", overrides=json.loads(args.overrides))
    with tempfile.TemporaryDirectory() as run_dir:
        cfg.train.run_dir = run_dir
        trainer = Trainer(cfg, run_dir)
        trainer.init()
        times = [trainer.train_step()["step_time_s"] for _ in range(args.steps)]
        mem = trainer.train_step()["peak_mem_gib"]
        trainer.finish({})
    if not dist.is_initialized() or dist.get_rank() == 0:
        step = statistics.median(times)
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        print("RESULT " + json.dumps({"step_time_s": step, "tokens_per_s": tokens / step,
                                      "layout": trainer.layout.describe(), "peak_mem_gib_rank0": mem}))


def measure(n: int, layout: str, gbs: int, mbs: int, steps: int, data: list[str], threads: int) -> dict:
    over = [*data, f"train.global_batch_size={gbs}", f"train.micro_batch_size={mbs}", f"train.threads={threads}",
            "train.progress=false", *LAYOUTS[layout](n)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
           "--worker", "--steps", str(steps), "--overrides", json.dumps(over)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{layout} x{n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _data(tmp: str) -> list[str]:
    from scaletrain.data.corpus import default_or_excerpt
    return default_or_excerpt(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layouts", nargs="+", default=["fsdp", "ddp", "tp"], choices=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per point (median taken)")
    ap.add_argument("--global-batch", type=int, default=32, help="strong scaling: fixed global batch")
    ap.add_argument("--per-rank-batch", type=int, default=8, help="weak scaling: fixed batch per data-parallel rank")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="CPU cores shared by the ranks")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from rich.console import Console
    from rich.table import Table
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = _data(tmp)
        for layout in args.layouts:
            # Weak scaling grows the data-parallel batch; for tp/pp (one data-parallel rank) it equals strong.
            for mode in ("strong", "weak") if layout in ("fsdp", "ddp") else ("strong",):
                base = None
                for n in args.ranks:
                    dp = n if layout in ("fsdp", "ddp") else 1
                    gbs = args.global_batch if mode == "strong" else args.per_rank_batch * dp
                    mbs = min(args.micro_batch, gbs // dp)
                    if layout == "pp" and n > 1:
                        mbs = max(1, gbs // (2 * n))  # at least 2 micro-batches per stage keeps 1F1B busy
                    r = measure(n, layout, gbs, mbs, args.steps, data, args.cores)
                    base = base or (r["tokens_per_s"], n)
                    speedup = r["tokens_per_s"] / base[0]
                    rows.append({"layout": layout, "mode": mode, "ranks": n, "global_batch": gbs,
                                 "micro_batch": mbs, "tokens_per_s": r["tokens_per_s"],
                                 "step_time_s": r["step_time_s"], "speedup": speedup,
                                 # Ideal is linear in ranks (each rank its own device): tokens/s x n.
                                 "efficiency": speedup / (n / base[1]),
                                 "peak_mem_gib_rank0": r["peak_mem_gib_rank0"], "layout_desc": r["layout"]})
                    print(json.dumps(rows[-1]), flush=True)

    table = Table(title="scaling (gpt3-proxy, tokens/s; efficiency vs ideal linear)")
    for col in ("layout", "mode", "ranks", "GBS", "mbs", "tokens/s", "step s", "speed-up", "efficiency",
                "peak GiB r0"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["layout"], r["mode"], str(r["ranks"]), str(r["global_batch"]), str(r["micro_batch"]),
                      f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s']:.3f}", f"{r['speedup']:.2f}x",
                      f"{r['efficiency']:.0%}", f"{r['peak_mem_gib_rank0']:.2f}")
    Console(width=120).print(table)
    import torch
    out = {"benchmark": "scaling", "model": "gpt3-proxy", "cores": args.cores, "steps": args.steps,
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "note": "ranks share the cores; efficiency < 100% on CPU measures parallel overhead, not speed-up",
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
