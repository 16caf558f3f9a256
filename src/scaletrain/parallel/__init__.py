"""Parallel layouts applied to the plain model from outside: TP/SP, CP, activation checkpointing, FSDP/DDP, PP.

`layout.py` checks the degrees and builds the DeviceMesh that is passed around (never global); `parallelize.py`
applies the layers in order; `dry_run.py` builds the real sharded model on a fake process group to read per-rank
memory. Layer 3: may import `config`, `log`, `benchmarks`, `sim`, `data`, `model` and torch; never `checkpoint`,
`train`, `bench` or `cli`. This file imports nothing.
"""
