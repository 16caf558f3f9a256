"""Your own data on the first try: `data prepare` on a small corpus picks a vocabulary it can build (or names the
largest one and the flag), holds out a validation tail, says where everything went, and `train`/`config` take the
dataset's vocabulary when the user set none."""

from __future__ import annotations

import json
import random
import shlex

import numpy as np
import pytest

from scaletrain.cli.main import main
from scaletrain.config import resolve
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.prepare import dataset_vocab, prepare_dataset, read_meta
from scaletrain.data.tokenizer import Tokenizer

WORDS = (
    "the a cat dog sat on mat river stone light over under quick brown fox jumps lazy green tree house bird song "
    "night day sun moon"
).split()


def write_corpus(path, n_docs=300, extra=""):
    """`n_docs` short generated documents as JSONL: far too little text for a vocabulary of 8192."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."
            f.write(json.dumps({"text": text + (extra if i == n_docs // 2 else "")}) + "\n")
    return path


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "my.jsonl")


def prepare(capsys, *argv):
    code = main(["data", "prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_flags_pick_the_largest_vocabulary_and_print_where_everything_went(corpus, tmp_path, capsys):
    out_prefix = tmp_path / "data" / "mine"
    code, out, err = prepare(capsys, corpus, "--out", out_prefix)
    assert code == 0, err
    tok = Tokenizer(tmp_path / "data" / "tokenizer.model")
    train, valid = read_meta(out_prefix), read_meta(f"{out_prefix}_valid")
    assert 300 <= tok.vocab_size < 8192 and train["vocab_size"] == valid["vocab_size"] == tok.vocab_size
    lines = out.splitlines()
    assert lines[0].startswith(f"vocabulary: {tok.vocab_size}, the largest this text gives")
    assert f"tokenizer: {tok.path}" in lines
    assert any(line.startswith(f"train: {out_prefix} (") for line in lines)
    assert any(line.startswith(f"valid: {out_prefix}_valid (") for line in lines)
    # The printed command names exactly the three paths, and they open.
    command = shlex.split(next(line for line in lines if line.startswith("train on it: ")).split(": ", 1)[1])
    assert command[:2] == ["scaletrain", "train"]
    sets = dict(s.split("=", 1) for s in command[3::2])
    assert sets == {
        "data.train_prefix": str(out_prefix),
        "data.valid_prefix": f"{out_prefix}_valid",
        "data.tokenizer": str(tok.path),
    }
    # The tokenizer learned the documents' text, not the JSON around it ('{"text": "...' and its escapes).
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    assert not [p for p in pieces if '"' in p or "{" in p or "text" in p]
    # The validation set is the last 5% of the tokens: both parts together are the whole corpus, in order.
    whole = prepare_dataset([corpus], tmp_path / "whole", tok)
    t, v = IndexedDataset(out_prefix), IndexedDataset(f"{out_prefix}_valid")
    assert v.num_tokens == -(-whole["num_tokens"] * 5 // 100) and t.num_tokens + v.num_tokens == whole["num_tokens"]
    assert np.array_equal(np.concatenate([t.tokens, v.tokens]), IndexedDataset(tmp_path / "whole").tokens)
    assert valid["split"] == {"part": "valid", "valid_fraction": 0.05} and train["split"]["part"] == "train"


@pytest.mark.hostile
def test_an_infeasible_vocab_size_names_the_largest_and_the_flag(corpus, tmp_path, capsys):
    code, _, err = prepare(capsys, corpus, "--out", tmp_path / "a" / "mine", "--vocab-size", "8192")
    assert code == 2 and len(err.strip().splitlines()) == 1
    largest = Tokenizer(_auto_tokenizer(corpus, tmp_path, capsys)).vocab_size
    assert f"the largest it gives is {largest}: set --vocab-size {largest} or less" in err
    assert not list((tmp_path / "a").glob("*")), "nothing is written"
    # That size works when asked for, and is byte for byte the tokenizer the default picks.
    assert prepare(capsys, corpus, "--out", tmp_path / "b" / "mine", "--vocab-size", largest)[0] == 0
    assert (
        Tokenizer(tmp_path / "b" / "tokenizer.model").sha256 == Tokenizer(tmp_path / "auto" / "tokenizer.model").sha256
    )
    code, _, err = prepare(capsys, corpus, "--out", tmp_path / "c" / "mine", "--vocab-size", largest + 1)
    assert code == 2 and f"set --vocab-size {largest} or less" in err


@pytest.mark.hostile
def test_an_infeasible_vocab_size_for_a_byte_level_bpe_too(corpus, tmp_path, capsys):
    code, _, err = prepare(capsys, corpus, "--out", tmp_path / "mine", "--bpe", "--vocab-size", "8192")
    largest = int(err.split("set --vocab-size ")[1].split()[0])
    assert code == 2 and 260 <= largest < 8192 and not (tmp_path / "tokenizer.json").exists()
    assert prepare(capsys, corpus, "--out", tmp_path / "mine", "--bpe")[0] == 0
    assert Tokenizer(tmp_path / "tokenizer.json").vocab_size == largest


def _auto_tokenizer(corpus, tmp_path, capsys):
    assert prepare(capsys, corpus, "--out", tmp_path / "auto" / "mine")[0] == 0
    return tmp_path / "auto" / "tokenizer.model"


def test_character_coverage_reaches_sentencepiece(tmp_path, capsys):
    rare = write_corpus(tmp_path / "rare.jsonl", extra=" Ж")  # one character in ~25,000
    pieces = {}
    for coverage in ("1", "0.9995"):
        assert prepare(capsys, rare, "--out", tmp_path / coverage / "x", "--character-coverage", coverage)[0] == 0
        tok = Tokenizer(tmp_path / coverage / "tokenizer.model")
        pieces[coverage] = [tok.id_to_piece(i) for i in tok.encode("Ж")]
    assert pieces["1"] == ["▁Ж"] and "<0xD0>" in pieces["0.9995"]


@pytest.mark.hostile
@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "nan", "inf", "most"])
def test_character_coverage_out_of_range_is_one_line(corpus, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["data", "prepare", str(corpus), "--out", str(tmp_path / "x"), f"--character-coverage={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--character-coverage" in err and ("(0, 1]" in err or "not a number" in err)
    assert not list(tmp_path.glob("x*")) and not (tmp_path / "tokenizer.model").exists()


@pytest.mark.hostile
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--bpe", "--character-coverage", "1"], "--character-coverage: a SentencePiece setting"),
        (["--tokenizer", "TOK", "--character-coverage", "1"], "--character-coverage: only for training"),
        (["--tokenizer", "TOK", "--vocab-size", "500"], "--vocab-size: only for training"),
    ],
)
def test_flags_that_would_be_ignored_are_refused(corpus, tmp_path, capsys, flags, words):
    tok = _auto_tokenizer(corpus, tmp_path, capsys)
    flags = [str(tok) if f == "TOK" else f for f in flags]
    code, _, err = prepare(capsys, corpus, "--out", tmp_path / "x", *flags)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


@pytest.mark.hostile
def test_a_tokenizer_another_dataset_uses_is_not_replaced(corpus, tmp_path, capsys):
    assert prepare(capsys, corpus, "--out", tmp_path / "mine")[0] == 0
    before = (tmp_path / "tokenizer.model").read_bytes()
    other = write_corpus(tmp_path / "other.jsonl", n_docs=200)
    code, _, err = prepare(capsys, other, "--out", tmp_path / "other")
    assert code == 2 and f"{tmp_path / 'mine'} was tokenized with it" in err and f"--tokenizer {tmp_path}" in err
    assert (tmp_path / "tokenizer.model").read_bytes() == before
    # Preparing the same dataset again replaces it (and its tokenizer) as before; --tokenizer shares the tokenizer.
    assert prepare(capsys, corpus, "--out", tmp_path / "mine")[0] == 0
    assert prepare(capsys, other, "--out", tmp_path / "other", "--tokenizer", tmp_path / "tokenizer.model")[0] == 0


def test_a_one_document_corpus_splits_inside_the_document(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text("\n".join(" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(400)))
    assert prepare(capsys, book, "--out", tmp_path / "b", "--valid-fraction", "0.1")[0] == 0
    t, v = IndexedDataset(tmp_path / "b"), IndexedDataset(tmp_path / "b_valid")
    assert len(t) == len(v) == 1 and v.num_tokens == -(-(t.num_tokens + v.num_tokens) // 10)
    assert prepare(capsys, book, "--out", tmp_path / "whole" / "b", "--valid-fraction", "0")[0] == 0
    whole = IndexedDataset(tmp_path / "whole" / "b")
    assert np.array_equal(np.concatenate([t.tokens, v.tokens]), whole.tokens)


def test_config_takes_the_datasets_vocabulary_unless_the_user_sets_one(corpus, tmp_path, capsys):
    prefix = tmp_path / "mine"
    assert prepare(capsys, corpus, "--out", prefix)[0] == 0
    vocab = read_meta(prefix)["vocab_size"]
    data = [f"data.train_prefix={prefix}", f"data.valid_prefix={prefix}_valid"]
    assert resolve("gpt3-proxy", overrides=data, dataset_vocab=dataset_vocab).model.vocab_size == vocab
    # Set by the user (--set, or a --config file): kept, and the run refuses the dataset (load_dataset).
    assert (
        resolve("gpt3-proxy", overrides=[*data, "model.vocab_size=8192"], dataset_vocab=dataset_vocab).model.vocab_size
        == 8192
    )
    toml = tmp_path / "mine.toml"
    toml.write_text("[model]\nvocab_size = 1024\n")
    assert resolve("gpt3-proxy", str(toml), data, dataset_vocab=dataset_vocab).model.vocab_size == 1024
    # The default corpus, or a dataset with no sidecar, leaves the preset's.
    assert resolve("gpt3-proxy", dataset_vocab=dataset_vocab).model.vocab_size == 8192
    (tmp_path / "mine.meta.json").unlink()
    assert resolve("gpt3-proxy", overrides=data, dataset_vocab=dataset_vocab).model.vocab_size == 8192


def test_the_config_command_shows_the_vocabulary_train_will_use(corpus, tmp_path, capsys):
    prefix = tmp_path / "mine"
    assert prepare(capsys, corpus, "--out", prefix)[0] == 0
    vocab = read_meta(prefix)["vocab_size"]
    assert main(["config", "--set", f"data.train_prefix={prefix}", "--set", f"data.valid_prefix={prefix}_valid"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["model"]["vocab_size"] == vocab
    assert f"model.vocab_size={vocab} from {prefix}.meta.json (the preset gpt3-proxy's 8192" in err


@pytest.mark.hostile
def test_too_little_text_for_any_tokenizer_is_one_line(tmp_path, capsys):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "ab ab ab"}\n')
    code, _, err = prepare(capsys, tiny, "--out", tmp_path / "x")
    assert code == 2 and "too little text for a tokenizer: it gives" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("x*")) and not (tmp_path / "tokenizer.model").exists()
