"""Smoke check of a fresh install: what the README's first command must make work, with nothing else installed.

.ci/run runs it right after `pip install -e .` alone (torch first), before any extra: a module the package imports
but does not declare fails here as it would for a new user. It runs the real `scaletrain` command:
`--version`; `--help` of every subcommand; `data fetch --tokenizer bpe --excerpt` (tokenizers); a 2-step training
run of a tiny fp32 model on that data; and `plan`, whose best layout is FP8 and must print its `run:` line
(torchao). Usage: python3 scripts/smoke_install.py. Exit 0 when all pass, else 1 with what failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaletrain.cli.main import build_parser, subcommand_parsers


def scaletrain(*args: str) -> str:
    """Run `python -m scaletrain ARGS`; its stdout, or SystemExit with the command and its stderr's tail."""
    proc = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"FAIL scaletrain {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    t0 = time.monotonic()
    print(scaletrain("--version").strip())
    paths = [path for path, _ in subcommand_parsers(build_parser())]
    for path in paths:
        scaletrain(*path, "--help")
    print(f"--help of {len(paths)} subcommands: ok")
    with tempfile.TemporaryDirectory() as tmp:
        scaletrain("data", "fetch", "--tokenizer", "bpe", "--excerpt", "--vocab-size", "1024", "--data-dir", tmp)
        data = Path(tmp) / "shakespeare-bpe"
        print("data fetch --tokenizer bpe --excerpt: ok")
        run = Path(tmp) / "run"
        tiny = [
            f"data.train_prefix={data / 'train'}",
            f"data.valid_prefix={data / 'valid'}",
            f"data.tokenizer={data / 'tokenizer.json'}",
            "model.vocab_size=1024",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            "model.seq_len=64",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            "train.dtype=fp32",
            "train.max_steps=2",
            "train.target_eval_loss=0.1",
            "train.progress=false",
            f"train.run_dir={run}",
        ]
        scaletrain("train", *(a for o in tiny for a in ("--set", o)))
        result = json.loads((run / "result.json").read_text())
        if result.get("steps") != 2:
            raise SystemExit(f"FAIL the 2-step run: result.json {result}")
        print(f"train, 2 steps: ok ({result['outcome']})")
    out = scaletrain("plan", "--model", "llama2-70b-lora", "--gpus", "8", "--top", "1")
    if "run: scaletrain train" not in out or "not runnable" in out:
        raise SystemExit(f"FAIL plan: no run line for its best layout\n{out}")
    print("plan (FP8 best layout): ok")
    print(f"install smoke check passed in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
