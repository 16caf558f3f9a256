"""`scaletrain sim calibrate`'s two modes that fit on measurements rather than published rows: RUN_DIR...
(scaletrain's own runs, `sim/run_fit.py`) and --layer-timings (one GPU's per-layer timings, `calibrate.py`)."""

from __future__ import annotations

import json
from pathlib import Path

from scaletrain.config_io import read_text_file
from scaletrain.sim import calibrate as cal
from scaletrain.sim.efficiency import efficiency_for


def calibrate_from_runs(args, inputs, cat) -> dict:
    """RUN_DIR... [--held-out RUN_DIR...]: fit on the runs' measured breakdowns, print the terms and the scores."""
    from scaletrain.sim.run_fit import calibrate_runs, report_lines
    from scaletrain.sim.runs import read_run

    runs = [read_run(d, inputs, cat, args.gpu) for d in args.run_dirs]
    held = [read_run(d, inputs, cat, args.gpu) for d in args.held_out or []]
    doc = calibrate_runs(runs, held, args.calibration)
    print("\n".join(report_lines(doc)))
    return doc


def calibrate_layer_timings(args, cat) -> dict:
    """--layer-timings: measured GEMM curve and ceilings -> catalog override TOML; gemm_eff (and the per-step
    overhead) -> the efficiency set "measured/<generation>"."""
    from scaletrain.sim.efficiency import GENERATION

    where = f"--layer-timings {args.layer_timings}"
    try:
        doc = json.loads(read_text_file(args.layer_timings, where, error=ValueError))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a JSON object (benchmarks/gpu_mfu.py's), got {type(doc).__name__}")
    key = args.gpu or doc.get("layer_timings", doc).get("gpu")
    base = efficiency_for(args.calibration, cat.gpu(key).key)[1] if key else None
    fit = cal.fit_layer_timings(doc, cat, args.gpu, base)
    rep, eff = fit["report"], fit["efficiency"]
    for b in rep["blocks"]:
        print(
            f"block {b['model']} {' '.join(b['set'])} mbs{b['mbs']}{' fp8' if b['fp8'] else ''}: measured "
            f"{1000 * b['measured_s']:.2f} ms, shipped model {1000 * b['shipped_s']:.2f} ms, "
            f"fitted {1000 * b['fitted_s']:.2f} ms"
        )
    print(
        f"measured/{GENERATION.get(fit['gpu'], fit['gpu'])}: gemm_eff {eff.gemm_eff:.3f}, step_overhead_s "
        f"{eff.step_overhead_s:.4f}; catalog fields {', '.join(fit['catalog']) or 'none'}"
    )
    toml = cal.catalog_toml(fit["gpu"], fit["catalog"], Path(args.layer_timings).name)
    cat_out = args.catalog_out or (str(Path(args.out).with_suffix(".toml")) if args.out else None)
    if cat_out:
        Path(cat_out).write_text(toml)
        print(f"wrote {cat_out}; use it with --catalog {cat_out} (or SCALETRAIN_CATALOG={cat_out})")
    else:
        print(toml)
    return {"sets": {f"measured/{GENERATION.get(fit['gpu'], fit['gpu'])}": eff.to_dict()}, "layer_timings": rep}
