"""The project logger: line format, the rank filter behind --log-ranks, and its parse errors."""

from __future__ import annotations

import pytest

from scaletrain.cli.main import main
from scaletrain.log import get_logger, parse_log_ranks, setup_logging

log = get_logger("scaletrain.test_log")


@pytest.fixture(autouse=True)
def _default_logging(monkeypatch):
    # Every test starts and ends with the handler a plain import installs (rank 0, ranks "0").
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    setup_logging()
    yield
    setup_logging()


def test_warning_error_and_status_lines(capsys):
    log.warning("disk nearly full")
    log.error("no such file")
    log.info("moved the previous run aside")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "scaletrain: warning: disk nearly full",
        "scaletrain: error: no such file",
        "moved the previous run aside",
    ]


def test_other_ranks_are_silent_by_default_and_prefixed_when_shown(capsys):
    setup_logging("0", rank=1)
    log.warning("from rank 1")
    log.info("status of rank 1")
    assert capsys.readouterr().err == ""
    setup_logging("all", rank=1)
    log.warning("from rank 1")
    assert capsys.readouterr().err == "[rank 1] scaletrain: warning: from rank 1\n"
    setup_logging("0,3", rank=3)
    log.warning("from rank 3")
    assert capsys.readouterr().err == "[rank 3] scaletrain: warning: from rank 3\n"
    setup_logging("0,3", rank=2)
    log.warning("from rank 2")
    assert capsys.readouterr().err == ""


def test_errors_pass_the_rank_filter(capsys):
    setup_logging("0", rank=2)
    log.error("rank 2 alone failed")
    assert capsys.readouterr().err == "[rank 2] scaletrain: error: rank 2 alone failed\n"


def test_launcher_rank_decides_by_default(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    setup_logging()
    log.warning("hidden")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    setup_logging()
    log.warning("shown")
    assert capsys.readouterr().err == "scaletrain: warning: shown\n"


def test_setup_twice_keeps_one_handler(capsys):
    setup_logging("all")
    setup_logging("all")
    log.warning("once")
    assert capsys.readouterr().err == "scaletrain: warning: once\n"


@pytest.mark.parametrize(
    ("spec", "ranks"), [("0", {0}), ("0,3", {0, 3}), (" 2 , 5 ", {2, 5}), ("all", None), ("ALL", None)]
)
def test_parse_log_ranks(spec, ranks):
    assert parse_log_ranks(spec) == ranks


@pytest.mark.parametrize("spec", ["", ",", "x", "0,x", "-1", "0;3", "1.5"])
def test_parse_log_ranks_refuses(spec):
    with pytest.raises(ValueError, match="expected 'all' or comma-separated rank numbers"):
        parse_log_ranks(spec)


def test_cli_bad_log_ranks_is_one_line_and_exit_2(capsys):
    code = main(["--log-ranks", "0,x", "config"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err == (
        "scaletrain: error: --log-ranks '0,x': expected 'all' or comma-separated rank numbers like '0,3'\n"
    )


def test_cli_log_ranks_all_runs_the_command(capsys):
    assert main(["--log-ranks", "all", "config", "--preset", "gpt3-proxy"]) == 0
    assert '"arch": "gpt3"' in capsys.readouterr().out
