"""Training: the per-run engine (engine.py: model parts, optimizer, data, step, eval, checkpoint), process-group
setup (distributed.py), gradient clipping (grad_norm.py), the optimizer and LR rule (optim.py), metrics and the
live view (metrics.py, console.py), run-directory integrity (rundir.py), stop signals (signals.py), CPU host
settings (host.py), loss plots (report.py) and the `scaletrain train`/`bench` entry points (run.py).

May import `config`, `data`, `model`, `parallel` and `checkpoint`. Target direction (issue 13): `bench/` sits above
`train/` and is never imported from here; today engine.py (NonFiniteLoss) and run.py (the harness) still reach up
into `bench/`, which the loop move of issue 13 removes. This file imports nothing.
"""
