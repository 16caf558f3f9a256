"""The command line: argument parsing and printing, nothing that a library caller needs.

`main` wires every subcommand to argparse and maps errors to exit codes; `sim` holds the simulator's commands
(predict, plan, sim validate / plot / calibrate), `calibrate_modes` the two `sim calibrate` modes that read run
directories or layer timings, `run_lines` the launch lines `plan` prints, `plot` the scaling plots and `data` the
`scaletrain data` commands. The top layer: it may import every package, and nothing imports it but `__main__`.
"""

# The console script `scaletrain = "scaletrain.cli:entry"` (pyproject.toml) kept its name when cli.py became this
# package; `main` is left to name the module scaletrain.cli.main.
from scaletrain.cli.main import entry

__all__ = ["entry"]
