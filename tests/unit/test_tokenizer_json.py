"""Hugging Face tokenizer.json tokenizers beside SentencePiece: the byte-level BPE the Llama 3.1 proxies train,
prepare and the sidecar's sha256 pin, special ids, vocabularies beyond 16 bits, and loading that runs no code."""

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from scaletrain.config import ConfigError, DataConfig, resolve  # noqa: E402
from scaletrain.data.bpe import train_bpe  # noqa: E402
from scaletrain.data.corpus import default_paths, prepare_excerpt, resolve_paths  # noqa: E402
from scaletrain.data.indexed import DataError, IndexedDataset  # noqa: E402
from scaletrain.data.prepare import load_dataset, prepare_dataset, read_meta  # noqa: E402
from scaletrain.data.tokenizer import Tokenizer  # noqa: E402

EXCERPT = sorted((Path(__file__).resolve().parents[2] / "src/scaletrain/data/excerpt").glob("*.txt"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return Tokenizer(train_bpe(EXCERPT, tmp_path_factory.mktemp("bpe") / "tokenizer.json", 512))


def test_byte_level_bpe_is_deterministic_and_round_trips_any_text(bpe, tmp_path):
    again = train_bpe(EXCERPT, tmp_path / "again.json", 512)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == bpe.sha256
    assert (bpe.kind, bpe.vocab_size, bpe.pad_id, bpe.eos_id, bpe.bos_id, bpe.unk_id) == ("json", 512, 0, 1, 2, -1)
    text = "To be, or not to be:\n  that is the question — naïve 東京 🙂\n"
    ids = bpe.encode(text)
    assert max(ids) < 512 and bpe.decode(ids) == text  # bytes, so no unknown token
    assert bpe.encode_batch([text, "x"]) == [ids, bpe.encode("x")]
    assert bpe.id_to_piece(bpe.encode(" the")[0]).startswith("Ġ")  # GPT-2 / Llama 3 byte symbols
    assert train_bpe(EXCERPT, tmp_path / "other.json", 600).read_bytes() != again.read_bytes()


def test_prepare_pins_the_tokenizer_json_and_checks_vocabularies(bpe, tmp_path):
    meta = prepare_dataset(EXCERPT[:2], tmp_path / "ds", bpe)
    assert (
        meta["tokenizer_sha256"]
        == hashlib.sha256(bpe.path.read_bytes()).hexdigest()
        == read_meta(tmp_path / "ds")["tokenizer_sha256"]
    )
    assert (meta["vocab_size"], meta["dtype"]) == (512, "uint16")
    ds = load_dataset(tmp_path / "ds", bpe, 512)
    assert bpe.decode(ds[0][:12].tolist()) == bpe.decode(bpe.encode(EXCERPT[0].read_text())[:12])
    other = Tokenizer(train_bpe(EXCERPT[:1], tmp_path / "other.json", 512))
    with pytest.raises(DataError, match="dataset was tokenized with a tokenizer of sha256"):
        load_dataset(tmp_path / "ds", other, 512)
    with pytest.raises(DataError, match="dataset vocab_size 512 != model vocab_size 1024"):
        load_dataset(tmp_path / "ds", bpe, 1024)


def _word_level(path, n):
    """A tokenizer.json of n ids ("w0" .. ) and an end-of-text token: a vocabulary wider than 16 bits."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HF

    tok = HF(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|end_of_text|>", special=True)])
    path.write_text(tok.to_str())
    return path


def test_a_vocabulary_beyond_65535_is_stored_in_32_bits(tmp_path):
    tok = Tokenizer(_word_level(tmp_path / "tokenizer.json", 128_255))
    assert (tok.vocab_size, tok.eos_id) == (128_256, 128_255)  # Llama 3's size
    (tmp_path / "a.txt").write_text("w1 w65535 w65536 w128254 w70000")
    meta = prepare_dataset([tmp_path / "a.txt"], tmp_path / "big", tok)
    assert meta["dtype"] == "int32" and meta["max_token_id"] == 128_254
    ds = load_dataset(tmp_path / "big", tok, 128_256)
    assert ds.dtype == np.int32 and ds[0].tolist() == [1, 65535, 65536, 128254, 70000]
    assert IndexedDataset(tmp_path / "big").dtype.itemsize == 4


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("content", ["pickle", "bad_json", "json_not_tokenizer", "empty"])
def test_loading_never_runs_code_and_refuses_what_is_not_a_tokenizer(content, tmp_path):
    marker = tmp_path / "ran"
    data = {
        "pickle": pickle.dumps(_Touch(marker)),
        "bad_json": b'{"model": ',
        "json_not_tokenizer": json.dumps({"model": {"type": "Python", "code": "import os"}}).encode(),
        "empty": b"",
    }[content]
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    with pytest.raises(DataError) as err:
        Tokenizer(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)
    assert not marker.exists()


def test_default_corpus_with_bpe_and_the_config_that_selects_it(tmp_path):
    corpus = prepare_excerpt(tmp_path / "shakespeare-bpe", 1024, tokenizer="bpe")
    assert corpus.tokenizer.name == "tokenizer.json" and corpus.exists()
    tok = Tokenizer(corpus.tokenizer)
    assert tok.kind == "json" and tok.vocab_size == 1024
    assert load_dataset(corpus.train_prefix, tok, 1024).num_tokens > 10_000
    assert prepare_excerpt(tmp_path / "shakespeare-bpe", 1024, tokenizer="bpe").tokenizer == corpus.tokenizer
    cfg = DataConfig(data_dir=str(tmp_path), default_tokenizer="bpe")
    assert resolve_paths(cfg) == (corpus.train_prefix, corpus.valid_prefix, corpus.tokenizer)
    assert default_paths(tmp_path, "bpe") == corpus
    with pytest.raises(DataError, match=r"run `scaletrain data fetch --tokenizer bpe`"):
        resolve_paths(DataConfig(data_dir=str(tmp_path / "none"), default_tokenizer="bpe"))
    with pytest.raises(ConfigError, match=r"data.default_tokenizer='tiktoken': must be 'sentencepiece' or 'bpe'"):
        resolve("llama-proxy", overrides=["data.default_tokenizer=tiktoken"])


def test_cli_prepare_trains_a_bpe_or_takes_a_tokenizer_json(tmp_path, capsys):
    from scaletrain.cli.main import main

    assert (
        main(["data", "prepare", str(EXCERPT[0]), "--out", str(tmp_path / "a" / "ds"), "--bpe", "--vocab-size", "400"])
        == 0
    )
    tok_file = tmp_path / "a" / "tokenizer.json"
    assert Tokenizer(tok_file).vocab_size == 400 and "vocab 400" in capsys.readouterr().out
    assert main(["data", "prepare", str(EXCERPT[1]), "--out", str(tmp_path / "b"), "--tokenizer", str(tok_file)]) == 0
    assert read_meta(tmp_path / "b")["tokenizer_sha256"] == Tokenizer(tok_file).sha256


def test_long_documents_encoded_in_pieces_equal_whole_text_encoding(bpe):
    from scaletrain.data.prepare import text_pieces

    text = EXCERPT[0].read_text()[:40_000].replace("\n", "  \n   ")  # space runs and line breaks at seams
    pieces = list(text_pieces(text, 1000))
    assert len(pieces) > 40
    assert [i for p in pieces for i in bpe.encode(p)] == bpe.encode(text)
