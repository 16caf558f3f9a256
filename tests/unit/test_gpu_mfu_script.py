"""benchmarks/gpu_mfu.py in CPU smoke mode, `sim calibrate --layer-timings`, and the gpt3-2.7b preset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.model.flops import flops_per_token, num_params
from scaletrain.sim import compute
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.efficiency import efficiency_for
from scaletrain.sim.workload import ClusterLayout, load_workload

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_mfu.py"


def _run_script(tmp_path: Path, *args: str, prelude: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    """Run the script as CI would, on this checkout's sources (not whatever scaletrain is installed)."""
    out = tmp_path / "gpu_mfu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("OUT", None)
    argv = [str(SCRIPT), "--cpu-smoke", "--out", str(out), *args]
    if prelude:  # run the script after `prelude` (e.g. hiding a module) in the same interpreter
        argv = [
            "-c",
            f"import runpy, sys; {prelude}; sys.argv = {argv!r}; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')",
        ]
    # The timeout only catches a hang: ~13 s on an idle 2-core machine, but over 200 s when the machine is shared
    # (load average 10+ was seen), and a busy machine is a legitimate place to run the suite.
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_cpu_smoke_writes_table_json_and_timings(tmp_path, excerpt_corpus):
    # One timed step and repetition per measurement, and a 12-step FP8 check on the excerpt at vocabulary 1024 (not
    # the default corpus's 8192): CPU FP8 GEMMs run torch's reference loop. Every phase and output is still made.
    proc, res = _run_script(
        tmp_path,
        "--steps",
        "1",
        "--reps",
        "1",
        "--fp8-check-steps",
        "12",
        "--fp8-check-corpus",
        str(excerpt_corpus.root),
    )
    assert {
        "environment",
        "sdpa",
        "ceilings",
        "training",
        "fp8_check",
        "layer_timings",
        "sim",
        "phase_s",
        "errors",
        "date",
        "mode",
    } <= set(res)
    assert res["mode"] == "cpu-smoke" and not res["errors"]
    assert res["environment"]["dense_bf16_peak"] is None  # no GPU: MFU is undefined, not made up
    assert res["sdpa"]["used"] in ("flash_cpu", "math") and res["sdpa"]["accepted"]["math"]
    assert res["ceilings"]["gemm_bf16_tflops"] > 0 and res["ceilings"]["copy_gbps"] > 0
    rows = res["training"]
    assert {r["name"] for r in rows} == {"175B-layers", "gpt3-1.3b", "gpt3-2.7b"}
    for r in rows:
        assert r["mfu"] is None and r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["peak_mem_gib"] > 0
    if res["environment"]["fp8_module"]:  # emulated FP8 on CPU
        assert any(r["precision"] == "fp8" and r["fp8_linears"] > 0 for r in rows)
        chk = res["fp8_check"]
        assert chk["finite"] and chk["fp8_linears"] > 0 and abs(chk["rel_diff"]) <= chk["tolerance"]
        assert chk["steps"] == 12 and chk["set"][-1] == "model.vocab_size=1024" and len(chk["losses"]["fp8"]) == 12
    t = res["layer_timings"]
    assert t["format"] == "scaletrain-layer-timings/1" and t["gpu"] is None
    assert t["gemm"] and t["attention"] and t["blocks"] and t["steps"]
    assert len(res["sim"]["rows"]) == len(rows) and res["sim"]["comparable"] is False
    # The table: a header, one line per training row, the simulator comparison.
    assert "MFU (no dense peak)" in proc.stdout and proc.stdout.count("175B-layers") >= 4
    stem = tmp_path / "gpu_mfu"
    for suffix in (".layer_timings.json", ".catalog.toml", ".efficiency.json"):
        assert Path(f"{stem}{suffix}").is_file()
    # Its timings file is what `sim calibrate --layer-timings` reads (a CPU run must name the GPU to fit).
    assert (
        main(
            [
                "sim",
                "calibrate",
                "--layer-timings",
                f"{stem}.layer_timings.json",
                "--gpu",
                "h200",
                "--out",
                str(tmp_path / "eff.json"),
            ]
        )
        == 0
    )
    assert "gemm_curve_bf16" in (tmp_path / "eff.toml").read_text()


def test_cpu_smoke_without_the_fp8_module(tmp_path):
    _, res = _run_script(
        tmp_path, "--steps", "1", "--reps", "1", "--no-fp8-check", prelude="sys.modules['scaletrain.model.fp8'] = None"
    )
    env = res["environment"]
    assert env["fp8_module"] is False and "fp8" in env["fp8_error"]
    assert {r["precision"] for r in res["training"]} == {"bf16"} and res["fp8_check"] is None


def _timings(measured_block_s: float) -> dict:
    """A synthetic H200 run: GEMMs at half the catalog's rate and one gpt3-1.3b block at `measured_block_s`."""
    gemm = [
        {"dtype": "bf16", "m": n, "n": n, "k": n, "seconds": 2 * n**3 / (r * 1e12)}
        for n, r in ((1024, 150.0), (2048, 300.0), (4096, 380.0), (8192, 395.0))
    ]
    return {
        "format": "scaletrain-layer-timings/1",
        "gpu": "h200",
        "device": "synthetic",
        "ceilings": {"gemm_bf16_tflops": 395.0, "gemm_fp8_tflops": None, "copy_gbps": 4000.0},
        "gemm": gemm,
        "attention": [{"mbs": 4, "seq_len": 2048, "heads": 16, "head_dim": 128, "fwd_s": 2e-3, "bwd_s": 5e-3}],
        "blocks": [
            {
                "model": "gpt3-1.3b",
                "set": [],
                "mbs": 4,
                "fp8": False,
                "fwd_s": measured_block_s / 3,
                "bwd_s": 2 * measured_block_s / 3,
            }
        ],
        "steps": [],
    }


def _block_s(cat, eff) -> float:
    w = load_workload("gpt3-1.3b")
    t = compute.layer_times(w, ClusterLayout(gpus=1, mbs=4, gbs=4, sp=False), cat.gpu("h200"), eff.gemm_eff)
    return t.fwd + t.bwd


def test_calibrate_layer_timings_fits_curve_and_moves_predictions(tmp_path, capsys, monkeypatch):
    shipped = _block_s(load_catalog(), efficiency_for(None, "h200")[1])
    measured = 2.5 * shipped
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"layer_timings": _timings(measured)}))  # gpu_mfu.json's nesting works too
    eff_path, cat_path = tmp_path / "eff.json", tmp_path / "h200.toml"
    assert (
        main(["sim", "calibrate", "--layer-timings", str(path), "--out", str(eff_path), "--catalog-out", str(cat_path)])
        == 0
    )
    cat = load_catalog([str(cat_path)])
    g = cat.gpu("h200")
    assert [p[0] for p in g.gemm_curve_bf16] == sorted(p[0] for p in g.gemm_curve_bf16)
    assert g.gemm_curve_bf16[-1][1] == pytest.approx(395.0, rel=1e-3) and g.matmul_bf16_tflops == 395.0
    assert g.hbm_copy_tbps == pytest.approx(4.0)
    doc = json.loads(eff_path.read_text())
    assert set(doc["sets"]) == {"measured/hopper"}
    monkeypatch.setenv("SCALETRAIN_EFFICIENCY", str(eff_path))
    # Priced against the measured catalog entry, as predict --catalog does (the 90%-of-peak cap reads its curve).
    _, eff = efficiency_for("measured", "h200", catalog=cat)
    fitted = _block_s(cat, eff)
    assert abs(fitted - measured) < abs(shipped - measured)  # moved toward the measurement ...
    assert fitted == pytest.approx(measured, rel=0.02)  # ... and reproduces it
    capsys.readouterr()
    args = [
        "predict",
        "--model",
        "gpt3-1.3b",
        "--gpu",
        "h200",
        "--gpus",
        "1",
        "--gbs",
        "4",
        "--mbs",
        "4",
        "--zero",
        "0",
        "--json",
    ]
    assert main(args) == 0
    before = json.loads(capsys.readouterr().out)["step_time_s"]
    assert main([*args, "--catalog", str(cat_path), "--calibration", "measured"]) == 0
    after = json.loads(capsys.readouterr().out)["step_time_s"]
    assert after > before  # slower blocks, slower step


def test_calibrate_layer_timings_needs_a_gpu(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**_timings(0.01), "gpu": None}))
    assert main(["sim", "calibrate", "--layer-timings", str(path)]) == 2
    assert "--gpu" in capsys.readouterr().err


def test_gpt3_2_7b_preset():
    m = resolve("gpt3-2.7b").model
    assert (m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size) == (32, 2560, 32, 2048, 50257)
    assert num_params(m) == 2_651_673_600  # GPT-3 paper's "2.7B" (2.65B counted)
    assert num_params(m) == pytest.approx(2.7e9, rel=0.03)
    assert flops_per_token(m) == pytest.approx(1.79e10, rel=0.01)
    t = resolve("gpt3-1.3b")
    c = resolve("gpt3-2.7b")
    assert (c.optim, c.train, c.bench) == (t.optim, t.train, t.bench)  # only the model section differs


def test_bad_sizes_and_a_missing_fp8_check_corpus_are_one_line_and_exit_2(tmp_path, capsys):
    import runpy

    script = runpy.run_path(str(SCRIPT), run_name="gpu_mfu")
    for argv, what in (
        (["--fp8-check-corpus", str(tmp_path / "none")], "no complete prepared corpus there"),
        (["--fp8-check-steps", "2"], "--fp8-check-steps 2: need at least 4"),
        (["--reps", "0"], "--reps 0: need at least 1"),
    ):
        with pytest.raises(SystemExit) as info:
            script["main"]([*argv, "--out", str(tmp_path / "x.json")])
        err = capsys.readouterr().err
        assert info.value.code == 2 and what in err.strip().splitlines()[-1], err  # argparse: usage, then one line
    assert not (tmp_path / "x.json").exists()
