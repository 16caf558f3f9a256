"""Crafted or careless run directories given to `scaletrain report` and `scaletrain sim calibrate` (issue 25,
finding 6).

Each case damages a private copy of a valid run directory (config.json, metrics.jsonl, prediction.json as the
trainer writes them), then runs the CLI: exit 2, ONE line on stderr naming the file (and line) and the field, and
nothing written or changed -- no plot, no fitted JSON. Before the fix these were tracebacks (config.json `[]`,
garbage or 10**5 deep; step_time_s="slow"; fwd_bwd_s=1e308 overflowing a mean), silently accepted (step_time_s=-1,
a NaN step time written into the fit as a bare NaN, a prediction.json that is not an object ignored), or errors
that did not say which file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from scaletrain.cli.main import main
from scaletrain.config import resolve

DEVICE = {
    "kind": "cpu",
    "name": "test CPU",
    "peak_flops": 1e11,
    "mem_bw_bytes_s": 2e10,
    "kernel_s": 5e-6,
    "memory_bytes": 16e9,
}
SHAPE = [
    "model.n_layers=2",
    "model.d_model=128",
    "model.n_heads=2",
    "model.seq_len=128",
    "model.vocab_size=1024",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
]
DELETE = object()
REPORT, CALIBRATE = "report", "calibrate"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A one-rank CPU run directory as the trainer writes it: six timed steps, an evaluation, a checkpoint line."""
    run = tmp_path_factory.mktemp("rundir") / "run"
    resolve("gpt3-proxy", overrides=SHAPE).save(run)
    lines = []
    for step in range(1, 7):
        t = 0.5 + 0.01 * step
        lines.append(
            {
                "time": 1.7e9 + step,
                "step": step,
                "loss": 7.0 - step / 10,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens": step * 2048,
                "tokens_per_s": 2048 / t,
                "step_time_s": t,
                "world_size": 1,
                "data_s": 0.01,
                "fwd_bwd_s": 0.8 * t,
                "optimizer_s": 0.1 * t,
                "comm_exposed_s": 0.0,
                "other_s": t - 0.01 - 0.9 * t,
            }
        )
    lines.append({"step": 6, "eval_loss": 6.5, "tokens": 6 * 2048, "eval_s": 0.3})
    lines.append({"step": 6, "checkpoint_s": 0.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    breakdown = {"data_s": 0.0, "fwd_bwd_s": 0.4, "optimizer_s": 0.05, "comm_exposed_s": 0.0, "other_s": 0.05}
    (run / "prediction.json").write_text(
        json.dumps({"schema": 1, "device": DEVICE, "world_size": 1, "step_time_s": 0.5, "breakdown": breakdown})
    )
    return run


def snapshot(root: Path) -> dict:
    """Every entry under `root` (not following links): kind, size, mtime and, for a file, its bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        s = path.lstat()
        kind = "fifo" if path.is_fifo() else "dir" if path.is_dir() else "file"
        found[str(path.relative_to(root))] = (
            kind,
            s.st_size,
            s.st_mtime_ns,
            path.read_bytes() if kind == "file" else None,
        )
    return found


def _command(which: str, run: Path, out: Path) -> list[str]:
    if which == REPORT:
        return ["report", str(run)]
    return ["sim", "calibrate", str(run), "--out", str(out)]


# ---------------------------------------------------------------- damages
def _metric(line: int = 0, **fields):
    """Set (or DELETE) fields of record `line` of metrics.jsonl."""

    def damage(run: Path) -> None:
        path = run / "metrics.jsonl"
        records = [json.loads(x) for x in path.read_text().splitlines()]
        for key, value in fields.items():
            if value is DELETE:
                records[line].pop(key, None)
            else:
                records[line][key] = value
        path.write_text("".join(json.dumps(r) + "\n" for r in records))  # NaN as Python's json writes it

    return damage


def _metric_line(text: str, line: int = 0):
    """Replace line `line` of metrics.jsonl by raw `text`."""

    def damage(run: Path) -> None:
        path = run / "metrics.jsonl"
        lines = path.read_text().splitlines()
        lines[line] = text
        path.write_text("\n".join(lines) + "\n")

    return damage


def _write(name: str, text: str | bytes):
    def damage(run: Path) -> None:
        path = run / name
        path.unlink()
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)

    return damage


def _fifo(name: str):
    def damage(run: Path) -> None:
        (run / name).unlink()
        os.mkfifo(run / name)

    return damage


def _json_change(name: str, change):
    def damage(run: Path) -> None:
        doc = json.loads((run / name).read_text())
        change(doc)
        (run / name).write_text(json.dumps(doc))

    return damage


def _prediction(**fields):
    return _json_change("prediction.json", lambda doc: doc.update(fields))


def _deep(depth: int = 10**5) -> str:
    return "[" * depth + "]" * depth


M, P, C = "metrics.jsonl:1: ", "prediction.json: ", "config.json: "
BOTH = (REPORT, CALIBRATE)
# (id, damage, the commands it is given to, substrings the one error line holds besides "scaletrain: error: <run>/")
CASES = [
    # ---- config.json
    ("config_list", _write("config.json", "[]"), BOTH, [C, "not a scaletrain config.json"]),
    ("config_garbage", _write("config.json", "{garbage"), BOTH, [C, "not valid JSON"]),
    ("config_deep", _write("config.json", _deep()), BOTH, [C, "nested more than"]),
    ("config_binary", _write("config.json", b"\x00\xff\xfe binary"), BOTH, [C, "not UTF-8"]),
    ("config_fifo", _fifo("config.json"), BOTH, [C, "not a regular file"]),
    ("config_train_not_section", _json_change("config.json", lambda d: d.update(train=5)), BOTH, [C, "train"]),
    (
        "config_target_string",
        _json_change("config.json", lambda d: d["train"].update(target_eval_loss="x")),
        BOTH,
        [C, "target_eval_loss"],
    ),
    (
        "config_target_nan",
        _json_change("config.json", lambda d: d["train"].update(target_eval_loss=math.nan)),
        (REPORT,),
        [C, "target_eval_loss=nan"],
    ),
    # ---- metrics.jsonl: the step time and its parts
    ("step_time_string", _metric(step_time_s="slow"), BOTH, [M, "step_time_s='slow'"]),
    ("step_time_negative", _metric(step_time_s=-1), BOTH, [M, "step_time_s=-1"]),
    ("step_time_zero", _metric(step_time_s=0), BOTH, [M, "step_time_s=0"]),
    ("step_time_nan", _metric(step_time_s=math.nan), BOTH, [M, "step_time_s=nan"]),
    ("step_time_inf", _metric(step_time_s=math.inf), BOTH, [M, "step_time_s=inf"]),
    ("step_time_huge", _metric(step_time_s=1e308), BOTH, [M, "step_time_s=1e+308"]),
    ("step_time_null", _metric(step_time_s=None), BOTH, [M, "step_time_s=None"]),
    ("step_time_bool", _metric(step_time_s=True), BOTH, [M, "step_time_s=True"]),
    ("step_time_list", _metric(step_time_s=[1]), BOTH, [M, "step_time_s=[1]"]),
    ("fwd_bwd_huge", _metric(fwd_bwd_s=1e308), BOTH, [M, "fwd_bwd_s=1e+308"]),
    ("fwd_bwd_negative", _metric(fwd_bwd_s=-0.5), BOTH, [M, "fwd_bwd_s=-0.5"]),
    ("fwd_bwd_string", _metric(fwd_bwd_s="x"), BOTH, [M, "fwd_bwd_s='x'"]),
    ("comm_nan", _metric(comm_exposed_s=math.nan), BOTH, [M, "comm_exposed_s=nan"]),
    ("data_negative", _metric(data_s=-1), BOTH, [M, "data_s=-1"]),
    ("optimizer_inf", _metric(optimizer_s=math.inf), BOTH, [M, "optimizer_s=inf"]),
    ("other_negative", _metric(other_s=-1), BOTH, [M, "other_s=-1"]),
    # ---- metrics.jsonl: the other fields read
    ("world_size_zero", _metric(line=5, world_size=0), (CALIBRATE,), ["metrics.jsonl:6: ", "world_size=0"]),
    ("world_size_fraction", _metric(line=5, world_size=2.5), (CALIBRATE,), ["metrics.jsonl:6: ", "world_size=2.5"]),
    ("world_size_string", _metric(line=5, world_size="1"), (CALIBRATE,), ["metrics.jsonl:6: ", "world_size='1'"]),
    ("world_size_huge", _metric(line=5, world_size=10**12), (CALIBRATE,), ["metrics.jsonl:6: ", "world_size="]),
    ("gpu_number", _metric(line=5, gpu=5), (CALIBRATE,), ["metrics.jsonl:6: ", "gpu=5"]),
    ("tokens_string", _metric(tokens="x"), (REPORT,), [M, "tokens='x'"]),
    ("tokens_missing", _metric(tokens=DELETE), (REPORT,), [M, "tokens=None"]),
    ("loss_string", _metric(loss="low"), (REPORT,), [M, "loss='low'"]),
    ("eval_loss_string", _metric(line=6, eval_loss="x"), (REPORT,), ["metrics.jsonl:7: ", "eval_loss='x'"]),
    ("eval_tokens_missing", _metric(line=6, tokens=DELETE), (REPORT,), ["metrics.jsonl:7: ", "tokens=None"]),
    ("step_missing", _metric(step=DELETE), BOTH, [M, "without its step"]),
    ("step_string", _metric(step="1"), (REPORT,), [M, "step='1'"]),
    ("line_not_object", _metric_line("[1, 2]", line=7), BOTH, ["metrics.jsonl:8: ", "not a JSON object"]),
    ("line_number", _metric_line("5", line=7), BOTH, ["metrics.jsonl:8: ", "not a JSON object"]),
    ("line_garbage", _metric_line("{garbage", line=0), (CALIBRATE,), [M, "not valid JSON"]),
    ("line_deep", _metric_line(_deep(), line=0), BOTH, [M, "nested more than"]),
    ("metrics_binary", _write("metrics.jsonl", b"\xff\xfe\x00\x01"), BOTH, ["metrics.jsonl:1: ", "not UTF-8"]),
    ("metrics_fifo", _fifo("metrics.jsonl"), BOTH, ["metrics.jsonl: not a regular file"]),
    # ---- prediction.json
    ("prediction_list", _write("prediction.json", "[]"), BOTH, [P, "not a JSON object"]),
    ("prediction_garbage", _write("prediction.json", "{garbage"), BOTH, [P, "not valid JSON"]),
    ("prediction_deep", _write("prediction.json", _deep()), BOTH, [P, "nested more than"]),
    ("prediction_step_nan", _prediction(step_time_s=math.nan), BOTH, [P, "step_time_s=nan"]),
    ("prediction_step_string", _prediction(step_time_s="fast"), BOTH, [P, "step_time_s='fast'"]),
    ("prediction_step_negative", _prediction(step_time_s=-1), BOTH, [P, "step_time_s=-1"]),
    ("prediction_breakdown_string", _prediction(breakdown="x"), (REPORT,), [P, "breakdown='x'"]),
    (
        "prediction_breakdown_huge",
        _prediction(breakdown={"fwd_bwd_s": 1e308}),
        (REPORT,),
        [P, "breakdown.fwd_bwd_s=1e+308"],
    ),
    ("prediction_device_list", _prediction(device=[]), (CALIBRATE,), [P, "device=[]"]),
    ("prediction_device_kind_number", _prediction(device={**DEVICE, "kind": 5}), (CALIBRATE,), [P, "device.kind=5"]),
    ("prediction_error_number", _prediction(error=5), BOTH, [P, "error=5"]),
]
PARAMS = [
    pytest.param(damage, which, expected, id=f"{name}-{which}")
    for name, damage, commands, expected in CASES
    for which in commands
]


@pytest.mark.hostile
@pytest.mark.parametrize("damage, which, expected", PARAMS)
def test_crafted_run_directory_is_one_line(damage, which, expected, base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    damage(run)
    before = snapshot(tmp_path)
    code = main(_command(which, run, tmp_path / "fit.json"))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, f"exit {code}:\n{err[-3000:]}"
    assert lines[0].startswith(f"scaletrain: error: {run}/"), lines[0]
    for part in expected:
        assert part in lines[0], (part, lines[0])
    assert snapshot(tmp_path) == before, "the run directory was changed or an output written"


def test_the_valid_base_reports_and_calibrates(base, tmp_path, capsys):
    """The cases above damage this directory: whole, both commands succeed (so each refusal is its damage's)."""
    run = tmp_path / "run"
    shutil.copytree(base, run)
    assert main(_command(REPORT, run, tmp_path / "fit.json")) == 0
    assert (run / "loss.png").is_file() and (run / "perf.png").is_file()
    assert main(_command(CALIBRATE, run, tmp_path / "fit.json")) == 0, capsys.readouterr().err
    assert "measured/cpu" in json.loads((tmp_path / "fit.json").read_text())["sets"]


@pytest.mark.hostile
def test_calibrate_never_writes_a_bare_nan(base, tmp_path, capsys, monkeypatch):
    """Whatever reaches the fit, its output is strict JSON: a non-finite number is refused with nothing written."""
    import scaletrain.sim.fit.run_fit as run_fit

    run = tmp_path / "run"
    shutil.copytree(base, run)
    real = run_fit.calibrate_runs

    def fit_with_a_nan(*args):
        doc = real(*args)
        return {**doc, "fit_error": {**doc["fit_error"], "max_abs_pct": math.nan}}

    monkeypatch.setattr(run_fit, "calibrate_runs", fit_with_a_nan)
    out = tmp_path / "fit.json"
    assert main(_command(CALIBRATE, run, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fit_error.max_abs_pct" in err[0] and "nothing written" in err[0], err
    assert not out.exists()


@pytest.fixture()
def read_only(tmp_path):
    """Make directories read-only for this process (chmod; as root, whom modes do not stop, the immutable
    attribute), undone afterwards so the temporary tree can be removed."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o555)
        elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("root without chattr +i: no way to make a directory read-only here")
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() != 0:
            path.chmod(0o755)
        else:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@pytest.mark.hostile
@pytest.mark.parametrize("where", ["run_dir", "out_dir"])
def test_report_into_a_read_only_directory_is_one_line(where, base, tmp_path, read_only, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    args = ["report", str(run)]
    target = run
    if where == "out_dir":  # the run's own directory is writable, --out's is not: nothing is drawn anywhere
        target = tmp_path / "plots"
        target.mkdir()
        args += ["--out", str(target / "perf.png")]
    before = snapshot(tmp_path)
    read_only(target)
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"scaletrain: error: {target}: cannot write") and "nothing written" in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.hostile
def test_report_whose_plot_path_is_a_directory_is_one_line(base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    (run / "perf.png").mkdir()  # a careless earlier command: the plot's path is taken by a directory
    before = snapshot(tmp_path)
    code = main(["report", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"scaletrain: error: {run / 'perf.png'}: cannot write")
    assert snapshot(tmp_path) == before  # loss.png not drawn either


# `sim calibrate --layer-timings JSON` (benchmarks/gpu_mfu.py's output) is read the same way.
TIMINGS = [
    ("deep", _deep(), "nested more than"),
    ("list", "[]", "not a layer-timings file"),
    ("inner_list", json.dumps({"layer_timings": []}), "not a layer-timings file"),
    ("gpu_number", json.dumps({"gpu": 5}), "gpu=5"),
    (
        "block_without_model",
        json.dumps({"gpu": "h100", "blocks": [{"fwd_s": 0.1, "bwd_s": 0.2, "mbs": 1}]}),
        "missing 'model'",
    ),
    (
        "block_time_string",
        json.dumps({"gpu": "h100", "blocks": [{"model": "gpt3-proxy", "mbs": 1, "fwd_s": "x", "bwd_s": 0.2}]}),
        "not a layer-timings file",
    ),
]


@pytest.mark.hostile
@pytest.mark.parametrize("text, expected", [t[1:] for t in TIMINGS], ids=[t[0] for t in TIMINGS])
def test_crafted_layer_timings_are_one_line(text, expected, tmp_path, capsys):
    path = tmp_path / "gpu_mfu.json"
    path.write_text(text)
    before = snapshot(tmp_path)
    code = main(["sim", "calibrate", "--layer-timings", str(path), "--out", str(tmp_path / "fit.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"scaletrain: error: {path}: ") and expected in err[0], err[0]
    assert snapshot(tmp_path) == before
