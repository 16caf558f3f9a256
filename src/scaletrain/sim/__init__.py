"""Analytical performance model and planner: step time, memory and MLPerf time-to-train for GPU clusters.

Pure Python (no torch at import): `workload` turns the trainer's model config into shapes and FLOPs, `catalog`
holds hardware, `compute`/`comm`/`schedule`/`memory` price one step, `mlperf` turns steps into time-to-train,
and `plan` searches layouts. This package is the pricing model only: fitting it to published results and to
scaletrain's own runs is `sim.fit` (above it), and its commands are `cli/sim.py`.

Layer 1: may import `config`, `log` and `benchmarks` only; never torch, nor `model`, `data`, `parallel`,
`checkpoint`, `train` or `bench`, so predictions run anywhere (the CLI imports it without torch for
`scaletrain predict`/`plan`). The layers above import it: the trainer and the dry run price memory with it.
"""
