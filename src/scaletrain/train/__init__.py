"""Training: the one training loop (loop.py: step, evaluate, stop, checkpoint, resume), its state (state.py) and
schedule of evaluations (schedule.py), the Engine protocol and Observer hooks (protocol.py), the per-run engine
(engine.py: model parts, optimizer, data, step, eval, checkpoint), process-group setup (distributed.py), gradient
clipping (grad_norm.py), the optimizer and LR rule (optim.py), metrics and the live view (metrics.py, console.py),
run-directory integrity (rundir.py), stop signals (signals.py), CPU host settings (host.py), loss plots (report.py)
and the `scaletrain train` entry point (run.py).

Layer 5: may import `config`, `log`, `benchmarks`, `sim`, `data`, `model`, `parallel` and `checkpoint`; never
`bench` (which sits above and observes the loop) or `cli`. This file imports nothing.
"""
