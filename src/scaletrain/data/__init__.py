"""Data layer: MMIDIDX datasets, SentencePiece tokenizer, MLPerf gpt3 samples, default Shakespeare corpus.

Modules: indexed (.bin/.idx read/write, DataError), tokenizer, samples (TrainSamples, ValidSamples),
prepare (raw text -> dataset, checked loading), corpus (default corpus and packaged excerpt),
sft (input/output pairs packed for fine-tuning, loss on outputs only), sft_paths (where a config's SFT sets are),
kjv (builds the SFT proxy set: King James Bible).
Layer 2: may import `config`, `log`, `benchmarks`, `sim`, numpy/torch and, of `model/`, only `model.loss`
(IGNORE_INDEX, the loss's label convention, defined once there); never `parallel`, `checkpoint`, `train`, `bench`
or `cli`. Only DataError is imported here, so `import scaletrain.data` stays cheap (no torch).
"""

from .indexed import DataError

__all__ = ["DataError"]
