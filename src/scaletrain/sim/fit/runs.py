"""scaletrain's own training runs read back for calibration (`scaletrain sim calibrate RUN_DIR...`).

A run directory says what ran in files, not in display strings: `config.json` (the resolved trainer config),
`prediction.json` (the device the run measured or recognised, `train/perf.py`) and the step records of
`metrics.jsonl` (`step_time_s`, `world_size`, the measured breakdown `run_prediction.MEASURED_KEYS`, and for runs
that predate prediction.json `gpu`, the catalog key of the device). The config and world size go through the
trainer's layout adapter (`parallel/sim_layout.sim_inputs`, a parameter: `cli/sim.py` passes it, because sim/ may
not import parallel/), so a default FSDP run (`parallel.dp_shard=-1`) is priced as ZeRO-3 exactly as `train --dry-run` and
`predict --from-config` price it. A CPU run is priced on the CPU its prediction.json recorded
(`host_device.cpu_system`: its own measured GEMM rate and bandwidth), a GPU run on its catalog entry.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import Config, ConfigError, from_dict
from scaletrain.config_io import FileFormatError
from scaletrain.sim.catalog import Catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fit.run_files import read_config_table, read_metrics, read_prediction
from scaletrain.sim.gemm_classes import run_gemm_gflop
from scaletrain.sim.host_device import CPU_KEY, cpu_system
from scaletrain.sim.run_prediction import MEASURED_KEYS, SIM_TO_MEASURED, steady_median
from scaletrain.sim.step import StepResult, step_time
from scaletrain.sim.workload import ClusterLayout, Workload

SimInputs = Callable[[Config, int], tuple[Workload, ClusterLayout]]
"""(config, world size) -> the simulator's inputs: `scaletrain.parallel.sim_layout.sim_inputs`."""

COMM_TERMS = tuple(t for t, key in SIM_TO_MEASURED.items() if key == "comm_exposed_s")
"""Step-model terms a rank spends blocked in collectives or point-to-point transfers, which the trainer measures as
comm_exposed_s (`run_prediction.SIM_TO_MEASURED`)."""
COMPUTE_TERMS = tuple(t for t, key in SIM_TO_MEASURED.items() if key == "fwd_bwd_s")
"""Step-model terms of busy forward/backward time: fwd_bwd_s - comm_exposed_s."""


@dataclass(frozen=True)
class MeasuredRun:
    """One run directory in the simulator's terms."""

    path: str
    gpu: str
    """Catalog key of the GPU it ran on, or "cpu"."""
    group: str
    """Efficiency group it is fitted in: the GPU generation ("hopper"), or "cpu"."""
    world_size: int
    workload: Workload
    layout: ClusterLayout
    cluster: Cluster
    step_time_s: float
    """Median step time past the first third of the timed steps (warm-up)."""
    parts: dict | None
    """Median of each measured breakdown key (MEASURED_KEYS) over the same steps; None for a run without them."""
    prior_step_s: float | None
    """The step time the run's own prediction.json forecast (None without one)."""
    gemm_gflop: float
    """The run's GEMM shape (`gemm_classes.run_gemm_gflop`)."""

    @property
    def name(self) -> str:
        """The run directory's name."""
        return Path(self.path).name

    @property
    def symmetric(self) -> bool:
        """Every rank does the same work, so rank 0's breakdown is the step's (not so with pipeline stages)."""
        return self.layout.pp == 1

    @property
    def comm_observable(self) -> bool:
        """Its collectives' waits are all measured: not so under DDP, whose gradient all-reduces are waited for in
        C++ (`train/perf.py`), so they stay in its busy time."""
        return not (self.layout.dp > 1 and self.layout.zero == 0)

    def measured(self) -> dict:
        """{"step", "busy", "compute", "comm", "optimizer", "other"} measured seconds (only "step" without a
        breakdown): busy = forward/backward = compute + comm."""
        out = {"step": self.step_time_s}
        if self.parts:
            p = self.parts
            out.update(
                busy=p["fwd_bwd_s"],
                compute=p["fwd_bwd_s"] - p["comm_exposed_s"],
                comm=p["comm_exposed_s"],
                optimizer=p["optimizer_s"],
                other=p["data_s"] + p["other_s"],
            )
        return out


def predicted(st: StepResult) -> dict:
    """`MeasuredRun.measured`'s keys from a step-model result."""
    b = st.breakdown
    compute = sum(b.get(k, 0.0) for k in COMPUTE_TERMS)
    comm = sum(b.get(k, 0.0) for k in COMM_TERMS)
    return {
        "step": st.step_time_s,
        "busy": compute + comm,
        "compute": compute,
        "comm": comm,
        "optimizer": b.get("optimizer", 0.0),
        "other": b.get("overhead", 0.0),
    }


def price(run: MeasuredRun, eff: Efficiency) -> StepResult:
    """The step model for `run` with `eff`."""
    return step_time(run.workload, run.layout, run.cluster, eff)


def _device(run: Path, prediction: dict | None, last: dict, gpu: str | None, cat: Catalog):
    """(key, group, (GPU, Node, Fabric)) of the device a run used."""
    device = (prediction or {}).get("device") or {}
    key: str | None
    if gpu:
        key = gpu
    elif device.get("kind") == "cpu":
        try:
            return CPU_KEY, CPU_KEY, cpu_system(device)
        except ValueError as exc:
            raise ValueError(f"{run / 'prediction.json'}: {exc}") from None
    else:
        key = device.get("catalog_key") or last.get("gpu")
    if not key:
        name = device.get("name") or "a device the catalog does not know"
        raise ValueError(f"{run}: ran on {name}; pass --gpu to name its catalog entry")
    try:
        g, n, f = cat.system(str(key))
    except ValueError as exc:
        if gpu:  # the --gpu flag's, not the run's
            raise
        raise ValueError(f"{run}: {exc}") from None
    return g.key, g.generation, (g, n, f)


def read_run(run_dir: str | Path, sim_inputs: SimInputs, cat: Catalog, gpu: str | None = None) -> MeasuredRun:
    """A run directory's config, world size, device and measured step time and breakdown; `gpu` overrides the
    recorded device with a catalog GPU.

    Raises FileNotFoundError for a directory that is not a run, ValueError for one that cannot be priced.
    """
    run = Path(run_dir)
    cfg_path, metrics_path = run / "config.json", run / "metrics.jsonl"
    for path in (cfg_path, metrics_path):
        if not path.exists():  # a FIFO or a directory in its place is refused by the reader, in one line
            raise FileNotFoundError(f"{run}: no {path.name} (not a scaletrain run directory)")
    try:
        cfg = from_dict(read_config_table(run))
    except FileFormatError:
        raise
    except ConfigError as exc:  # a field's problem, named by from_dict as "config.json: ..."
        raise ValueError(f"{cfg_path}: {str(exc).removeprefix('config.json: ')}") from None
    train, _ = read_metrics(run)
    records = [r for r in train if "step_time_s" in r]
    if len(records) < 3:
        raise ValueError(f"{metrics_path}: fewer than 3 timed steps")
    last = records[-1]
    world = last.get("world_size")
    if world is None:
        raise ValueError(f"{metrics_path}: the step records carry no world_size (a run from an older scaletrain)")
    prediction = read_prediction(run)
    key, group, (g, n, f) = _device(run, prediction, last, gpu, cat)
    steady = records[len(records) // 3 :]
    parts = None
    if all(isinstance(r.get(k), (int, float)) for r in steady for k in MEASURED_KEYS):
        parts = {k: statistics.median(r[k] for r in steady) for k in MEASURED_KEYS}
    try:
        w, layout = sim_inputs(cfg, world)
    except ValueError as exc:
        raise ValueError(f"{run}: {world} ranks: {exc}") from None
    prior = (prediction or {}).get("step_time_s")
    return MeasuredRun(
        path=str(run),
        gpu=key,
        group=group,
        world_size=world,
        workload=w,
        layout=layout,
        cluster=Cluster(g, n, f, world),
        step_time_s=steady_median([r["step_time_s"] for r in records]),
        parts=parts,
        prior_step_s=float(prior) if prior is not None else None,  # checked by read_prediction
        gemm_gflop=run_gemm_gflop(w, layout),
    )
