"""The first hour's own-data path end to end: `data prepare` on 300 short documents with default flags, then
`scaletrain train` with exactly the line it printed (and a tiny model), no model.vocab_size anywhere."""

from __future__ import annotations

import json
import random
import shlex

from scaletrain.cli.main import main
from scaletrain.data.prepare import read_meta

TINY = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "train.dtype=fp32",
    "train.threads=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.eval_interval_samples=16",
    "train.max_steps=2",
    "train.progress=false",
]

WORDS = "the a cat dog sat on mat river stone light over under quick brown fox jumps lazy green tree".split()


def write_corpus(path, n_docs=300):
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(8, 30))) + "."}) for _ in range(n_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_train_on_prepared_data_takes_its_vocabulary(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "my.jsonl")
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "data" / "mine")]) == 0
    out = capsys.readouterr().out
    printed = next(line for line in out.splitlines() if line.startswith("train on it: scaletrain train "))
    argv = shlex.split(printed.split(": ", 1)[1])[1:]
    run = tmp_path / "run"
    code = main([*argv, *(a for s in TINY for a in ("--set", s)), "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 0, err
    vocab = read_meta(tmp_path / "data" / "mine")["vocab_size"]
    assert vocab < 8192 and f"model.vocab_size={vocab} from " in err
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["vocab_size"] == vocab
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 2 and result["outcome"] == "budget_exhausted"
