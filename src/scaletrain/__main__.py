"""`python -m scaletrain` (also what `torchrun -m scaletrain` runs)."""

import sys

from scaletrain.cli import main

sys.exit(main())
