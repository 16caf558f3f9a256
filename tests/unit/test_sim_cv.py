"""`sim validate --cv loo|scale`: out-of-sample scores with the fit `sim calibrate` runs (lora rows only: their fits
take about a second; a full leave-one-out on every calibration row takes minutes and is the CLI's job)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from importlib import resources

import pytest

from scaletrain.cli.main import main
from scaletrain.sim.efficiency import Efficiency
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.results import load_results
from scaletrain.sim.fit.validate import cross_validate, default_thresholds, newest_rounds

# The known answer: rows whose times the model gives at the priors, where the fit starts. The objective there is 0
# (no data error, no pull toward the priors) and positive anywhere else, so a correct fit must return it exactly.
# Rows without measured terms (synthetic times) are fitted on their run minutes.
TRUE = replace(Efficiency(), **cal.NOT_FITTED)


def _lora_csv() -> tuple[list[str], list[dict]]:
    text = (resources.files("scaletrain.sim") / "data" / "mlperf_llama2_lora_calibration.csv").read_text()
    reader = csv.DictReader(io.StringIO(text))
    return list(reader.fieldnames or []), list(reader)


def _write(fields: list[str], rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


def _prepared(text: str) -> list:
    rep = load_results(text)
    assert not rep.errors
    ready, bad = cal.prepare(rep.rows, terms={})
    assert not bad
    return ready


def _synthetic(pick: list[int], slow: int = -1, factor: float = 1.0) -> str:
    """Real lora layouts and convergence, with the times the model itself gives at TRUE (row `slow` x `factor`)."""
    fields, rows = _lora_csv()
    rows = [rows[i] for i in pick]
    for i, (raw, r) in enumerate(zip(rows, _prepared(_write(fields, rows)))):
        f = factor if i == slow else 1.0
        raw["run_minutes"] = ";".join(f"{f * r.minutes(TRUE, c, True):.9f}" for c in r.runs)
        raw["score_minutes"] = f"{f * r.minutes(TRUE, r.rcp, True):.9f}"
        raw["scaling_factor"] = "-"
    return _write(fields, rows)


def _mape(scores) -> float:
    return sum(abs(s.error) for s in scores) / len(scores)


def test_loo_recovers_rows_generated_from_a_known_efficiency():
    # v4.0 and v4.1 H100 at 8 and 64 GPUs, and the B200 row (alone in its set: predicted from v4.1/hopper).
    rows = _prepared(_synthetic([0, 1, 3, 4, 6]))
    cv = cross_validate(rows, "loo")
    assert cv["fit_rows"] == len(rows) - 1 and len(cv["scores"]) == len(rows)
    assert max(abs(s.error) for _, _, s in cv["scores"]) < 1e-6
    assert max(abs(s.perf_error) for _, _, s in cv["scores"]) < 1e-6
    assert [used for _, used, _ in cv["scores"]][-1] == "v4.1/hopper"


def test_loo_never_fits_the_row_it_scores():
    # One row 10% slower than the model at TRUE: left out, the others are exactly consistent with TRUE, so its
    # out-of-sample error is exactly 1/1.1 - 1; in sample the fit leans toward it and hides part of the error.
    rows = _prepared(_synthetic([0, 1, 3, 4, 6], slow=1, factor=1.1))
    cv = cross_validate(rows, "loo")
    held = cv["scores"][1][2]
    assert held.error == pytest.approx(1 / 1.1 - 1, abs=1e-6)
    assert abs(cv["in_sample"][1].error) < abs(held.error) - 0.005
    # Refits in separate processes (the CLI's default) give the same numbers.
    par = cross_validate(rows, "loo", jobs=2)
    assert [s.error for _, _, s in par["scores"]] == [s.error for _, _, s in cv["scores"]]


def test_loo_error_is_at_least_the_in_sample_error_on_real_rows():
    fields, rows = _lora_csv()
    cv = cross_validate(_prepared(_write(fields, rows[:5])), "loo")
    loo, ins = _mape([s for _, _, s in cv["scores"]]), _mape(cv["in_sample"])
    assert loo >= ins > 0
    assert [r.line for r, _, _ in cv["scores"]] == [2, 3, 4, 5, 6]


def test_scale_split_never_fits_the_rows_it_scores():
    fields, rows = _lora_csv()
    outlier = dict(rows[4])  # v4.1 eos_n8, 64 GPUs: three times slower than published
    outlier["system"] = "outlier_n8"
    outlier["run_minutes"] = ";".join(f"{3 * float(m):.3f}" for m in outlier["run_minutes"].split(";"))
    outlier["score_minutes"] = f"{3 * float(outlier['score_minutes']):.3f}"
    clean, planted = _prepared(_write(fields, rows)), _prepared(_write(fields, rows + [outlier]))
    assert default_thresholds(planted) == {"llama2_70b_lora": 64}  # distinct counts 8 and 64: the upper one
    a, b = cross_validate(clean, "scale"), cross_validate(planted, "scale")
    assert a["fit_rows"] == b["fit_rows"] == 5 and {r.gpus for r, _, _ in b["scores"]} == {64}
    assert a["sets"] == b["sets"]
    assert b["scores"][-1][0].system == "outlier_n8" and b["scores"][-1][2].error < -0.6
    # In the fit the same row does move it: the check above can fail.
    leaked = cal.fit([r for r in planted if r.row.gpus < 64] + [planted[-1]])
    assert {k: e.to_dict() for k, e in sorted(leaked.items())} != a["sets"]


def test_cli_json_adds_cv_and_keeps_the_keys(tmp_path, capsys):
    fields, rows = _lora_csv()
    path = tmp_path / "lora.csv"
    path.write_text(_write(fields, rows))
    assert main(["sim", "validate", "--results", str(path), "--cv", "scale", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"rows", "summary", "skipped", "cv"} and len(out["rows"]) == 7
    cv = out["cv"]
    assert cv["mode"] == "scale" and cv["thresholds"] == {"llama2_70b_lora": 64} and cv["fit_rows"] == 5
    assert [r["gpus"] for r in cv["rows"]] == [64, 64] and {"set", "in_sample_error"} <= set(cv["rows"][0])
    s = cv["summary"]["llama2_70b_lora"]
    assert s["ttt"]["rows"] == 2 and s["ttt"]["mape_pct"] >= 0 and "in_sample_ttt" in s
    assert main(["sim", "validate", "--results", str(path), "--cv", "scale"]) == 0
    text = capsys.readouterr().out
    assert "scale split (rows at or above llama2_70b_lora 64 GPUs predicted by sets fitted on the 5 rows below)" in text
    assert "llama2_70b_lora: 2 rows, scale split time-to-train MAPE" in text


@pytest.mark.parametrize("argv", [["--cv", "kfold"], ["--cv", "scale", "--cv-threshold", "0"]])
def test_bad_cv_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim", "validate", *argv])
    assert e.value.code == 2


def test_a_threshold_that_leaves_nothing_to_fit_is_an_error(tmp_path, capsys):
    fields, rows = _lora_csv()
    path = tmp_path / "lora.csv"
    path.write_text(_write(fields, rows))
    assert main(["sim", "validate", "--results", str(path), "--cv", "scale", "--cv-threshold", "8"]) == 2
    assert "leave 0 rows to fit" in capsys.readouterr().err


def test_round_split_never_fits_a_row_of_the_round_it_scores(tmp_path, capsys):
    fields, rows = _lora_csv()  # 3 rows of v4.0, 4 of v4.1
    outlier = dict(rows[4])  # a v4.1 row three times slower than published
    outlier["system"] = "outlier_n8"
    outlier["run_minutes"] = ";".join(f"{3 * float(m):.3f}" for m in outlier["run_minutes"].split(";"))
    outlier["score_minutes"] = f"{3 * float(outlier['score_minutes']):.3f}"
    clean, planted = _prepared(_write(fields, rows)), _prepared(_write(fields, rows + [outlier]))
    assert newest_rounds(planted) == {"llama2_70b_lora": "v4.1"}
    a, b = cross_validate(clean, "round"), cross_validate(planted, "round")
    assert a["fit_rows"] == b["fit_rows"] == {"v4.1": 3}
    assert {r.round for r, _, _ in b["scores"]} == {"v4.1"} and len(b["scores"]) == 5
    assert a["sets"] == b["sets"]  # the outlier is only scored
    assert all(used.startswith("v4.0/") for _, used, _ in b["scores"])  # v4.1's own set is never fitted
    assert b["scores"][-1][0].system == "outlier_n8" and b["scores"][-1][2].error < -0.6
    path = tmp_path / "lora.csv"
    path.write_text(_write(fields, rows))
    assert main(["sim", "validate", "--results", str(path), "--cv", "round", "--json"]) == 0
    cv = json.loads(capsys.readouterr().out)["cv"]
    assert cv["mode"] == "round" and cv["rounds"] == {"llama2_70b_lora": "v4.1"} and cv["fit_rows"] == {"v4.1": 3}
    assert main(["sim", "validate", "--results", str(path), "--cv", "round"]) == 0
    assert "llama2_70b_lora v4.1 from 3 rows" in capsys.readouterr().out


def test_a_round_split_needs_two_rounds(tmp_path, capsys):
    fields, rows = _lora_csv()
    path = tmp_path / "lora.csv"
    path.write_text(_write(fields, [r for r in rows if r["round"] == "4.1"]))
    assert main(["sim", "validate", "--results", str(path), "--cv", "round"]) == 2
    assert "no benchmark has rows from two rounds" in capsys.readouterr().err
