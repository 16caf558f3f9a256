"""Fitting the pricing model to measurements, and scoring it: the calibration side of the simulator.

`results` and `rows` read published MLPerf results (the calibration CSVs) as simulator inputs, `calibrate` fits the
free efficiency scalars on them and `validate` scores the fit out of sample (leave-one-out, scale split).
`run_files`, `runs` and `run_fit` do the same for scaletrain's own run directories (metrics.jsonl, prediction.json).

Layer 1.5: above the pricing model (`scaletrain.sim`, which never imports this package), torch-free like it; it may
import `config`, `log`, `benchmarks` and `sim`, nothing above.
"""
