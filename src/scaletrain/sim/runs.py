"""scaletrain's own training runs read back for calibration (`scaletrain sim calibrate RUN_DIR...`).

A run directory says what ran in files, not in display strings: `config.json` (the resolved trainer config) and
the step records of `metrics.jsonl` (`step_time_s`, `world_size`, and `gpu`, the catalog key of the device the
MFU was priced on). The config and world size go through the trainer's layout adapter
(`parallel/sim_layout.sim_inputs`, handed in by the CLI because sim/ may not import parallel/), so a default FSDP
run (`parallel.dp_shard=-1`) is priced as ZeRO-3 exactly as `train --dry-run` and `predict --from-config` price it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from scaletrain.config import Config, from_dict
from scaletrain.sim.calibrate import _golden
from scaletrain.sim.catalog import Catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import GENERATION, efficiency_for
from scaletrain.sim.run_prediction import steady_median
from scaletrain.sim.step import step_time
from scaletrain.sim.workload import ClusterLayout, Workload

SimInputs = Callable[[Config, int], tuple[Workload, ClusterLayout]]
"""(config, world size) -> the simulator's inputs: `scaletrain.parallel.sim_layout.sim_inputs`."""


@dataclass(frozen=True)
class MeasuredRun:
    """One run directory in the simulator's terms."""

    path: str
    gpu: str
    """Catalog key of the GPU it ran on."""
    world_size: int
    workload: Workload
    layout: ClusterLayout
    step_time_s: float
    """Median step time past the first third of the timed steps (warm-up)."""


def read_run(run_dir: str | Path, sim_inputs: SimInputs, gpu: str | None = None) -> MeasuredRun:
    """A run directory's config, world size, GPU and measured step time; `gpu` overrides the recorded one.

    Raises FileNotFoundError for a directory that is not a run, ValueError for one that cannot be priced.
    """
    run = Path(run_dir)
    cfg_path, metrics_path = run / "config.json", run / "metrics.jsonl"
    for path in (cfg_path, metrics_path):
        if not path.is_file():
            raise FileNotFoundError(f"{run}: no {path.name} (not a scaletrain run directory)")
    cfg = from_dict(json.loads(cfg_path.read_text()))
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if '"step_time_s"' in line]
    if len(records) < 3:
        raise ValueError(f"{metrics_path}: fewer than 3 timed steps")
    last = records[-1]
    key = gpu or last.get("gpu")
    if not key:
        raise ValueError(f"{run}: ran on a device the catalog does not know (CPU?); pass --gpu to name it")
    world = last.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{metrics_path}: the step records carry no world_size (a run from an older scaletrain)")
    measured = steady_median([r["step_time_s"] for r in records])
    w, layout = sim_inputs(cfg, world)
    return MeasuredRun(str(run), str(key), world, w, layout, measured)


def calibrate_runs(runs: list[MeasuredRun], base: str | None, cat: Catalog) -> dict:
    """Fit gemm_eff (and, if needed, the per-step overhead) per GPU generation so the simulator's step time matches
    the runs' measured step times; {"measured/<generation>": efficiency dict}. Prints one line per set."""
    groups: dict[str, list] = {}
    for r in runs:
        g, n, f = cat.system(r.gpu)
        groups.setdefault(GENERATION.get(g.key, g.key), []).append(
            (r.workload, r.layout, Cluster(g, n, f, r.world_size), r.step_time_s)
        )
    out = {}
    for gen, group in groups.items():
        _, eff = efficiency_for(base, group[0][2].gpu.key)

        def err(e, group=group):
            return sum(math.log(step_time(w, lay, cl, e).step_time_s / m) ** 2 for w, lay, cl, m in group)

        # GEMM efficiency first; the per-step overhead fitted at MLPerf scale (thousands of GPUs) can exceed a
        # small run's whole step, so it is refitted too when the efficiency alone cannot match the measurement.
        for name, lo, hi in (
            ("gemm_eff", 0.05, 3.0),
            ("step_overhead_s", 0.0, eff.step_overhead_s),
            ("gemm_eff", 0.05, 3.0),
        ):
            if name == "step_overhead_s" and math.sqrt(err(eff) / len(group)) < 0.01:
                continue
            x = _golden(lambda v, n=name, eff=eff: err(replace(eff, **{n: v})), lo, hi, getattr(eff, name), iters=40)
            eff = replace(eff, **{name: x})
        out[f"measured/{gen}"] = eff.to_dict()
        print(
            f"measured/{gen}: gemm_eff {eff.gemm_eff:.3f}, step_overhead_s {eff.step_overhead_s:.4f} from "
            f"{len(group)} run(s); RMS log error {math.sqrt(err(eff) / len(group)):.4f}"
        )
    return out
