"""The calibration rows' logs broken into terms (sim/fit/terms.py): read as checked data, reduced to medians, joined
to every shipped calibration row, and scored term by term by `sim validate --terms`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from scaletrain.cli.main import main
from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.fit import calibrate as cal
from scaletrain.sim.fit.results import bundled_results
from scaletrain.sim.fit.terms import TermsError, bundled_terms, load_terms, score_terms, terms_summary

HEADER = "benchmark,round,submitter,system,n_accel,gbs,run,decomposed,step_s,eval_s,first_eval_s,one_off_s,samples_to_converge"


def _write(tmp_path, *lines: str):
    path = tmp_path / "x_terms.csv"
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return path


def test_medians_over_the_decomposed_runs_of_a_row(tmp_path):
    path = _write(
        tmp_path,
        "gpt3,v4.1,N,sys_a,512,2048,0,yes,10.0,5.0,6.0,2.0,100",
        "gpt3,v4.1,N,sys_a,512,2048,1,yes,12.0,7.0,8.0,-1.0,300",
        "gpt3,v4.1,N,sys_a,512,2048,2,yes,11.0,6.0,7.0,4.0,200",
        "gpt3,v4.1,N,sys_a,512,2048,3,no,,,,,",  # no run_stop: not decomposed, left out
        "gpt3,v4.1,N,sys_b,1024,2048,0,yes,6.0,3.0,3.5,1.0,150",
    )
    terms = load_terms([path])
    a = terms[("gpt3", "v4.1", "sys_a", 512)]
    assert (a.runs, a.step_s, a.eval_s, a.first_eval_s, a.one_off_s, a.samples_to_converge) == (3, 11, 6, 7, 2, 200)
    assert terms[("gpt3", "v4.1", "sys_b", 1024)].runs == 1


@pytest.mark.hostile
@pytest.mark.parametrize(
    "line, why",
    [
        ("gpt3,v4.1,N,s,512,2048,0,yes,nan,5,6,2,100", "step_s='nan' is not finite"),
        ("gpt3,v4.1,N,s,512,2048,0,yes,-1,5,6,2,100", "step_s='-1' must be > 0"),
        ("gpt3,v4.1,N,s,512,2048,0,yes,ten,5,6,2,100", "step_s='ten' is not a number"),
        ("gpt3,v4.1,N,s,0.5,2048,0,yes,10,5,6,2,100", "n_accel='0.5' is not a GPU count"),
    ],
)
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, why):
    path = _write(tmp_path, "gpt3,v4.1,N,s,512,2048,0,yes,10,5,6,2,100", line)
    with pytest.raises(TermsError, match=f"x_terms.csv line 3: {why}"):
        load_terms([path])


@pytest.mark.hostile
def test_a_file_that_is_not_a_terms_file_is_refused(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("benchmark,round\ngpt3,v4.1\n")
    with pytest.raises(TermsError, match="other.csv: not a terms file, no column system"):
        load_terms([path])


def test_every_shipped_calibration_row_has_its_terms():
    # The join key (benchmark, round, system, GPUs) must find every row the simulator scores: a row without terms
    # would silently drop out of the per-term scores.
    rows = bundled_results()
    ready, _ = cal.prepare(rows, load_catalog())
    terms = bundled_terms()
    missing = [(r.row.benchmark, r.row.round, r.row.system, r.row.gpus) for r in ready if not _has(terms, r)]
    assert ready and not missing
    # Each row's median run time from its terms is its published runs' (the identity the terms README checks).
    for r in ready:
        m = terms[(r.row.benchmark, r.row.round, r.row.system, r.row.gpus)]
        assert m.runs >= 1 and m.step_s > 0 and m.eval_s > 0


def _has(terms, r) -> bool:
    return (r.row.benchmark, r.row.round, r.row.system, r.row.gpus) in terms


def test_scores_are_predicted_over_measured_per_term(tmp_path):
    path = _write(tmp_path, "gpt3,v4.1,N,sys_a,512,2048,0,yes,10.0,4.0,5.0,2.0,100")
    row = SimpleNamespace(
        row=SimpleNamespace(benchmark="gpt3", round="v4.1", system="sys_a", gpus=512),
        timing=lambda eff, event: (11.0, 3.0, 8.0),
        one_off_s=lambda eff: 8.0,
    )
    other = SimpleNamespace(row=SimpleNamespace(benchmark="gpt3", round="v4.1", system="sys_z", gpus=8))
    scored = score_terms([row, other], lambda r: None, load_terms([path]))
    assert len(scored) == 1  # a row without terms is not scored
    s = scored[0]
    assert s["step_s"]["error"] == pytest.approx(0.1)
    assert s["eval_s"]["error"] == pytest.approx(-0.25)
    assert s["one_off_s"]["error"] == pytest.approx((8 - 2) / 5)  # relative to the 5 s floor, not to 2 s
    summary = terms_summary(scored)
    assert summary["gpt3"]["step_s"] == {
        "rows": 1,
        "bias_pct": pytest.approx(10),
        "mape_pct": pytest.approx(10),
        "max_pct": pytest.approx(10),
    }
    assert summary["all"] == summary["gpt3"]


def test_validate_terms_scores_every_benchmark(capsys):
    assert main(["sim", "validate", "--terms", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["terms"]["rows"]
    assert len(rows) == len(doc["rows"])  # every scored row has its terms
    assert set(doc["terms"]["summary"]) == {r["benchmark"] for r in doc["rows"]} | {"all"}
    for r in rows:
        for term in ("step_s", "eval_s", "one_off_s"):
            assert math.isfinite(r[term]["error"]) and r[term]["measured"] == r[term]["measured"]
    assert main(["sim", "validate", "--terms"]) == 0
    text = capsys.readouterr().out
    assert "terms against the public logs" in text and "llama2_70b_lora  evaluation" in text
    # Without the flag the output keeps its keys (an interface others read).
    assert main(["sim", "validate", "--json"]) == 0
    assert "terms" not in json.loads(capsys.readouterr().out)
