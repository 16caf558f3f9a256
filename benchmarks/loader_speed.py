"""Loader speed: tokens/s that TrainSamples.batch() delivers alone (no model), at random global positions.

Uses the default corpus if it has been fetched (`scaletrain data fetch`), else builds the packaged
excerpt in a temporary directory. Prints a table and writes benchmarks/results/loader_speed.json.

    python benchmarks/loader_speed.py [--data-dir DIR] [--seconds 2] [--micro-batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import DataConfig, default_data_dir
from scaletrain.data.corpus import default_paths, prepare_excerpt
from scaletrain.data.prepare import load_dataset
from scaletrain.data.samples import TrainSamples, measure_loader_tokens_per_s

RESULTS = Path(__file__).resolve().parent / "results" / "loader_speed.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir",
                    help="where the default corpus was fetched (default: $SCALETRAIN_DATA or ~/.cache/scaletrain)")
    ap.add_argument("--seconds", type=float, default=2.0, help="measuring time per configuration")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    corpus = default_paths(default_data_dir(DataConfig(data_dir=args.data_dir or "")))
    tmp = None
    if corpus.exists():
        source = "default corpus"
    else:
        # The excerpt keeps the benchmark runnable offline; its 128k tokens fit one seq-2048 epoch of ~60 samples.
        tmp = tempfile.TemporaryDirectory(prefix="scaletrain-loader-")
        corpus = prepare_excerpt(tmp.name, vocab_size=2048)
        source = "packaged excerpt"
    ds = load_dataset(corpus.train_prefix)

    rows = []
    for seq_len in args.seq_lens:
        samples = TrainSamples(ds, seq_len, seed=1234)
        tps = measure_loader_tokens_per_s(samples, args.micro_batch, args.seconds)
        rows.append({"seq_len": seq_len, "micro_batch": args.micro_batch, "samples_per_epoch": samples.num_samples,
                     "tokens_per_s": tps, "batches_per_s": tps / (seq_len * args.micro_batch)})

    print(f"loader speed on the {source} ({ds.num_tokens:,} tokens, {ds.dtype}), TrainSamples.batch alone")
    print(f"{'seq_len':>8} {'micro':>6} {'samples/epoch':>14} {'tokens/s':>14} {'batches/s':>10}")
    for r in rows:
        print(f"{r['seq_len']:>8} {r['micro_batch']:>6} {r['samples_per_epoch']:>14,} "
              f"{r['tokens_per_s']:>14,.0f} {r['batches_per_s']:>10,.0f}")

    result = {
        "benchmark": "loader_speed",
        "what": "TrainSamples.batch() input tokens/s at random global positions (int64 tensors, labels included)",
        "source": source,
        "train_prefix": str(corpus.train_prefix) if tmp is None else "<excerpt in a temporary directory>",
        "num_tokens": ds.num_tokens,
        "seconds_per_config": args.seconds,
        "rows": rows,
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                    "cpus": os.cpu_count()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
