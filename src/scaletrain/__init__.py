"""scaletrain: train GPT-3/Llama-style decoders at cluster scale, benchmark them the MLPerf way, predict time-to-train."""

__version__ = "0.1.0"
