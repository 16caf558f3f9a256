"""`scaletrain sim calibrate RUN_DIR...`: the efficiency terms fitted from runs' measured step breakdowns, GEMM
efficiency per shape class, refusing terms the runs do not constrain, held-out scoring, and the fit fed back into
the next CPU run's prediction."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.sim.comm import Cluster
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fit.run_fit import calibrate_runs, fit_group
from scaletrain.sim.fit.runs import MeasuredRun, price
from scaletrain.sim.gemm_classes import class_index, class_label, eff_at, run_gemm_gflop
from scaletrain.sim.host_device import CPU_EFFICIENCY, cpu_efficiency, cpu_system
from scaletrain.sim.workload import ClusterLayout, load_workload

DEVICE = {
    "kind": "cpu",
    "name": "test CPU",
    "peak_flops": 1e11,
    "mem_bw_bytes_s": 2e10,
    "kernel_s": 5e-6,
    "memory_bytes": 16e9,
}
SHAPE = ("model.n_layers=2", "model.d_model=128", "model.n_heads=2", "model.seq_len=128", "model.vocab_size=1024")
# The "true" machine the synthetic runs are measured on: small GEMMs run less efficiently, collectives reach a third
# of the modelled bandwidth, TP is fully exposed (DP overlaps as the prior says), and the host spends 3 ms per step
# outside the model.
TRUTH = replace(CPU_EFFICIENCY, comm_eff=0.35, tp_exposed=1.0, step_overhead_s=0.003)


def _true_gemm_eff(gflop: float) -> float:
    return 0.3 if gflop < 0.1 else 0.6


def _run(name: str, gpus: int, mbs: int, truth: Efficiency = TRUTH, **layout) -> MeasuredRun:
    """A run 'measured' on the simulator itself with the TRUTH terms: a fit must recover them."""
    w = load_workload("gpt3-proxy", SHAPE)
    lay = ClusterLayout(gpus=gpus, mbs=mbs, gbs=16, zero=3 if gpus > 1 and layout.get("tp", 1) == 1 else 0, **layout)
    cl = Cluster(*cpu_system(DEVICE), gpus)
    gflop = run_gemm_gflop(w, lay)
    st = price(replace(_empty_run(name, w, lay, cl, gflop)), replace(truth, gemm_eff=_true_gemm_eff(gflop)))
    b = st.breakdown
    comm = sum(b[k] for k in ("tp_exposed", "cp_exposed", "dp_exposed", "sync", "straggler", "pp_bubble"))
    parts = {
        "data_s": 0.001,
        "fwd_bwd_s": b["compute"] + b["overlap_slowdown"] + comm,
        "optimizer_s": b["optimizer"],
        "comm_exposed_s": comm,
        "other_s": b["overhead"] - 0.001,
    }
    return replace(_empty_run(name, w, lay, cl, gflop), step_time_s=st.step_time_s, parts=parts)


def _empty_run(name, w, lay, cl, gflop) -> MeasuredRun:
    return MeasuredRun(
        path=f"/runs/{name}",
        gpu="cpu",
        group="cpu",
        world_size=lay.gpus,
        workload=w,
        layout=lay,
        cluster=cl,
        step_time_s=1.0,
        parts=None,
        prior_step_s=None,
        gemm_gflop=gflop,
    )


def test_shape_classes_follow_the_gemm_size():
    w = load_workload("gpt3-proxy", SHAPE)
    one = run_gemm_gflop(w, ClusterLayout(gpus=1, mbs=8, gbs=16))
    # TP2 halves every layer GEMM and the output layer; so does half the micro-batch: one class down each.
    assert run_gemm_gflop(w, ClusterLayout(gpus=2, tp=2, mbs=8, gbs=16)) == pytest.approx(one / 2)
    assert run_gemm_gflop(w, ClusterLayout(gpus=1, mbs=4, gbs=16)) == pytest.approx(one / 2)
    assert class_index(one) - class_index(one / 2) == 1 and class_index(1.0) == 0
    assert class_label(0) == "0.707-1.41 GFLOP"
    classes = [{"gflop": 1.0, "gemm_eff": 0.4}, {"gflop": 4.0, "gemm_eff": 0.8}]
    assert eff_at(classes, 2.0) == (pytest.approx(0.6), False)  # linear in log size between the classes
    assert eff_at(classes, 1.2) == (0.4, False) or eff_at(classes, 1.2)[1] is False
    assert eff_at(classes, 0.25) == (0.4, True) and eff_at(classes, 16.0) == (0.8, True)
    assert eff_at(classes, 4.5) == (0.8, False)  # beyond the last class's size but inside its class
    with pytest.raises(ValueError, match="no fitted"):
        eff_at([], 1.0)


def test_fit_recovers_the_terms_and_predicts_unseen_layouts():
    fit_runs = [_run("single", 1, 8), _run("fsdp2", 2, 8), _run("tp2", 2, 8, tp=2), _run("fsdp4", 4, 4)]
    fit = fit_group(fit_runs, CPU_EFFICIENCY)
    assert fit.eff.step_overhead_s == pytest.approx(TRUTH.step_overhead_s)
    # One gemm_eff per shape class, each its own truth.
    assert {c["label"]: c["gemm_eff"] for c in fit.classes} == pytest.approx(
        {class_label(class_index(r.gemm_gflop)): _true_gemm_eff(r.gemm_gflop) for r in fit_runs}, rel=0.02
    )
    assert len(fit.classes) == 2
    assert fit.eff.comm_eff == pytest.approx(TRUTH.comm_eff, rel=0.1)
    assert fit.eff.tp_exposed == pytest.approx(TRUTH.tp_exposed, rel=0.1)
    # Three communication terms on three communicating runs: the DP overlap's effect is almost that of the other
    # two, so it is refused (kept at its prior) rather than fitted to noise.
    assert not fit.terms["dp_overlap"]["fitted"] and "cannot tell it from comm_eff" in fit.terms["dp_overlap"]["how"]
    # Layouts no fitted run had (DP x TP, pipelining): their step times within 3% of the measurement.
    held = [_run("fsdp2_tp2", 4, 8, tp=2), _run("pp2", 2, 4, pp=2), _run("tp4", 4, 8, tp=4)]
    doc = calibrate_runs(fit_runs, held, None)
    assert doc["fit_error"]["max_abs_pct"] < 1.0
    assert doc["held_out_error"]["max_abs_pct"] < 3.0, doc["held_out"]
    assert doc["held_out"][2]["extrapolated"]  # TP4's GEMMs are a class smaller than any fitted one
    # The prior (no fit) is far off these runs: the fit is what makes the predictions.
    prior = [abs(price(r, CPU_EFFICIENCY).step_time_s / r.step_time_s - 1) for r in held]
    assert sum(prior) / len(prior) > 0.15


def test_terms_the_runs_do_not_constrain_keep_their_priors():
    # One rank only: no run communicates, so none of the communication terms can be fitted.
    fit = fit_group([_run("single", 1, 8), _run("half", 1, 4)], CPU_EFFICIENCY)
    for term in ("comm_eff", "tp_exposed", "dp_overlap"):
        assert not fit.terms[term]["fitted"] and "kept the prior" in fit.terms[term]["how"]
        assert getattr(fit.eff, term) == getattr(CPU_EFFICIENCY, term)
    # FSDP but no TP: the TP exposure is still unconstrained.
    fit = fit_group([_run("single", 1, 8), _run("fsdp2", 2, 8)], CPU_EFFICIENCY)
    assert fit.terms["comm_eff"]["fitted"] and not fit.terms["tp_exposed"]["fitted"]
    # A pipeline's rank-0 breakdown is not the step's: it constrains nothing but through its step time.
    fit = fit_group([_run("pp2", 2, 4, pp=2)], CPU_EFFICIENCY)
    assert not fit.terms["comm_eff"]["fitted"] and "not DDP, not pipelined" in fit.terms["comm_eff"]["how"]


def _write_run(run_dir: Path, run: MeasuredRun, overrides: list[str], steps: int = 6) -> None:
    """A run directory as the trainer writes it, for the synthetic measurement `run`."""
    cfg = resolve("gpt3-proxy", overrides=[*SHAPE, "train.global_batch_size=16", *overrides])
    cfg.save(run_dir)
    (run_dir / "prediction.json").write_text(json.dumps({"schema": 1, "device": DEVICE, "step_time_s": 0.5}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(
                json.dumps({"step": step, "step_time_s": run.step_time_s, "world_size": run.world_size, **run.parts})
                + "\n"
            )
            f.write(json.dumps({"step": step, "checkpoint_s": 0.5}) + "\n")


def test_cli_reads_run_directories_and_feeds_the_fit_back(tmp_path, capsys, monkeypatch):
    runs = {
        "single": (_run("single", 1, 8), ["train.micro_batch_size=8"]),
        "fsdp2": (_run("fsdp2", 2, 8), ["train.micro_batch_size=8"]),
        "tp2": (_run("tp2", 2, 8, tp=2), ["train.micro_batch_size=8", "parallel.tp=2", "parallel.dp_shard=1"]),
        "half": (_run("half", 1, 4), ["train.micro_batch_size=4"]),
    }
    for name, (run, over) in runs.items():
        _write_run(tmp_path / name, run, over)
    out = tmp_path / "fit.json"
    args = [
        "sim",
        "calibrate",
        *(str(tmp_path / n) for n in ("single", "fsdp2", "tp2")),
        "--held-out",
        str(tmp_path / "half"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "measured/cpu: fitted on 3 run(s)" in text and "held out: mean |error|" in text
    doc = json.loads(out.read_text())
    assert set(doc) >= {"sets", "gemm_classes", "terms", "runs", "held_out", "fit_error", "held_out_error"}
    assert doc["runs"][0]["prior_step_s"] == 0.5 and doc["held_out"][0]["name"] == "half"
    assert doc["sets"]["measured/cpu"]["comm_eff"] == pytest.approx(TRUTH.comm_eff, rel=0.25)  # prior: 1
    # Half the micro-batch halves the GEMMs, as TP2 does: the held-out run is priced at tp2's shape class.
    assert not doc["held_out"][0]["extrapolated"] and abs(doc["held_out"][0]["error_pct"]) < 3
    # Fed back: a CPU run priced while $SCALETRAIN_EFFICIENCY names the fit uses the fitted set at its class.
    w, lay = runs["single"][0].workload, runs["single"][0].layout
    assert cpu_efficiency(w, lay)[0].startswith("prior")
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", str(out))
    name, eff = cpu_efficiency(w, lay)
    assert name.startswith("measured/cpu") and eff.gemm_eff == pytest.approx(0.6, rel=0.02)
    assert eff.step_overhead_s == pytest.approx(TRUTH.step_overhead_s)


def test_cli_errors_name_the_run(tmp_path, capsys):
    run, _ = _run("single", 1, 8), None
    _write_run(tmp_path / "good", run, ["train.micro_batch_size=8"])
    assert main(["sim", "calibrate", "--held-out", str(tmp_path / "good")]) == 2
    assert "give the runs to fit on" in capsys.readouterr().err
    # A prediction.json whose CPU figures are broken: one line naming the file and the figure.
    bad = tmp_path / "bad"
    _write_run(bad, run, ["train.micro_batch_size=8"])
    (bad / "prediction.json").write_text(json.dumps({"device": {**DEVICE, "peak_flops": float("nan")}}))
    assert main(["sim", "calibrate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad/prediction.json" in err and "peak_flops" in err
    # A GPU run fitted, a CPU run held out: no fitted set to predict it with.
    bad_mix = tmp_path / "gpu"
    _write_run(bad_mix, run, ["train.micro_batch_size=8"])
    (bad_mix / "prediction.json").write_text(json.dumps({"device": {"kind": "cuda", "catalog_key": "h100"}}))
    assert main(["sim", "calibrate", str(bad_mix), "--held-out", str(tmp_path / "good")]) == 2
    assert "on which no run was fitted" in capsys.readouterr().err


def test_cpu_calibration_benchmark_refits_run_directories(tmp_path):
    """benchmarks/cpu_calibration.py --reuse on synthetic runs of its eight layouts: fit half, score the rest."""
    import importlib.util
    import subprocess
    import sys

    from scaletrain.parallel.sim_layout import sim_inputs

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_calibration.py"
    spec = importlib.util.spec_from_file_location("cpu_calibration", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, (ranks, over, _) in bench.LAYOUTS.items():
        cfg = resolve("gpt3-proxy", overrides=[*SHAPE, *bench.BASE, *over])
        w, lay = sim_inputs(cfg, ranks)
        cl = Cluster(*cpu_system(DEVICE), ranks)
        gflop = run_gemm_gflop(w, lay)
        st = price(_empty_run(name, w, lay, cl, gflop), replace(TRUTH, gemm_eff=_true_gemm_eff(gflop)))
        b = st.breakdown
        comm = sum(b[k] for k in ("tp_exposed", "cp_exposed", "dp_exposed", "sync", "straggler", "pp_bubble"))
        parts = {
            "data_s": 0.0,
            "fwd_bwd_s": b["compute"] + b["overlap_slowdown"] + comm,
            "optimizer_s": b["optimizer"],
            "comm_exposed_s": comm,
            "other_s": b["overhead"],
        }
        run = replace(_empty_run(name, w, lay, cl, gflop), step_time_s=st.step_time_s, parts=parts)
        _write_run(tmp_path / "runs" / name, run, [*bench.BASE, *over])
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--reuse", str(tmp_path / "runs"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held out: mean |error|" in proc.stdout and "an efficiency file too" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["runs"]] == [n for n, v in bench.LAYOUTS.items() if v[2] == "fit"]
    assert len(doc["held_out"]) == 4 and doc["held_out_error"]["max_abs_pct"] < 10
    assert "measured/cpu" in doc["sets"] and doc["layouts"]["pp2"]["half"] == "held-out"


@pytest.mark.parametrize(
    "value, message",
    [("nan", "must be a finite number"), ("0", r"must be in \(0, 10\]"), ("11", r"must be in \(0, 10\]")],
)
def test_probe_window_is_validated(value, message):
    with pytest.raises(ValueError, match=f"train.probe_window_s=.*{message}"):
        resolve("gpt3-proxy", overrides=[f"train.probe_window_s={value}"])
