"""`scaletrain sim calibrate`'s two modes that fit on measurements rather than published rows: RUN_DIR...
(scaletrain's own runs, `sim/fit/run_fit.py`) and --layer-timings (one GPU's per-layer timings, `calibrate.py`)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config_io import FileFormatError, load_json_bounded
from scaletrain.sim.efficiency import efficiency_for
from scaletrain.sim.fit import layer_timings


def calibrate_from_runs(args, inputs, cat) -> dict:
    """RUN_DIR... [--held-out RUN_DIR...]: fit on the runs' measured breakdowns, print the terms and the scores."""
    from scaletrain.sim.fit.run_fit import calibrate_runs, report_lines
    from scaletrain.sim.fit.runs import read_run

    runs = [read_run(d, inputs, cat, args.gpu) for d in args.run_dirs]
    held = [read_run(d, inputs, cat, args.gpu) for d in args.held_out or []]
    doc = calibrate_runs(runs, held, args.calibration, cat)
    print("\n".join(report_lines(doc)))
    return doc


def calibrate_layer_timings(args, cat) -> dict:
    """--layer-timings: measured GEMM curve and ceilings -> catalog override TOML; gemm_eff (and the per-step
    overhead) -> the efficiency set "measured/<generation>"."""
    path = args.layer_timings
    doc = load_json_bounded(path)
    timings = doc.get("layer_timings", doc) if isinstance(doc, dict) else None
    if not isinstance(timings, dict):
        raise FileFormatError(f"{path}: not a layer-timings file (a JSON object, or one with a 'layer_timings' object)")
    key = args.gpu or timings.get("gpu")
    if key is not None and not isinstance(key, str):
        raise FileFormatError(f"{path}: gpu={key!r} must be a catalog GPU name")
    base = efficiency_for(args.calibration, cat.gpu(key).key, catalog=cat)[1] if key else None
    try:
        fit = layer_timings.fit_layer_timings(doc, cat, args.gpu, base)
    except (KeyError, TypeError, AttributeError, ArithmeticError) as exc:  # an entry of the wrong shape
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0] if str(exc) else ""
        raise FileFormatError(f"{path}: not a layer-timings file ({type(exc).__name__}: {what})") from None
    rep, eff = fit["report"], fit["efficiency"]
    set_name = f"measured/{cat.gpu(fit['gpu']).generation}"
    for b in rep["blocks"]:
        print(
            f"block {b['model']} {' '.join(b['set'])} mbs{b['mbs']}{' fp8' if b['fp8'] else ''}: measured "
            f"{1000 * b['measured_s']:.2f} ms, shipped model {1000 * b['shipped_s']:.2f} ms, "
            f"fitted {1000 * b['fitted_s']:.2f} ms"
        )
    print(
        f"{set_name}: gemm_eff {eff.gemm_eff:.3f}, step_overhead_s "
        f"{eff.step_overhead_s:.4f}; catalog fields {', '.join(fit['catalog']) or 'none'}"
    )
    toml = layer_timings.catalog_toml(fit["gpu"], fit["catalog"], Path(args.layer_timings).name)
    cat_out = args.catalog_out or (str(Path(args.out).with_suffix(".toml")) if args.out else None)
    if cat_out:
        Path(cat_out).write_text(toml)
        print(f"wrote {cat_out}; use it with --catalog {cat_out} (or SCALETRAIN_CATALOG={cat_out})")
    else:
        print(toml)
    return {"sets": {set_name: eff.to_dict()}, "layer_timings": rep}
