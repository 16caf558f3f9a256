"""`python -m scaletrain` (also what `torchrun -m scaletrain` runs)."""

from scaletrain.cli.main import entry

entry()
