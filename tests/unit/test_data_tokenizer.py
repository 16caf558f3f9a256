"""Tokenizer training/loading on the packaged excerpt, prepare_dataset, and load_dataset's consistency checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scaletrain.data.corpus import prepare_excerpt
from scaletrain.data.indexed import DataError, write_indexed
from scaletrain.data.prepare import load_dataset, meta_path, prepare_dataset
from scaletrain.data.tokenizer import Tokenizer, train_tokenizer

VOCAB = 1024


@pytest.fixture(scope="session")
def excerpt(tmp_path_factory):
    """The excerpt corpus at vocab 1024, built once per test session (~0.2 s)."""
    return prepare_excerpt(tmp_path_factory.mktemp("excerpt"), VOCAB)


@pytest.fixture(scope="session")
def tok(excerpt):
    return Tokenizer(excerpt.tokenizer)


def test_special_ids_and_vocab(tok):
    assert tok.vocab_size == VOCAB
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert [tok.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert tok.bos_id == -1  # no bos, as in MLPerf gpt3
    assert tok.unk_id == 2


def test_encode_decode(tok):
    text = "To be, or not to be,\nthat is the question."
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("a\nb").count(tok.encode("\n")[-1]) == 1  # line breaks survive
    assert tok.decode(tok.encode("café 中")) == "café 中"  # byte fallback, no <unk>
    assert 2 not in tok.encode("café 中")
    assert tok.encode_batch(["Hamlet.", text]) == [tok.encode("Hamlet."), ids]
    assert tok.encode_batch([]) == []


def test_training_is_deterministic_and_path_independent(excerpt, tok, tmp_path):
    files = sorted((excerpt.root / "texts" / "train").glob("*.txt"))
    again = Tokenizer(train_tokenizer(files, tmp_path / "elsewhere" / "t", VOCAB))
    assert again.sha256 == tok.sha256
    smaller = Tokenizer(train_tokenizer(files, tmp_path / "small", 512))
    assert smaller.vocab_size == 512 and smaller.sha256 != tok.sha256


def test_digits_are_split(tmp_path):
    # Numbers frequent enough that BPE would merge them if split_digits were off.
    f = tmp_path / "numbers.txt"
    lines = (f"In {1500 + i % 120} year {i % 7}{i % 3}{i % 5} he wrote act {i % 5}.\n" for i in range(3000))
    f.write_text("".join(lines))
    t = Tokenizer(train_tokenizer([f], tmp_path / "num", 310))
    pieces = [t.id_to_piece(i) for i in t.encode("In 1599 year")]
    assert "1" in pieces and "5" in pieces

    def multi_digit(piece):
        core = piece.strip("▁")
        return core.isdigit() and len(core) > 1

    assert not any(map(multi_digit, pieces))
    assert not any(multi_digit(t.id_to_piece(i)) for i in range(t.vocab_size))


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(DataError, match="no such"):
        Tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x08\x96\x01garbage" * 50)
    with pytest.raises(DataError) as exc:
        Tokenizer(bad)
    assert str(exc.value).startswith(f"{bad}: ") and "\n" not in str(exc.value)
    with pytest.raises(DataError, match="too small"):
        train_tokenizer([bad], tmp_path / "t", 100)


def test_excerpt_corpus(excerpt, tok):
    info = excerpt.info()
    assert info["valid_works"] == ["macbeth_acts_1_2.txt"]
    assert info["tokenizer_sha256"] == tok.sha256
    train = load_dataset(excerpt.train_prefix, tok, VOCAB)
    valid = load_dataset(excerpt.valid_prefix, tok, VOCAB)
    assert len(train) == 3 and len(valid) == 1
    assert train.num_tokens == info["train_tokens"] and valid.num_tokens == info["valid_tokens"]
    assert 50_000 < train.num_tokens < 200_000 and 5_000 < valid.num_tokens < 40_000
    assert tok.decode(valid[0][:6]).startswith("MACBETH")
    meta = json.loads(meta_path(excerpt.train_prefix).read_text())
    assert meta["vocab_size"] == VOCAB and meta["num_documents"] == 3
    assert meta["max_token_id"] == int(train.tokens.max())


def test_prepare_dataset_roundtrip(tok, tmp_path):
    a, b, empty = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "e.txt"
    a.write_text("Now is the winter of our discontent\nMade glorious summer.\n")
    b.write_text('{"text": "O Romeo, Romeo!"}\n{"text": "   "}\n')
    empty.write_text("")
    meta = prepare_dataset([a, empty, b], tmp_path / "ds", tok)
    assert meta["num_documents"] == 2  # blank documents are skipped
    assert meta["tokenizer_sha256"] == tok.sha256 and meta["vocab_size"] == VOCAB
    assert meta["sources"] == [str(a), str(empty), str(b)]
    ds = load_dataset(tmp_path / "ds", tok, VOCAB)
    assert tok.decode(ds[0]) == "Now is the winter of our discontent\nMade glorious summer.\n"
    assert tok.decode(ds[1]) == "O Romeo, Romeo!"
    assert ds.tokens.tolist() == tok.encode(a.read_text()) + tok.encode("O Romeo, Romeo!")
    with pytest.raises(DataError, match="no non-empty documents"):
        prepare_dataset([empty], tmp_path / "none", tok)


def test_load_dataset_mismatches(excerpt, tok, tmp_path):
    prefix = excerpt.train_prefix
    with pytest.raises(DataError) as exc:
        load_dataset(prefix, tok, 2048)
    assert "1024" in str(exc.value) and "2048" in str(exc.value)
    other = Tokenizer(train_tokenizer(sorted((excerpt.root / "texts" / "valid").glob("*.txt")), tmp_path / "o", 512))
    with pytest.raises(DataError) as exc:
        load_dataset(prefix, other)
    msg = str(exc.value)
    assert msg.startswith(f"{meta_path(prefix)}: ") and tok.sha256[:16] in msg and other.sha256[:16] in msg
    write_indexed(tmp_path / "raw", [np.array([3, 4])], dtype=np.uint16)  # no sidecar
    with pytest.raises(DataError, match="tokenizer vocab_size 512 != model vocab_size 1024"):
        load_dataset(tmp_path / "raw", other, 1024)
    a = tmp_path / "a.txt"
    a.write_text("Some text here.")
    prepare_dataset([a], tmp_path / "small", other)
    with pytest.raises(DataError, match="dataset vocab_size 512 != model vocab_size 1024"):
        load_dataset(tmp_path / "small", other, 1024)


def test_load_dataset_range_and_stale_sidecar(tok, tmp_path):
    write_indexed(tmp_path / "raw", [np.array([3, 5000, 7])], dtype=np.uint16)  # no sidecar: scanned
    assert load_dataset(tmp_path / "raw", None, 8192).num_tokens == 3
    with pytest.raises(DataError, match=r"raw\.bin: token id 5000 outside the vocabulary \[0, 1024\)"):
        load_dataset(tmp_path / "raw", None, 1024)
    a = tmp_path / "a.txt"
    a.write_text("Some text here.")
    prepare_dataset([a], tmp_path / "ds", tok)
    write_indexed(tmp_path / "ds", [np.array([3, 4])], dtype=np.uint16)  # replaced behind the sidecar's back
    with pytest.raises(DataError, match="stale sidecar"):
        load_dataset(tmp_path / "ds", tok, VOCAB)
