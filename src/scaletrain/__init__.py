"""scaletrain: train GPT-3/Llama-style decoders at cluster scale, benchmark them the MLPerf way, predict time-to-train.

Packages in layers, lowest first; a module imports only from its own package or lower layers, function-level
imports included (a local import may delay a heavy import, never hide an upward one):
  0 `config`, `log`, `benchmarks`   1 `sim` (torch-free)   2 `data`, `model` (data reads only `model.loss`)
  3 `parallel`   4 `checkpoint`   5 `train`   6 `bench`   7 `cli`.
Each package's docstring says what it is for and what it may import.
"""

__version__ = "0.1.0"
