"""`scaletrain bench check LOG`: rules found inside the package, from any directory (5 checker calls, ~1 s each)."""

from __future__ import annotations

import pytest

from scaletrain.bench.harness import run_once
from scaletrain.bench.scripted import ScriptedEngine
from scaletrain.cli.main import main
from scaletrain.config import resolve


@pytest.fixture(scope="module")
def proxy_run(tmp_path_factory):
    """A converged gpt3-proxy run directory (mllog.txt, config.json) written by the real harness."""
    cfg = resolve("gpt3-proxy", overrides=["train.target_eval_loss=5.6"])
    run_dir = tmp_path_factory.mktemp("bench") / "run_0"
    run_once(cfg, ScriptedEngine(cfg, eval_losses=[6.0, 5.5], eval_tokens=4096), run_dir)
    cfg.save(run_dir)
    return run_dir


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_check_passes_with_the_benchmark_from_config_json(proxy_run, elsewhere, capsys):
    (proxy_run / "compliance_checker.log").write_text("stale\n")
    assert main(["bench", "check", str(proxy_run / "mllog.txt")]) == 0
    assert capsys.readouterr().out.strip() == f"{proxy_run / 'mllog.txt'}: pass (gpt3-proxy rules, ruleset 4.1.0)"
    # The checker's own log goes to the run directory, replaced, and nothing is left in the working directory.
    log = (proxy_run / "compliance_checker.log").read_text()
    assert "SUCCESS" in log and "stale" not in log
    assert list(elsewhere.iterdir()) == []


def test_check_fails_against_other_rules(proxy_run, elsewhere, capsys):
    # The official gpt3 rules demand seq 2048: the proxy log fails them, exit 1, with the checker's reasons.
    assert main(["bench", "check", str(proxy_run), "--benchmark", "gpt3"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"{proxy_run / 'mllog.txt'}: FAIL (gpt3 rules, ruleset 4.1.0)"
    assert "max_sequence_length" in out
    assert list(elsewhere.iterdir()) == []


def test_check_needs_a_benchmark_without_config_json(proxy_run, elsewhere, capsys):
    lone = elsewhere / "mllog.txt"
    lone.write_text((proxy_run / "mllog.txt").read_text())
    assert main(["bench", "check", str(lone)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scaletrain: error: bench check") and "pass --benchmark NAME" in err
    assert len(err.splitlines()) == 1
    assert main(["bench", "check", str(lone), "--benchmark", "gpt3-proxy"]) == 0
    assert main(["bench", "--benchmark", "gpt3-proxy", "check", str(lone)]) == 0
    capsys.readouterr()
    (elsewhere / "config.json").write_text("[1, 2")
    assert main(["bench", "check", str(lone)]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json: not a scaletrain config.json; pass --benchmark NAME" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "check", "no/such/mllog.txt"], "no/such/mllog.txt: no such MLLOG file"),
        (["bench", "check", "{run}", "--benchmark", "resnet"], "benchmark 'resnet' has no compliance rules"),
    ],
)
def test_check_bad_input_is_one_line_exit_2(proxy_run, elsewhere, capsys, argv, needle):
    assert main([a.replace("{run}", str(proxy_run)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
