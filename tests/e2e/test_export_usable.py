"""`scaletrain export` makes a model people can use: after a plain `scaletrain train` (no checkpoint setting: the
final step is saved by default), transformers' AutoTokenizer and AutoModelForCausalLM load the export and generate()
continues a prompt; the exported tokenizer gives the run's own ids and text back, for the SentencePiece (gpt3-proxy)
and the byte-level BPE (llama31 proxies) tokenizers. A run without a checkpoint is one line naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_e2e import tiny_overrides

from scaletrain.cli.main import main
from scaletrain.data.corpus import prepare_excerpt
from scaletrain.data.tokenizer import Tokenizer, train_tokenizer

transformers = pytest.importorskip("transformers")

TWO_STEPS = ["train.max_steps=2", "train.eval_interval_samples=32", "train.target_eval_loss=0.1"]
LLAMA = [
    "model.vocab_size=1024",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=224",
    "model.seq_len=64",
    "model.rope_original_seq_len=64",
    "train.threads=1",
    "train.dtype=fp32",
    "train.progress=false",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
]
TOKENIZER_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
# Whitespace runs and line breaks (the SentencePiece model's user-defined "\n", its extra-space removal and dummy
# prefix), characters its vocabulary lacks (byte fallback), NFKC-normalized ones, digits and the excerpt's own text.
TEXTS = [
    "ROMEO. O, she doth teach the torches to burn bright!",
    "First Citizen:\nBefore we proceed any further, hear me.",
    "  two leading",
    "trailing  ",
    "a  b   c\t\td",
    "line1\nline2",
    "a \n b",
    "\nstarts",
    "ends\n",
    "\n\n\n",
    " \n ",
    "x\n\n  y \n",
    "a\r\nb",
    "café naïve",
    "日本語 and 한국어",
    "emoji 😀🎭",
    "ＡＢＣ ﬁ",
    "\u00a0nbsp\u3000wide",
    "12345 + 3.14159",
    "▁already▁escaped",
    "\x00\x07control",
    "",
    " ",
]


def _sets(*overrides):
    return [x for s in overrides for x in ("--set", s)]


def _train_and_export(tmp: Path, *args) -> Path:
    """`scaletrain train` with no checkpoint setting, then `scaletrain export RUN --hf OUT`; returns OUT."""
    run, out = tmp / "run", tmp / "exported"
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert main(["export", str(run), "--hf", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sp_export(excerpt_corpus, tmp_path_factory):
    out = _train_and_export(tmp_path_factory.mktemp("sp"), *_sets(*tiny_overrides(excerpt_corpus), *TWO_STEPS))
    return out, Tokenizer(excerpt_corpus.tokenizer)


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    corpus = prepare_excerpt(data_dir / "shakespeare-bpe", vocab_size=1024, tokenizer="bpe")
    tmp = tmp_path_factory.mktemp("bpe")
    out = _train_and_export(
        tmp, "--preset", "llama31-8b-proxy", *_sets(f"data.data_dir={data_dir}", *LLAMA, *TWO_STEPS)
    )
    return out, Tokenizer(corpus.tokenizer)


@pytest.fixture(params=["sentencepiece", "bpe"])
def exported(request):
    return request.getfixturevalue("sp_export" if request.param == "sentencepiece" else "bpe_export")


def test_transformers_loads_the_export_and_generates(exported):
    out, ours = exported
    assert sorted(p.name for p in out.iterdir()) == TOKENIZER_FILES
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = "KING. Now, my lords,\nwhat news"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.encode(prompt)  # no bos/eos added: the model was trained without
    new = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    assert len(new) == 6 and all(0 <= i < ours.vocab_size for i in new.tolist())
    assert tok.decode(new) == ours.decode(new.tolist())
    assert tok.eos_token_id == ours.eos_id == model.generation_config.eos_token_id
    assert tok.pad_token_id == ours.pad_id == model.generation_config.pad_token_id
    assert tok.model_max_length == 64
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (ours.eos_id, ours.pad_id)


def test_exported_tokenizer_round_trip_is_exact(exported):
    out, ours = exported
    tok = transformers.AutoTokenizer.from_pretrained(out)
    excerpt = (Path(__file__).parents[2] / "src/scaletrain/data/excerpt/macbeth_acts_1_2.txt").read_text()
    for text in [*TEXTS, excerpt[:3000]]:
        ids = tok(text).input_ids
        assert ids == ours.encode(text), repr(text)
        assert tok.decode(ids) == ours.decode(ids), repr(text)
    if ours.kind == "sentencepiece":
        assert any(ours.id_to_piece(i).startswith("<0x") for i in ours.encode("emoji 😀🎭"))  # byte fallback seen
    else:
        assert (out / "tokenizer.json").read_bytes() == ours.path.read_bytes()  # the run's own file, as is


@pytest.mark.hostile
def test_export_of_a_run_without_a_checkpoint_names_the_fix(excerpt_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    sets = _sets(*tiny_overrides(excerpt_corpus), *TWO_STEPS, "checkpoint.final=false")
    assert main(["train", "--run-dir", str(run), *sets]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        f"{run}: no checkpoint to export ({run / 'checkpoints'} holds none; the run's outcome: budget_exhausted)" in err
    )
    assert "checkpoint.final" in err and "checkpoint.interval_steps=N" in err and "incomplete" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.hostile
@pytest.mark.parametrize("case", ["not-a-tokenizer", "another-tokenizer"])
def test_a_tokenizer_that_is_not_the_runs_is_refused_by_name(case, sp_export, tmp_path, capsys):
    run = sp_export[0].parent / "run"
    if case == "not-a-tokenizer":
        other = tmp_path / "other.json"
        other.write_bytes(b"{}")
    else:  # a real tokenizer with the model's vocabulary size, but not the one the run's data was encoded with
        texts = sorted((Path(__file__).parents[2] / "src/scaletrain/data/excerpt").glob("k*.txt"))
        other = train_tokenizer(texts, tmp_path / "other", 1024)
    assert main(["export", str(run), "--hf", str(tmp_path / "a"), "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--tokenizer {other}: " in err, err
    if case == "another-tokenizer":
        assert "is not the tokenizer" in err and "train.meta.json was encoded with" in err, err
    assert not (tmp_path / "a").exists()


def test_the_runs_tokenizer_is_found_and_never_another(excerpt_corpus, tmp_path):
    from scaletrain.config import resolve
    from scaletrain.train.export import run_tokenizer

    def cfg(tokenizer):
        data = [f"data.train_prefix={excerpt_corpus.train_prefix}", f"data.valid_prefix={excerpt_corpus.valid_prefix}"]
        return resolve("gpt3-proxy", overrides=[*data, f"data.tokenizer={tokenizer}", "model.vocab_size=1024"])

    tok, why = run_tokenizer(cfg(excerpt_corpus.tokenizer))
    assert tok is not None and tok.path == excerpt_corpus.tokenizer and why == ""
    texts = sorted((Path(__file__).parents[2] / "src/scaletrain/data/excerpt").glob("k*.txt"))
    other = train_tokenizer(texts, tmp_path / "other", 1024)
    tok, why = run_tokenizer(cfg(other))  # e.g. the corpus was fetched again with another tokenizer since the run
    assert tok is None and why.startswith(f"{other} is not the tokenizer {excerpt_corpus.train_prefix}.meta.json")
    tok, why = run_tokenizer(cfg(""))
    assert tok is None and why == "the run's datasets name no tokenizer (data.tokenizer is empty)"
