"""What a newcomer meets first: --version, --help that explains every flag and the `--section.field` shorthand, and
a quiet exit when the reader of stdout leaves early (`scaletrain config | head`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys

import pytest

from scaletrain.cli.main import EXIT_STDOUT_CLOSED, build_parser, main, subcommand_parsers


def _parsers():
    parser = build_parser()
    return [((), parser), *subcommand_parsers(parser)]


def _meaning(text: str) -> list[str]:
    """The words of a help text, less a "(default ...)" remark: what is left must say what the flag does."""
    return re.sub(r"\(default[^)]*\)", "", text).split()


def test_every_flag_and_subcommand_has_a_real_help_sentence():
    problems = []
    for path, parser in _parsers():
        where = " ".join(("scaletrain", *path))
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if len(_meaning(choice.help or "")) < 3:
                        problems.append(f"{where} {choice.dest}: help {choice.help!r}")
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            if action.help == argparse.SUPPRESS:
                continue
            if len(_meaning(action.help or "")) < 3:  # "tp degree", "print JSON", nothing
                problems.append(f"{where} {name}: help {action.help!r}")
            # A flag that takes a value names what (`--tp N`), not argparse's upper-cased dest (`--tp TP`).
            if action.option_strings and action.nargs != 0 and action.metavar is None and not action.choices:
                problems.append(f"{where} {name}: no metavar")
    assert not problems, "\n".join(problems)


def test_help_shows_the_field_flag_shorthand_and_metavars(capsys):
    for argv in (["--help"], ["train", "--help"], ["bench", "--help"], ["config", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
        assert exc.value.code == 0
        assert "--train.max_steps 5" in out and "--set train.max_steps=5" in out, argv
    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tp N tensor-parallel degree" in out and "--gpus N" in out


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    try:
        want = importlib.metadata.version("scaletrain")
    except importlib.metadata.PackageNotFoundError:
        want = "not installed"
    out = capsys.readouterr().out
    assert out.startswith("scaletrain ") and want in out


@pytest.mark.hostile
@pytest.mark.parametrize("argv", [["config"], ["config", "--fields"]])
def test_a_reader_that_leaves_early_gets_no_traceback(argv):
    # The read end is closed before scaletrain writes: its first write meets a closed pipe, as under `| head` once
    # head has its lines.
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == ""
    assert proc.returncode == EXIT_STDOUT_CLOSED
