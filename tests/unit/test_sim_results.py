"""Published-results loader: the carried calibration rows, and what a malformed file does."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from importlib import resources

import pytest

from scaletrain.benchmarks import BENCHMARKS
from scaletrain.sim.fit.results import PublishedResult, ResultsError, bundled_results, gpu_key, load_results

GPT3_HEADER = (
    "benchmark,round,submitter,system,accelerator,n_accel,n_nodes,interconnect,framework,gbs,tp,pp,vp,"
    "mbs,fp8,n_runs,run_minutes,score_minutes,run_tokens_to_converge,source"
)
GOOD = (
    'gpt3,3.1,NVIDIA,"sys, with comma",NVIDIA H100-SXM5-80GB,512,64,IB,NeMo,2048,4,8,12,1,yes,3,'
    "58.247;58.353;58.302,58.302,1207959552;1207959552;1207959552,src"
)
LORA_HEADER = (
    "benchmark,round,submitter,system,accelerator,n_accel,gbs,parallelism,interconnect,n_runs,"
    "run_minutes,olympic_minutes,scaling_factor,score_minutes,run_samples_to_converge,source"
)


def _one(**changes) -> str:
    """GOOD with some fields replaced, by header name."""
    header = GPT3_HEADER.split(",")
    row = next(csv.reader([GOOD]))
    for k, v in changes.items():
        row[header.index(k)] = v
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(row)
    return out.getvalue()


def test_every_bundled_row_loads_cleanly():
    for bench, spec in BENCHMARKS.items():
        if not spec.calibration_file:  # gpt_oss_20b, deepseekv3_671b: no published result yet
            assert not bundled_results(bench)
            continue
        text = resources.files("scaletrain.sim").joinpath("data", spec.calibration_file).read_text("utf-8")
        report = load_results(text)
        # The llama31_8b file's HPE H200 row names no config (no tp/cp): skipped as unknown, nothing else.
        assert report.errors == report.unknown_layout == ([(7, report.errors[0][1])] if bench == "llama31_8b" else [])
        assert len(report.rows) + len(report.errors) == len(text.strip().splitlines()) - 1
        assert {r.benchmark for r in report.rows} == {bench}
    # 7 v4.x rows plus the 91 of the 102 v5.0/v5.1 rows whose layout is known (bundled_skipped names the other 11).
    assert len(bundled_results("gpt3")) == 10 and len(bundled_results("llama2_70b_lora")) == 98
    # llama31: the 16 405B rows and 24 of the 25 8B ones.
    assert len(bundled_results("llama31_405b")) == 16 and len(bundled_results("llama31_8b")) == 24
    assert len(bundled_results()) == 148
    with pytest.raises(ValueError, match="unknown benchmark"):
        bundled_results("bert")


def test_bundled_spot_checks():
    big = next(r for r in bundled_results("gpt3") if r.gpus == 4096)
    assert (big.round, big.gbs, big.tp, big.pp, big.vp, big.cp, big.mbs) == ("v3.1", 2048, 4, 8, 12, 1, 1)
    assert (big.score_minutes, big.nodes, big.gpu, big.fp8, big.line) == (8.574, 512, "h100", True, 6)
    assert big.run_minutes == (8.566, 8.574, 8.588) and big.run_converge == (1207959552,) * 3
    b200 = next(r for r in bundled_results("gpt3") if r.gpu == "b200")
    assert b200.system == "b200_n8_preview_nemo (Nyx, 8x DGX B200)"  # quoted field with a comma
    h200 = next(r for r in bundled_results("llama2_70b_lora") if r.gpu == "h200" and r.round == "v4.1")
    assert (h200.tp, h200.pp, h200.cp, h200.vp, h200.mbs, h200.fp8) == (1, 1, 2, 1, 1, True)
    assert (h200.gpus, h200.nodes, h200.gbs, h200.accelerator) == (8, 1, 8, "H200-SXM5-141GB")
    assert h200.scaling_factor == pytest.approx(1.0033670033670032) and len(h200.run_converge) == 10
    n8 = next(r for r in bundled_results("llama2_70b_lora") if r.gpus == 64 and r.round == "v4.0")
    assert (n8.nodes, n8.tp, n8.cp, n8.dp, n8.scaling_factor) == (8, 4, 2, 8, pytest.approx(1.0033670033670032))
    h200_v40 = next(r for r in bundled_results("llama2_70b_lora") if r.gpu == "h200" and r.round == "v4.0")
    assert h200_v40.scaling_factor == 1.0


def test_gpt3_scores_are_the_median_of_three():
    for r in bundled_results("gpt3"):
        assert len(r.run_minutes) == 3
        assert r.score_minutes == pytest.approx(sorted(r.run_minutes)[1], abs=5e-4)
        assert r.olympic_minutes == pytest.approx(r.score_minutes, abs=5e-4)


def test_lora_olympic_minutes_column_and_score_scaling():
    text = (
        resources.files("scaletrain.sim")
        .joinpath("data", BENCHMARKS["llama2_70b_lora"].calibration_file)
        .read_text("utf-8")
    )
    published = {int(i) + 2: row for i, row in enumerate(csv.DictReader(io.StringIO(text)))}
    for r in (r for r in bundled_results("llama2_70b_lora") if not r.file):  # the v4.x file has this column
        runs = sorted(r.run_minutes)
        by_hand = sum(runs[1:-1]) / 8  # 10 runs: drop 1 fastest and 1 slowest
        assert r.olympic_minutes == pytest.approx(by_hand)
        assert r.olympic_minutes == pytest.approx(float(published[r.line]["olympic_minutes"]), abs=6e-4)
        assert r.score_minutes == pytest.approx(r.olympic_minutes * r.scaling_factor, abs=6e-4)


@pytest.mark.parametrize(
    "text,key",
    [
        ("NVIDIA H100-SXM5-80GB", "h100"),
        ("H200-SXM5-141GB", "h200"),
        ("NVIDIA B200-SXM-180GB", "b200"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA GB300 NVL72", "gb300"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H200-NVL-141GB", "h200nvl"),
        ("NVIDIA H200 NVL", "h200nvl"),
        ("NVIDIA Blackwell Ultra GPU (B300-SXM-270GB)", "b300"),
        ("NVIDIA Blackwell Ultra GPU (GB300)", "gb300"),
        ("AMD Instinct MI300X 192GB HBM3", "mi300x"),
        ("AMD Instinct MI325X 256GB HBM3E DLC", "mi325x"),
    ],
)
def test_gpu_key(text, key):
    assert gpu_key(text) == key


def test_gpu_key_unknown():
    with pytest.raises(ValueError, match=r"unknown accelerator 'AMD MI250X' \(known: .*h100"):
        gpu_key("AMD MI250X")


def test_missing_column_fails_the_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(GPT3_HEADER.replace(",vp,", ",").replace(",score_minutes,", ",") + "\n")
    with pytest.raises(ResultsError, match=r"bad\.csv: missing required column\(s\) score_minutes, vp"):
        load_results(path)
    with pytest.raises(ResultsError, match="parallelism"):
        load_results(LORA_HEADER.replace("parallelism,", "") + "\n")
    path.write_text("")
    with pytest.raises(ResultsError, match="empty file"):
        load_results(path)


def test_bad_rows_are_skipped_with_their_line_numbers(tmp_path):
    lines = [
        GPT3_HEADER,
        GOOD,  # 2
        _one(accelerator="AMD MI250X"),  # 3 unknown GPU
        "",  # 4 blank: ignored
        _one(n_accel="5l2"),  # 5 bad integer
        _one(run_minutes="1.0;2.0"),  # 6 wrong run count
        _one(round="v4.1", gbs="3072"),  # 7 good
        _one(fp8="maybe"),  # 8
        _one(score_minutes="0"),  # 9
        _one(tp=""),  # 10
        GOOD + ",extra",  # 11
        _one(run_tokens_to_converge="1;2"),
    ]  # 12
    path = tmp_path / "mixed.csv"
    path.write_text("\n".join(lines) + "\n")
    report = load_results(path)
    assert [(r.line, r.round, r.gbs) for r in report.rows] == [(2, "v3.1", 2048), (7, "v4.1", 3072)]
    assert report.rows[0].system == "sys, with comma"
    errors = dict(report.errors)
    assert sorted(errors) == [3, 5, 6, 8, 9, 10, 11, 12]
    assert errors[3].startswith("unknown accelerator 'AMD MI250X' (known: ")
    assert "n_accel '5l2' is not an integer" in errors[5]
    assert "run_minutes has 2 values but n_runs is 3" in errors[6]
    assert "fp8" in errors[8] and "score_minutes" in errors[9] and "'tp'" in errors[10]
    assert "expected 20 fields, got 21" in errors[11] and "run_tokens_to_converge" in errors[12]
    with pytest.raises(ResultsError, match=r"mixed\.csv line 3: unknown accelerator"):
        load_results(path, strict=True)


def test_lora_layout_parsing_and_defaults():
    row = (
        'llama2_70b_lora,v4.1,X,sys,NVIDIA GB200,72,9,"TP2 PP1 CP4, FP8",-,10,'
        + ";".join(["5.0"] * 10)
        + ",5.0,-,5.0,,src"
    )
    r = load_results(LORA_HEADER + "\n" + row + "\n", strict=True).rows[0]
    assert (r.gpu, r.tp, r.pp, r.cp, r.vp, r.mbs, r.fp8, r.nodes) == ("gb200", 2, 1, 4, 1, 1, True, 9)
    assert r.run_converge == () and r.scaling_factor == 1.0 and r.interconnect == "-"
    bf16 = load_results(LORA_HEADER + "\n" + row.replace('"TP2 PP1 CP4, FP8"', "TP8 PP2") + "\n").rows[0]
    assert (bf16.tp, bf16.pp, bf16.cp, bf16.fp8) == (8, 2, 1, False)
    bad = load_results(LORA_HEADER + "\n" + row.replace("TP2 PP1", "TP2 xx") + "\n")
    assert bad.rows == [] and bad.errors[0][0] == 2 and "parallelism" in bad.errors[0][1]
    odd = load_results(LORA_HEADER + "\n" + row.replace(",72,", ",12,") + "\n").rows[0]
    assert odd.nodes is None  # 12 GPUs is not whole 8-GPU nodes


def test_unreadable_path():
    with pytest.raises(ResultsError, match="cannot read"):
        load_results("/nonexistent/results.csv")


def test_no_heavy_imports():
    code = (
        "import sys; import scaletrain.sim.fit.results, scaletrain.sim.mlperf as m; m.rcp_mean('gpt3', 2048); "
        "print([x for x in ('torch', 'numpy', 'mlperf_logging') if x in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_published_result_is_frozen():
    r = bundled_results("gpt3")[0]
    assert isinstance(r, PublishedResult)
    with pytest.raises(AttributeError):
        r.gbs = 1  # type: ignore[misc]
