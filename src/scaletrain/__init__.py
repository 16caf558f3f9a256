"""scaletrain: train GPT-3/Llama-style decoders at cluster scale, benchmark them the MLPerf way, predict time-to-train.

Packages, lowest first; each imports only from those before it: `config` <- `data`, `model` <- `parallel` <-
`checkpoint` <- `train` <- `bench` <- `cli`. `sim` (the time-to-train model) imports only `config` and the torch-free
`model.flops`. Each package's docstring names what it may import and any exception still to be removed (issue 13).
"""

__version__ = "0.1.0"
